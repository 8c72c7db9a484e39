"""Vision towers and projectors by name, each a frozen config read from a transformers record.

A tower config (`TOWERS`) reads its `vision_config` record (`from_hf`), writes it back (`to_hf`), says
what images it takes (`geometry()`) and builds a module `[N, C, H, W] -> [N, P, width]` (`build`); a
projector config (`PROJECTORS`) reads the multimodal model's record and builds a module from the tower's
`[N, P, width]` to soft tokens `[N, tokens, text width]`. Qwen 3.5's tower reads patch vectors with each
image's patch grid instead (`dew.nn.vision.qwen35`): its images differ in size; Gemma 4's reads padded patch
streams with each patch's position (`dew.nn.vision.gemma4`). Their checkpoint tensor rules live in
`dew.interop.vision`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.nn.vision.base import TowerGeometry
from dew.nn.vision.gemma3n import Gemma3nEmbedder, Gemma3nEmbedderConfig, Gemma3nProjectorModule
from dew.nn.vision.gemma4 import (Gemma4Projector, Gemma4ProjectorConfig, Gemma4ProjectorModule, Gemma4Tower,
                                  Gemma4VisionConfig)
from dew.nn.vision.llama4 import Llama4Tower, Llama4VisionConfig
from dew.nn.vision.mobilenet import MobileNetV5Config, MobileNetV5Tower
from dew.nn.vision.projectors import GemmaProjector, GemmaProjectorConfig, Llama4Projector, Llama4ProjectorConfig
from dew.nn.vision.qwen35 import Qwen35Merger, Qwen35MergerConfig, Qwen35Tower, Qwen35VisionConfig
from dew.nn.vision.siglip import SiglipConfig, SiglipTower

TOWERS: dict[str, type] = {"siglip": SiglipConfig, "llama4": Llama4VisionConfig, "qwen3_5": Qwen35VisionConfig,
                           "gemma4": Gemma4VisionConfig}
PROJECTORS: dict[str, type] = {"gemma": GemmaProjectorConfig, "llama4": Llama4ProjectorConfig,
                               "qwen3_5": Qwen35MergerConfig, "gemma4": Gemma4ProjectorConfig}
TOWERS["gemma3n"] = MobileNetV5Config
PROJECTORS["gemma3n"] = Gemma3nEmbedderConfig  # one per modality: from_hf(record, where, modality="audio")


def _entry(table: Mapping[str, type], kind: str, what: str) -> type:
    if kind not in table:
        raise ValueError(f"Dew has no vision {what} {kind!r}: the {what}s it builds are {sorted(table)}")
    return table[kind]


def tower_class(kind: str) -> type:
    """The config class of tower `kind`, refusing a kind `TOWERS` lacks by name."""
    return _entry(TOWERS, kind, "tower")


def projector_class(kind: str) -> type:
    """The config class of projector `kind`, refusing a kind `PROJECTORS` lacks by name."""
    return _entry(PROJECTORS, kind, "projector")


def tower_config(kind: str, record: Mapping[str, Any], where: str):
    """Tower `kind`'s config from its `vision_config` record (`where` names the record in errors)."""
    return tower_class(kind).from_hf(record, where)


def projector_config(kind: str, record: Mapping[str, Any], where: str):
    """Projector `kind`'s config from the multimodal model's whole config record."""
    return projector_class(kind).from_hf(record, where)


__all__ = [
    "PROJECTORS", "TOWERS", "Gemma4Projector", "Gemma4ProjectorConfig", "Gemma4ProjectorModule", "Gemma4Tower",
    "Gemma4VisionConfig",
    "GemmaProjector", "GemmaProjectorConfig", "Llama4Projector", "Llama4ProjectorConfig",
    "Llama4Tower", "Llama4VisionConfig", "Qwen35Merger", "Qwen35MergerConfig", "Qwen35Tower", "Qwen35VisionConfig",
    "SiglipConfig", "SiglipTower", "TowerGeometry",
    "Gemma3nEmbedder", "Gemma3nEmbedderConfig", "Gemma3nProjectorModule", "MobileNetV5Config", "MobileNetV5Tower",
    "projector_class", "projector_config", "tower_class", "tower_config",
]
