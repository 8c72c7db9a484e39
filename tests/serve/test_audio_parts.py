"""OpenAI's `input_audio` content parts decoded for the feature extractor: PCM WAV of every width read
exactly, channels averaged, and each limit and wrong format refused by name (`dew.serve.audio`)."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest

from dew.serve.audio import AudioLimits, decode_audio
from dew.serve.protocol import APIError

RATE = 16_000


def _wav(samples: np.ndarray, width: int = 2, channels: int = 1, rate: int = RATE) -> dict:
    """A base64 WAV `input_audio` object holding `samples` ([T] or [T, channels] integers of `width` bytes)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as clip:
        clip.setnchannels(channels)
        clip.setsampwidth(width)
        clip.setframerate(rate)
        if width == 3:
            values = np.asarray(samples, np.int32).reshape(-1)
            raw = np.stack([values & 255, values >> 8 & 255, values >> 16 & 255], -1).astype(np.uint8).tobytes()
        else:
            raw = np.asarray(samples, {1: np.uint8, 2: "<i2", 4: "<i4"}[width]).tobytes()
        clip.writeframes(raw)
    return {"data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"}


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_of_each_width_reads_as_its_exact_fraction(width):
    top = 2 ** (8 * width - 1)
    values = np.array([-top, -top // 2, -1, 0, 1, top // 3, top - 1])
    stored = values + 128 if width == 1 else values
    got = decode_audio(_wav(stored, width), 0, AudioLimits(), RATE)
    # Every integer of up to 24 bits is a float32 exactly and so is its quotient by a power of two; 32-bit
    # samples round once, to float32's 24-bit significand, as the reference's own widening does.
    np.testing.assert_allclose(got, (values / top).astype(np.float32), rtol=2**-24 if width == 4 else 0, atol=0)
    assert got.dtype == np.float32


def test_channels_are_averaged():
    stereo = np.array([[1000, -1000], [300, 100], [-32768, -32768]])
    got = decode_audio(_wav(stereo, channels=2), 0, AudioLimits(), RATE)
    np.testing.assert_array_equal(got, np.array([0.0, 200.0, -32768.0], np.float32) / 32768.0)


@pytest.mark.parametrize("part, limits, says", [
    (_wav(np.zeros(8), rate=44_100), AudioLimits(), "sampled at 44100 Hz; this model's feature extractor reads 16000 Hz"),
    (_wav(np.zeros(RATE * 2)), AudioLimits(max_seconds=1.5), "lasts 2.0 s, past this server's --max-audio-seconds 1.5"),
    (_wav(np.zeros(RATE)), AudioLimits(max_bytes=1000), "past this server's --max-audio-bytes 1,000"),
    ({"data": "UklGRg==", "format": "mp3"}, AudioLimits(), "format 'mp3'; this server reads \"wav\""),
    ({"data": "not base64!", "format": "wav"}, AudioLimits(), "not valid base64"),
    ({"data": base64.b64encode(b"RIFF....WAVEjunk").decode()}, AudioLimits(), "not a PCM WAV file"),
    ("a string", AudioLimits(), "input_audio is str"),
])
def test_bad_clips_are_refused_by_name(part, limits, says):
    with pytest.raises(APIError) as caught:
        decode_audio(part, 2, limits, RATE)
    assert caught.value.status == 400 and says in str(caught.value) and "audio 2" in str(caught.value)


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="--max-audio-seconds is 0"):
        AudioLimits(max_seconds=0)
