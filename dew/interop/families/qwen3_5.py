"""Qwen 3.5 with images (`model_type` "qwen3_5", transformers' `Qwen3_5ForConditionalGeneration`; and "qwen3_5_moe",
`Qwen3_5MoeForConditionalGeneration`, over a `qwen3_5_moe_text` decoder): a `qwen3_5_text`
decoder (Gated DeltaNet and gated attention layers, a three-axis rotary), Qwen 3.5's vision tower and its patch
merger, as a `dew.nn.multimodal.MultimodalTransformer`.

config.json holds the decoder's fields in `text_config` (the `qwen3_5_text` family reads them), the tower's in
`vision_config` (`dew.nn.vision`'s `qwen3_5` reader), and at the top the placeholder ids: `image_token_id`
(`<|image_pad|>`) marks the slots soft tokens fill, one run per image of `t * h * w / merge**2` slots for its
grid of `t x h x w` patches; `<|vision_start|>`, `<|vision_end|>` stay text. Image tokens read causally, as
text does. Videos (`video_token_id`) are not built. Tensors: `model.language_model.*`, `lm_head.weight`,
`model.visual.*` (the merger `model.visual.merger.*`), as transformers 5 writes them; the multi-token-prediction
tensors (`mtp.*`) are dropped, as transformers drops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.multimodal import Layout, MultimodalFamily, layout_of, read_parts
from dew.interop.families.qwen3_next import QWEN3_5_MOE_TEXT, QWEN3_5_TEXT
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.multimodal import MultimodalConfig
from dew.nn.transformer import DecoderConfig

MODEL_TYPE = "qwen3_5"
TOWER, PROJECTOR = "qwen3_5", "qwen3_5"
# Qwen3_5Config's own fields (transformers 5), with its defaults.
_FIELDS = {"text_config": None, "vision_config": None, "image_token_id": 248056, "video_token_id": 248057,
           "vision_start_token_id": 248053, "vision_end_token_id": 248054, "tie_word_embeddings": False}
_LAYOUTS = (Layout("model.language_model.", "lm_head.weight", "model.visual.", "model.visual.merger."),)


@dataclasses.dataclass(frozen=True)
class Qwen35Family(MultimodalFamily):
    """The `qwen3_5` family (and `qwen3_5_moe`, the same over `text`, Qwen 3.5-MoE's text family): config.json
    to `MultimodalConfig` and back, and its tensor rules."""

    model_type: str = MODEL_TYPE
    architecture: str = "Qwen3_5ForConditionalGeneration"
    config_class: str = "Qwen3_5Config"
    text: Any = QWEN3_5_TEXT
    gguf: None = None

    def model_config(self, source: Mapping[str, Any], where: str = "config.json", **text_knobs) -> MultimodalConfig:
        """The model a qwen3_5 config.json describes; `text_knobs` set the decoder's runtime fields."""
        fields = ConfigFields(source, Converter(self.model_type, self.config_class, self.architecture, _FIELDS, ()),
                              where)
        text, tower, projector = read_parts(fields, self.text, TOWER, PROJECTOR, where)
        for name in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
            fields.get(name)  # the processor's markers (videos are not built): plain text tokens to the model
        image_token = fields.get("image_token_id")
        fields.require("is_causal", (True,), "the text decoder is causal; set it to true")
        fields.finish()
        return MultimodalConfig(DecoderConfig(**{**text, **text_knobs}), TOWER, tower, PROJECTOR, projector,
                                int(image_token), None, bidirectional_images=False)

    def layout(self, names: Collection[str] | None) -> Layout:
        """The tensor layout a checkpoint holding `names` uses."""
        return layout_of(_LAYOUTS, names, "Qwen 3.5")

    def tensor_rules(self, config: MultimodalConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        """The rules between the checkpoint's tensors and the model's variables."""
        return self.layout(names).rules(config, self.text.tensor_rules(config.text, names))

    def ignorable(self, name: str, config: MultimodalConfig) -> bool:
        """A tied head's copy and the multi-token-prediction tensors, which transformers drops too."""
        return name.startswith("mtp.") or (name.endswith("lm_head.weight") and config.text.tie_embeddings)


QWEN3_5 = Qwen35Family()
QWEN3_5_MOE = Qwen35Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", QWEN3_5_MOE_TEXT)
