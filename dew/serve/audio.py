"""Audio in chat messages: OpenAI's `input_audio` content parts (base64 WAV), decoded within the server's
limits into the mono waveform the model's feature extractor reads.

A part is `{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}`. The WAV is PCM
(8, 16, 24 or 32-bit integers) at the feature extractor's sampling rate (16 kHz for Gemma 3n and Gemma 4):
the server does not resample, since a resampler's choice changes the features; it says how to convert
instead. Channels are averaged into one. Every refusal is a 400 naming the clip, the value and the limit.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import wave

import numpy as np

from dew.serve.protocol import APIError


@dataclasses.dataclass(frozen=True)
class AudioLimits:
    """What one request may send: `max_clips` clips, each at most `max_seconds` long and `max_bytes`
    encoded bytes."""

    max_clips: int = 4
    max_seconds: float = 30.0
    max_bytes: int = 16 * 2**20

    def __post_init__(self):
        for flag, value in (("--max-audio-clips", self.max_clips), ("--max-audio-seconds", self.max_seconds),
                            ("--max-audio-bytes", self.max_bytes)):
            if value <= 0:
                raise ValueError(f"{flag} is {value}; it must be positive")


def decode_audio(part, index: int, limits: AudioLimits, rate: int) -> np.ndarray:
    """Clip `index` of a request (its `input_audio` object) as float32 samples in [-1, 1] `[T]` at `rate` Hz."""
    if not isinstance(part, dict) or not isinstance(part.get("data"), str):
        raise APIError(400, f"audio {index}'s input_audio is {type(part).__name__}; it is an object "
                       '{"data": "<base64 WAV>", "format": "wav"}', param="messages")
    kind = part.get("format", "wav")
    if kind != "wav":
        raise APIError(400, f"audio {index} is in format {kind!r}; this server reads \"wav\" (PCM): convert it, "
                       f"e.g. `ffmpeg -i clip.{kind} -ar {rate} -ac 1 clip.wav`", param="messages")
    data = part["data"]
    if len(data) * 3 // 4 > limits.max_bytes:
        raise APIError(400, f"audio {index} holds about {len(data) * 3 // 4:,} bytes, past this server's "
                       f"--max-audio-bytes {limits.max_bytes:,}", param="messages")
    try:
        encoded = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"audio {index}'s data is not valid base64", param="messages") from None
    try:
        with wave.open(io.BytesIO(encoded)) as clip:
            channels, width, clip_rate, frames = (clip.getnchannels(), clip.getsampwidth(), clip.getframerate(),
                                                  clip.getnframes())
            if clip_rate != rate:
                raise APIError(400, f"audio {index} is sampled at {clip_rate} Hz; this model's feature extractor "
                               f"reads {rate} Hz and the server does not resample: convert it, e.g. "
                               f"`ffmpeg -i clip.wav -ar {rate} -ac 1 out.wav`", param="messages")
            if frames > limits.max_seconds * rate:
                raise APIError(400, f"audio {index} lasts {frames / rate:.1f} s, past this server's "
                               f"--max-audio-seconds {limits.max_seconds:g}: send a shorter clip", param="messages")
            raw = clip.readframes(frames)
    except APIError:
        raise
    except (wave.Error, EOFError, ValueError) as error:
        raise APIError(400, f"audio {index} is not a PCM WAV file ({error})", param="messages") from None
    return _samples(raw, width, channels, index)


def _samples(raw: bytes, width: int, channels: int, index: int) -> np.ndarray:
    """PCM bytes as float32 in [-1, 1], channels averaged: 8-bit WAV is unsigned, wider is signed
    little-endian (24-bit widened to 32 by its top three bytes)."""
    if width == 1:
        values = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        values = np.frombuffer(raw, f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    elif width == 3:
        triples = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        values = ((triples[:, 0] << 8 | triples[:, 1] << 16 | triples[:, 2] << 24) >> 8).astype(np.float32) / 2.0**23
    else:
        raise APIError(400, f"audio {index} has {8 * width}-bit samples; PCM WAV of 8, 16, 24 or 32 bits is read",
                       param="messages")
    return values.reshape(-1, channels).mean(axis=1, dtype=np.float32)
