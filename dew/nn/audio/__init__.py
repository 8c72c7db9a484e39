"""Audio towers by name, each a frozen config read from a transformers `audio_config` record.

A tower config (`TOWERS`: `gemma3n_audio`, `gemma4_audio`) reads its record (`from_hf`, through
`audio_config`), writes it back (`to_hf`), says how many log-mel bins a frame has (`mel_features`, None
where the tower reads any count its weights fit) and builds a module taking `input_features [B, T, F]`
and a boolean `input_features_mask [B, T]` (true at frames holding audio) to `AudioEncoding(features
[B, T', width], mask [B, T'])`, the mask subsampled to the tower's frame rate and the features zero where
it is false. The frames come from `dew.data.audio.AudioProcessor`; the checkpoint tensor rules live in
`dew.interop.audio`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.nn.audio.base import AudioEncoding
from dew.nn.audio.gemma3n import Gemma3nAudio, Gemma3nAudioEncoder
from dew.nn.audio.gemma4 import CONSTANTS, Gemma4Audio, Gemma4AudioEncoder

TOWERS: dict[str, type] = {"gemma3n_audio": Gemma3nAudio, "gemma4_audio": Gemma4Audio}


def audio_class(kind: str) -> type:
    """The config class of audio tower `kind`, refusing a kind `TOWERS` lacks by name."""
    if kind not in TOWERS:
        raise ValueError(f"Dew has no audio tower {kind!r}: the audio towers it builds are {sorted(TOWERS)}")
    return TOWERS[kind]


def audio_config(kind: str, record: Mapping[str, Any], where: str = "audio_config"):
    """Tower `kind`'s config from the checkpoint's `audio_config` record (`where` names the record in errors);
    a field that would change the computation and that Dew does not compute is refused by name."""
    return audio_class(kind).from_hf(record, where)


__all__ = ["CONSTANTS", "TOWERS", "AudioEncoding", "Gemma3nAudio", "Gemma3nAudioEncoder", "Gemma4Audio",
           "Gemma4AudioEncoder", "audio_class", "audio_config"]
