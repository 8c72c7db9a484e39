"""Gemma 3n with images and audio (`model_type` "gemma3n", transformers' `Gemma3nForConditionalGeneration`): a
`gemma3n_text` decoder, the MobileNet-v5 tower and Gemma 3n's vision embedder, and its audio tower (`gemma3n_audio`)
and audio embedder, as a `dew.nn.multimodal.MultimodalTransformer`.

config.json holds the decoder's fields in `text_config` (the `gemma3n_text` family reads them), the tower's in
`vision_config` (`dew.nn.vision`'s `gemma3n` reader), the audio encoder's in `audio_config`, and at the top the
soft tokens an image and a clip fill and the placeholder ids. Token ids in each embedder's hard range
(`vocab_offset` and the `vocab_size` after it: `<end_of_image>`, `<image_soft_token>`, `<end_of_audio>`,
`<audio_soft_token>` among them) embed through that embedder, not the decoder's table; each image's
`vision_soft_tokens_per_image` placeholders take its soft tokens, which read causally, as text does, and each
audio clip's `audio_soft_tokens_per_image` placeholders its encoded frames, the slots past them (and its padding
frames) the audio embedder's embedding of the vocabulary's last id. Tensors:
`model.language_model.*`, `model.vision_tower.timm_model.*`, `model.embed_vision.*`, `model.audio_tower.*`,
`model.embed_audio.*` (a tied head's `lm_head.weight` is dropped, as transformers drops it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from dew.files import read_json
from dew.interop.families.converter import Converter
from dew.interop.families.gemma3n import GEMMA3N_TEXT
from dew.interop.families.multimodal import Layout, MultimodalFamily, audio_rules, layout_of, read_parts
from dew.interop.hf_decoders import ConfigFields
from dew.interop.hub import PROCESSOR_FILES
from dew.interop.tensors import Rule
from dew.interop.vision import GEMMA3N_AUDIO_PREFIXES
from dew.nn.audio import audio_config
from dew.nn.multimodal import AudioPart, MultimodalConfig
from dew.nn.transformer import DecoderConfig
from dew.nn.vision import Gemma3nEmbedderConfig

MODEL_TYPE = "gemma3n"
TOWER, PROJECTOR, AUDIO_TOWER = "gemma3n", "gemma3n", "gemma3n_audio"
# Gemma3nConfig's own fields (transformers 5), with its defaults.
_FIELDS = {"text_config": None, "vision_config": None, "audio_config": None, "audio_soft_tokens_per_image": 188,
           "vision_soft_tokens_per_image": 256, "boi_token_id": 255_999, "eoi_token_id": 262_144,
           "image_token_id": 262_145, "boa_token_id": 256_000, "eoa_token_id": 262_272, "audio_token_id": 262_273,
           "initializer_range": 0.02, "tie_word_embeddings": True, "use_cache": True}
_TOP = Converter(MODEL_TYPE, "Gemma3nConfig", "Gemma3nForConditionalGeneration", _FIELDS, ())
_LAYOUTS = (Layout("model.language_model.", "lm_head.weight", "model.vision_tower.timm_model.", "model.embed_vision."),)
_AUDIO, _AUDIO_PROJECTOR = "model.audio_tower.", GEMMA3N_AUDIO_PREFIXES[0]


@dataclasses.dataclass(frozen=True)
class Gemma3nFamily(MultimodalFamily):
    """The `gemma3n` family: config.json to `MultimodalConfig` and back, and its tensor rules."""

    model_type: str = MODEL_TYPE
    architecture: str = "Gemma3nForConditionalGeneration"
    gguf: None = None

    def model_config(self, source: Mapping[str, Any], where: str = "config.json", **text_knobs) -> MultimodalConfig:
        """The model a gemma3n config.json describes; `text_knobs` set the decoder's runtime fields."""
        fields = ConfigFields(source, _TOP, where)
        text, tower, vision = read_parts(fields, GEMMA3N_TEXT, TOWER, PROJECTOR, where)
        audio = Gemma3nEmbedderConfig.from_hf(source, where, "audio")
        pad = dict(fields.source.get("text_config") or {}).get("pad_token_id", 0)
        if pad != 0:  # the decoder freezes row 0 of its tables, transformers' padding_idx
            raise ValueError(f"{where} text_config pad_token_id is {pad}; Dew keeps Gemma 3n's pad row at id 0, which "
                             "every Gemma 3n checkpoint uses: write 0")
        for embedder in (vision, audio):
            if embedder.text_hidden != text["emb_features"]:
                fields.refuse("text_config", {"hidden_size": embedder.text_hidden}, "the embedders write the text "
                              "model's width: give text_config its hidden_size")
        if vision.vocab_offset + vision.vocab_size != audio.vocab_offset or audio.vocab_offset + audio.vocab_size > \
                text["vocab_size"]:
            fields.refuse("audio_config", {"vocab_offset": audio.vocab_offset}, "transformers embeds the ids from the "
                          "vision embedder's vocab_offset up to the audio one's through the vision embedder and the "
                          "rest through the audio one: the audio ids follow the vision ids and end inside text_config's "
                          "vocab_size")
        tokens = fields.get("vision_soft_tokens_per_image")
        if tokens != tower.geometry().patches:
            fields.refuse("vision_soft_tokens_per_image", tokens, f"the tower gives {tower.geometry().patches} soft "
                          "tokens an image (msfa_output_resolution squared): give that")
        tower_record = dict(fields.get("audio_config") or {})
        # a clip fills audio_soft_tokens_per_image slots, the unused ones reading the last text id's embedding (the
        # audio embedder's last hard id), as transformers pads them
        padding = text["vocab_size"] - 1
        if not audio.vocab_offset <= padding < audio.vocab_offset + audio.vocab_size:
            fields.refuse("audio_config", {"vocab_offset": audio.vocab_offset}, f"transformers fills unused audio slots "
                          f"with the audio embedder's embedding of id {padding} (text_config's vocab_size - 1): the "
                          "audio ids end where the vocabulary does")
        audio_part = AudioPart(AUDIO_TOWER, audio_config(AUDIO_TOWER, tower_record, f"{where} audio_config"), PROJECTOR,
                               audio, int(fields.get("audio_token_id")),
                               int(fields.get("audio_soft_tokens_per_image")), padding)
        for name in ("boi_token_id", "eoi_token_id", "boa_token_id", "eoa_token_id",
                     "initializer_range", "use_cache"):
            fields.get(name)  # the processor's markers (hard ids, or text), and what a load does not use
        image_token = fields.get("image_token_id")
        fields.require("is_causal", (True,), "the text decoder is causal; set it to true")
        fields.finish()
        return MultimodalConfig(DecoderConfig(**{**text, **text_knobs}), TOWER, tower, PROJECTOR, vision,
                                int(image_token), tokens, bidirectional_images=False, audio=audio_part,
                                hard_ids=True)

    def fit_to_processor(self, config: MultimodalConfig, directory: Path) -> MultimodalConfig:
        """`config` with the tower's image size the processor's files in `directory` resize to (config.json cannot
        say it; without processor files, the published 768)."""
        for name in PROCESSOR_FILES:
            path = directory / name
            if not path.is_file():
                continue
            record, problem = read_json(path, object_only=True)
            if problem is not None:
                raise ValueError(f"{path} {problem}: it is damaged or not a processor config; fetch or write it again")
            size = (record.get("image_processor") or record).get("size") or {}
            height, width = size.get("height"), size.get("width")
            if height is None:
                continue
            if height != width:
                raise ValueError(f"{path} resizes images to {height} x {width} pixels; Gemma 3n's tower reads square "
                                 "images: give the image processor one size for both")
            return dataclasses.replace(config, tower=dataclasses.replace(config.tower, image_size=int(height)))
        return config

    def layout(self, names: Collection[str] | None) -> Layout:
        """The tensor layout a checkpoint holding `names` uses."""
        return layout_of(_LAYOUTS, names, "Gemma 3n")

    def tensor_rules(self, config: MultimodalConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        """The rules between the checkpoint's tensors and the model's variables."""
        rules = self.layout(names).rules(config, GEMMA3N_TEXT.tensor_rules(config.text))
        return rules + audio_rules(config.audio, _AUDIO, _AUDIO_PROJECTOR)


GEMMA3N = Gemma3nFamily()
