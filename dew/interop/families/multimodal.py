"""What the multimodal families share (Gemma 3, Llama 4): where a checkpoint keeps its decoder, tower and
projector (`Layout`), finding the layout a checkpoint's tensor names use, and the rules of the whole
model in one layout, the decoder's under `language_model/`, the tower's under `tower/`, the projector's
under `projector/`, and an audio tower's and projector's (`audio_rules`) under `audio_tower/` and
`audio_projector/`."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from dew.interop import audio, vision
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.multimodal import LANGUAGE_MODEL, AudioPart, MultimodalConfig
from dew.nn.vision import projector_config, tower_config


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps each part: the decoder's `model.` prefix (`language`), its head's name,
    and the tower's and projector's prefixes."""

    language: str
    head: str
    tower: str
    projector: str

    def rules(self, config: MultimodalConfig, decoder_rules: Sequence[Rule]) -> tuple[Rule, ...]:
        """The rules between a checkpoint in this layout and the model's variables, from the text family's
        `decoder_rules` (over `model.*` and `lm_head.weight`) and the tower's and projector's own."""

        def decoder(name: str) -> str:
            return self.head if name == "lm_head.weight" else self.language + name.removeprefix("model.")

        rules = [dataclasses.replace(rule, dew=tuple(f"{LANGUAGE_MODEL}/{path}" for path in rule.dew),
                                     tensor=tuple(decoder(name) for name in rule.tensor)) for rule in decoder_rules]
        rules += vision.tower_rules(config.tower_kind, config.tower, self.tower, dew_prefix="tower/")
        rules += vision.projector_rules(config.projector_kind, config.projector, self.projector,
                                        dew_prefix="projector/")
        return tuple(rules)


def layout_of(layouts: Sequence[Layout], names: Collection[str] | None, family: str) -> Layout:
    """The first of `layouts` whose decoder embedding and tower a checkpoint holding tensors `names` holds
    (the first of them for None: the layout a save writes from scratch); `family` names it in errors."""
    if names is None:
        return layouts[0]
    names = set(names)
    for layout in layouts:
        if f"{layout.language}embed_tokens.weight" in names and any(n.startswith(layout.tower) for n in names):
            return layout
    raise ValueError(f"the checkpoint's tensors ({sorted(names)[:3]} ...) are not in a {family} layout Dew knows: "
                     f"it reads {sorted({layout.language + 'embed_tokens.weight' for layout in layouts})} beside the "
                     "vision tower's and projector's tensors")


def read_parts(fields: ConfigFields, text_family, tower_kind: str, projector_kind: str, where: str):
    """(the decoder's keyword arguments, the tower's config, the projector's config) of a multimodal config.json
    read through `fields`: `text_config` by the text family, `vision_config` by the tower's reader, the whole
    record by the projector's; a top-level `tie_word_embeddings` that `text_config` contradicts is refused."""
    text = text_family.decoder_kwargs(dict(fields.get("text_config") or {}), where=f"{where} text_config")
    tied = fields.get("tie_word_embeddings")
    if bool(tied) != text["tie_embeddings"]:
        fields.refuse("tie_word_embeddings", tied, f"text_config says {text['tie_embeddings']}, and one output head "
                      "serves both: give the two the same value")
    tower = tower_config(tower_kind, dict(fields.get("vision_config") or {}), f"{where} vision_config")
    return text, tower, projector_config(projector_kind, fields.source, where)


@dataclasses.dataclass(frozen=True)
class MultimodalFamily:
    """What the multimodal families share: they write no text decoder (`family_for` never picks one), a tied
    head's copy in a checkpoint is dropped as transformers drops it, and a save writes the source's config.json
    back (a load changes no field of it)."""

    writes_decoders: ClassVar[bool] = False
    multimodal: ClassVar[bool] = True

    def ignorable(self, name: str, config: MultimodalConfig) -> bool:
        """A tied head's copy, which transformers drops too."""
        return name.endswith("lm_head.weight") and config.text.tie_embeddings

    def fit_to_weights(self, kwargs, names):
        return kwargs

    def written(self, config: MultimodalConfig, source: Mapping[str, Any]) -> dict[str, Any]:
        """config.json for a save: the source's."""
        return dict(source)


def audio_rules(part: AudioPart, tower: str, projector: str) -> tuple[Rule, ...]:
    """The rules of an audio tower under the checkpoint prefix `tower` and its projector under `projector`, at the
    model's `audio_tower/` and `audio_projector/` (the tower's own rules name each variable's collection first; the
    model's merged tree has none)."""
    tower_rules = tuple(dataclasses.replace(rule, dew=tuple("audio_tower/" + path.split("/", 1)[1] for path in rule.dew))
                        for rule in audio.audio_rules(part.tower_kind, part.tower, tower))
    return tower_rules + vision.projector_rules(part.projector_kind, part.projector, projector,
                                                dew_prefix="audio_projector/")
