"""Gemma 4 with images and audio (`model_type` "gemma4", transformers' `Gemma4ForConditionalGeneration`): a
`gemma4_text` decoder, Gemma 4's vision tower and embedder, and, where config.json has an `audio_config`, Gemma 4's
audio tower and its embedder, as a `dew.nn.multimodal.MultimodalTransformer`.

config.json holds the decoder's fields in `text_config` (the `gemma4_text` family reads them), the vision tower's
in `vision_config` (`dew.nn.vision`'s `gemma4` reader), the audio tower's in `audio_config` (`dew.nn.audio`'s
`gemma4_audio`), and at the top the placeholder ids. `image_token_id` marks the slots an image's soft tokens
fill (one run an image, as many as its patches over `k**2`, between `boi_token_id` and `eoi_token_id`), and
`audio_token_id` those of a clip's encoded frames (one a frame, between `boa_token_id` and
`eoa_token_index`). The model reads every image, video and audio placeholder as the pad id before embedding,
as transformers does; videos are not encoded (their processor needs torchvision), so a video placeholder keeps
the pad embedding, as transformers' model computes it without video pixels. With `text_config`'s
`use_bidirectional_attention` "vision", an image's (or a video's) soft tokens read each other in both
directions in the sliding layers, causally in the full ones; "all" is refused by the text family. Tensors:
`model.language_model.*`, `model.vision_tower.*`, `model.embed_vision.*`, `model.audio_tower.*`,
`model.embed_audio.*` (the tied head writes no `lm_head.weight`), as transformers 5 writes them; the clipping
bounds and the vision tower's standardization load into the frozen `constants` collection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.gemma4 import GEMMA4_TEXT
from dew.interop.families.multimodal import Layout, MultimodalFamily, audio_rules, layout_of, read_parts
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.audio import audio_config
from dew.nn.multimodal import AudioPart, MultimodalConfig
from dew.nn.transformer import DecoderConfig
from dew.nn.vision import Gemma4ProjectorConfig

MODEL_TYPE = "gemma4"
TOWER, PROJECTOR, AUDIO_TOWER = "gemma4", "gemma4", "gemma4_audio"
# Gemma4Config's own fields (transformers 5), with its defaults.
_FIELDS = {"text_config": None, "vision_config": None, "audio_config": None, "boi_token_id": 255_999,
           "eoi_token_id": 258_882, "image_token_id": 258_880, "video_token_id": 258_884, "boa_token_id": 256_000,
           "eoa_token_index": 258_883, "audio_token_id": 258_881, "initializer_range": 0.02,
           "tie_word_embeddings": True}
_TOP = Converter(MODEL_TYPE, "Gemma4Config", "Gemma4ForConditionalGeneration", _FIELDS, ())
_LAYOUTS = (Layout("model.language_model.", "lm_head.weight", "model.vision_tower.", "model.embed_vision."),)
_AUDIO, _AUDIO_PROJECTOR = "model.audio_tower.", "model.embed_audio."


@dataclasses.dataclass(frozen=True)
class Gemma4Family(MultimodalFamily):
    """The `gemma4` family: config.json to `MultimodalConfig` and back, and its tensor rules."""

    model_type: str = MODEL_TYPE
    architecture: str = "Gemma4ForConditionalGeneration"
    gguf: None = None

    def model_config(self, source: Mapping[str, Any], where: str = "config.json", **text_knobs) -> MultimodalConfig:
        """The model a gemma4 config.json describes; `text_knobs` set the decoder's runtime fields."""
        fields = ConfigFields(source, _TOP, where)
        text_record = dict(fields.get("text_config") or {})
        text, tower, projector = read_parts(fields, GEMMA4_TEXT, TOWER, PROJECTOR, where)
        pad = text_record.get("pad_token_id", 0)
        if pad != 0:  # the decoder embeds a soft token's slot as id 0 for its per-layer inputs
            raise ValueError(f"{where} text_config pad_token_id is {pad}; Dew reads Gemma 4's placeholders as the pad "
                             "id 0, which every Gemma 4 checkpoint uses: write 0")
        ids = {name: int(fields.get(name)) for name in ("image_token_id", "video_token_id", "audio_token_id")}
        for name in ("boi_token_id", "eoi_token_id", "boa_token_id", "eoa_token_index"):
            fields.get(name)  # the processor's markers: plain text tokens to the model
        audio_record = fields.get("audio_config")
        audio_part = None
        if audio_record is not None:
            tower_config = audio_config(AUDIO_TOWER, dict(audio_record), f"{where} audio_config")
            embedder = Gemma4ProjectorConfig(tower_config.output_proj_dims, text["emb_features"],
                                             tower_config.rms_norm_eps)
            audio_part = AudioPart(AUDIO_TOWER, tower_config, PROJECTOR, embedder, ids["audio_token_id"])
        fields.require("is_causal", (True,), "the text decoder is causal; set it to true")
        fields.finish()
        bidirectional = text_record.get("use_bidirectional_attention") == "vision"
        return MultimodalConfig(DecoderConfig(**{**text, **text_knobs}), TOWER, tower, PROJECTOR, projector,
                                ids["image_token_id"], None, bidirectional_images=bidirectional, audio=audio_part,
                                pad_ids=tuple(sorted(set(ids.values()))))

    def layout(self, names: Collection[str] | None) -> Layout:
        """The tensor layout a checkpoint holding `names` uses."""
        return layout_of(_LAYOUTS, names, "Gemma 4")

    def tensor_rules(self, config: MultimodalConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        """The rules between the checkpoint's tensors and the model's variables (collections merged: the clipping
        bounds and standardization sit beside the parameters at their paths)."""
        rules = self.layout(names).rules(config, GEMMA4_TEXT.tensor_rules(config.text, names))
        if config.audio is None:
            return rules
        return rules + audio_rules(config.audio, _AUDIO, _AUDIO_PROJECTOR)


GEMMA4 = Gemma4Family()
