"""Gemma 3 with images (`model_type` "gemma3", transformers' `Gemma3ForConditionalGeneration`): a
`gemma3_text` decoder, a SigLIP tower and Gemma's projector, as a `dew.nn.multimodal.MultimodalTransformer`.

config.json holds the decoder's fields in `text_config` (read by the `gemma3_text` family), the
tower's in `vision_config` (`dew.nn.vision`'s `siglip` reader) and, at the top, the soft tokens an
image fills (`mm_tokens_per_image`) and the placeholder ids. Checkpoints come in two tensor layouts,
the one published checkpoints use (`language_model.model.*`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`) and transformers 5's own (`model.language_model.*`, `model.vision_tower.*`,
`lm_head.weight`); a load reads whichever the file holds, and a save writes it back the same way.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from dew.interop import vision
from dew.interop.families.converter import Converter
from dew.interop.families.gemma import GEMMA3_TEXT
from dew.interop.families.llama import DECODER_RULES
from dew.interop.families.multimodal import Layout, layout_of
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.multimodal import MultimodalConfig
from dew.nn.transformer import DecoderConfig
from dew.nn.vision import projector_config, tower_config

MODEL_TYPE = "gemma3"
TOWER, PROJECTOR = "siglip", "gemma"
# Gemma3Config's own fields (transformers 5), with its defaults.
_FIELDS = {"text_config": None, "vision_config": None, "mm_tokens_per_image": 256, "boi_token_index": 255_999,
           "eoi_token_index": 256_000, "image_token_index": 262_144, "initializer_range": 0.02,
           "tie_word_embeddings": True}
_TOP = Converter(MODEL_TYPE, "Gemma3Config", "Gemma3ForConditionalGeneration", _FIELDS, ())


HUB = Layout("language_model.model.", "language_model.lm_head.weight", "vision_tower.vision_model.",
             "multi_modal_projector.")
TRANSFORMERS = Layout("model.language_model.", "lm_head.weight", "model.vision_tower.", "model.multi_modal_projector.")
# transformers 5 saves the tower without SigLIP's `vision_model.` level, under either top layout
_LAYOUTS = (HUB, TRANSFORMERS, dataclasses.replace(HUB, tower="vision_tower."),
            dataclasses.replace(TRANSFORMERS, tower="model.vision_tower.vision_model."))


@dataclasses.dataclass(frozen=True)
class Gemma3Family:
    """The `gemma3` family: config.json to `MultimodalConfig` and back, and its tensor rules."""

    writes_decoders: ClassVar[bool] = False  # `family_for` never picks it for a text-only decoder
    multimodal: ClassVar[bool] = True
    model_type: str = MODEL_TYPE
    architecture: str = "Gemma3ForConditionalGeneration"
    gguf: None = None

    def model_config(self, source: Mapping[str, Any], where: str = "config.json", **text_knobs) -> MultimodalConfig:
        """The model a gemma3 config.json describes; `text_knobs` set the decoder's runtime fields (dtypes,
        `max_seq_len`, `scan_layers`, ...)."""
        fields = ConfigFields(source, _TOP, where)
        text_record = dict(fields.get("text_config") or {})
        text = GEMMA3_TEXT.decoder_kwargs(text_record, where=f"{where} text_config")
        if text["logit_softcap"] is not None:
            # Gemma3ForConditionalGeneration's head caps nothing, whatever its text config says
            warnings.warn(f"{where} text_config sets final_logit_softcapping {text['logit_softcap']}, which "
                          "transformers' Gemma3ForConditionalGeneration does not apply; Dew computes what it computes "
                          "(uncapped logits)", stacklevel=3)
            text["logit_softcap"] = None
        tied = fields.get("tie_word_embeddings")
        if bool(tied) != text["tie_embeddings"]:
            fields.refuse("tie_word_embeddings", tied, f"text_config says {text['tie_embeddings']}, and one output head "
                          "serves both: give the two the same value")
        tokens = fields.get("mm_tokens_per_image")
        tower = tower_config(TOWER, dict(fields.get("vision_config") or {}), f"{where} vision_config")
        projector = projector_config(PROJECTOR, source, where)
        image_token = fields.get("image_token_index", "image_token_id")
        for name, alias in (("boi_token_index", "boi_token_id"), ("eoi_token_index", "eoi_token_id")):
            fields.get(name, alias)  # the processor's markers: plain text tokens to the model
        fields.require("is_causal", (True,), "the text decoder is causal; set it to true")
        fields.finish()
        return MultimodalConfig(DecoderConfig(**{**text, **text_knobs}), TOWER, tower, PROJECTOR, projector,
                                int(image_token), int(tokens))

    def layout(self, names: Collection[str] | None) -> Layout:
        """The tensor layout a checkpoint holding `names` uses (the published one for None)."""
        return layout_of(_LAYOUTS, names, "Gemma 3")

    def tensor_rules(self, config: MultimodalConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        """The rules between the checkpoint's tensors and the model's variables, in the layout `names` use."""
        return self.layout(names).rules(config, DECODER_RULES)

    def ignorable(self, name: str, config: MultimodalConfig) -> bool:
        """Tensors transformers drops too: a tied head's copy, and the tower's pooling head, which Gemma 3
        never runs."""
        if name.endswith("lm_head.weight"):
            return config.text.tie_embeddings
        return any(name.startswith(prefix) and vision.tower_ignorable(config.tower_kind, name, prefix)
                   for prefix in vision.TOWER_PREFIXES[config.tower_kind])

    def fit_to_weights(self, kwargs, names):
        return kwargs

    def written(self, config: MultimodalConfig, source: Mapping[str, Any]) -> dict[str, Any]:
        """config.json for a save: the source's, its tower saying it has no pooling head (a save writes none)."""
        written = dict(source)
        written["vision_config"] = {**dict(source.get("vision_config") or {}), "vision_use_head": False}
        return written


GEMMA3 = Gemma3Family()
