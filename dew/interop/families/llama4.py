"""Llama 4 with images (`model_type` "llama4", transformers' `Llama4ForConditionalGeneration`): a `llama4_text`
decoder, Llama 4's vision tower and its projector, as a `dew.nn.multimodal.MultimodalTransformer`.

config.json holds the decoder's fields in `text_config` (the `llama4_text` family reads them), the tower's
in `vision_config` (`dew.nn.vision`'s `llama4` reader), and at the top the placeholder ids:
`image_token_index` is `<|patch|>`, the slots soft tokens fill; `<|image_start|>`, `<|image_end|>`, the
tile separators and `<|image|>` (before the global tile) stay text. Each tile (an image's local tiles,
then its global one) fills one run of `tokens` soft tokens; they read causally, as text does (transformers
builds Llama 4's masks from the text model's alone). Tensors: `language_model.model.*`,
`language_model.lm_head.weight`, `vision_model.*`, `multi_modal_projector.*` (transformers 5 writes
these; a `model.`-prefixed layout is read too), saved back the way they came.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.llama4_text import LLAMA4_TEXT
from dew.interop.families.multimodal import Layout, MultimodalFamily, layout_of, read_parts
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.multimodal import MultimodalConfig
from dew.nn.transformer import DecoderConfig

MODEL_TYPE = "llama4"
TOWER, PROJECTOR = "llama4", "llama4"
# Llama4Config's own fields (transformers 5), with its defaults.
_FIELDS = {"text_config": None, "vision_config": None, "boi_token_index": 200080, "eoi_token_index": 200081,
           "image_token_index": 200092, "tie_word_embeddings": False}
_TOP = Converter(MODEL_TYPE, "Llama4Config", "Llama4ForConditionalGeneration", _FIELDS, ())

_LAYOUTS = (Layout("language_model.model.", "language_model.lm_head.weight", "vision_model.", "multi_modal_projector."),
            Layout("model.language_model.", "lm_head.weight", "model.vision_model.",
                            "model.multi_modal_projector."))


@dataclasses.dataclass(frozen=True)
class Llama4Family(MultimodalFamily):
    """The `llama4` family: config.json to `MultimodalConfig` and back, and its tensor rules."""

    model_type: str = MODEL_TYPE
    architecture: str = "Llama4ForConditionalGeneration"
    gguf: None = None

    def model_config(self, source: Mapping[str, Any], where: str = "config.json", **text_knobs) -> MultimodalConfig:
        """The model a llama4 config.json describes; `text_knobs` set the decoder's runtime fields."""
        fields = ConfigFields(source, _TOP, where)
        text, tower, projector = read_parts(fields, LLAMA4_TEXT, TOWER, PROJECTOR, where)
        if projector.text_hidden != text["emb_features"]:
            fields.refuse("text_config", {"hidden_size": projector.text_hidden}, "the projector writes soft tokens "
                          "of the text model's width: give text_config its hidden_size")
        for name in ("boi_token_index", "eoi_token_index"):
            fields.get(name)  # the processor's markers: plain text tokens to the model
        image_token = fields.get("image_token_index", "image_token_id")
        fields.require("is_causal", (True,), "the text decoder is causal; set it to true")
        fields.finish()
        return MultimodalConfig(DecoderConfig(**{**text, **text_knobs}), TOWER, tower, PROJECTOR, projector,
                                int(image_token), tower.tokens, bidirectional_images=False)

    def layout(self, names: Collection[str] | None) -> Layout:
        """The tensor layout a checkpoint holding `names` uses (transformers 5's module names for None)."""
        return layout_of(_LAYOUTS, names, "Llama 4")

    def tensor_rules(self, config: MultimodalConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        """The rules between the checkpoint's tensors and the model's variables, in the layout `names` use."""
        return self.layout(names).rules(config, LLAMA4_TEXT.tensor_rules(config.text))


LLAMA4 = Llama4Family()
