"""`dew serve` on a Gemma 4 checkpoint with its audio tower: OpenAI's `input_audio` content parts (base64 WAV)
in chat completions, answered as `text_generation` answers the same inputs, alone and beside an image and a
text request in the engine's batches; the audio limits refused by name (tests/fixtures/hf/gemma4-native-tiny)."""

from __future__ import annotations

import base64
import io
import json
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.sampling import Sampling
from tests.serve.conftest import post_raw, running

pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "gemma4-native-tiny"
# The fixture has no chat template; this one writes each message's text, and the placeholder where an image or
# a clip stands, separated by spaces.
TEMPLATE = ("{%- for message in messages -%}{%- if message['content'] is string -%}{{ message['content'] }}"
            "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}{{ ' <|image|> ' }}"
            "{%- elif part['type'] == 'audio' -%}{{ ' <|audio|> ' }}{%- else -%}{{ part['text'] }}{%- endif -%}"
            "{%- endfor -%}{%- endif -%}{{ ' ' }}{%- endfor -%}")
NEW_TOKENS = 4
RATE = 16_000
def _wav(samples: np.ndarray, rate: int = RATE) -> dict:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(rate)
        clip.writeframes(np.asarray(samples, "<i2").tobytes())
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(),
                                                   "format": "wav"}}


def _png(pixels: np.ndarray) -> dict:
    buffer = io.BytesIO()
    PIL.fromarray(pixels).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(url: str, content) -> tuple[int, dict]:
    body = {"model": "gemma4", "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0}
    return post_raw(f"{url}/v1/chat/completions", json.dumps(body).encode())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4-serve")
    (directory / "template.jinja").write_text(TEMPLATE)
    with running(FIXTURE, "--name", "gemma4", "--slots", "4", "--capacity", "96", "--chat-template",
                 str(directory / "template.jinja"), "--max-audio-clips", "2", "--max-audio-seconds", "1",
                 log=directory / "serve.log") as process:
        yield process


@pytest.fixture(scope="module")
def clips():
    rng = np.random.default_rng(906)
    # 16-bit PCM samples: the server reads them as value / 32768, which the reference is fed the same way
    return [rng.integers(-3000, 3000, 12000), rng.integers(-3000, 3000, 7000)]


def _expected(rows: list[tuple[str, list, list]]) -> list[list[str]]:
    """The words text_generation continues each (rendered prompt, images, 16-bit clips) with, all in one batch."""
    bundle = load_pretrained(FIXTURE, dtype="float32", max_seq_len=96)
    processor = bundle.processor
    waveforms = [np.asarray(clip, np.float32) / 32768.0 for _, _, clips in rows for clip in clips]
    inputs = processor([text for text, _, _ in rows], images=[images for _, images, _ in rows], audio=waveforms)
    generation = bundle.text_generation(sampling=Sampling(temperature=0))(inputs, NEW_TOKENS, seed=0)
    return [processor.tokenizer.decode(new, skip_special_tokens=True).split() for new in generation.continuations()]


def test_chat_with_audio_answers_as_text_generation(served, clips):
    picture = np.random.default_rng(907).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    heard = [{"type": "text", "text": "token50"}, _wav(clips[0]), {"type": "text", "text": "token51"}]
    mixed = [{"type": "text", "text": "token60"}, _png(picture), {"type": "text", "text": "token61"}, _wav(clips[1]),
             {"type": "text", "text": "token62"}]
    with ThreadPoolExecutor(3) as pool:  # an audio row, a row with an image and a clip and a text row together
        futures = [pool.submit(_chat, served.url, content) for content in (heard, mixed, "token20 token21")]
        results = [future.result() for future in futures]
    assert all(status == 200 for status, _ in results), results
    answers = [body["choices"][0]["message"]["content"].split() for _, body in results]
    expected = _expected([("token50 <|audio|> token51 ", [], clips[:1]),
                          ("token60 <|image|> token61 <|audio|> token62 ", [picture], clips[1:]),
                          ("token20 token21 ", [], []), ("token50 token51 ", [], [])])
    assert answers == expected[:3]
    assert expected[3] != expected[0]  # the clip changed the answer


def test_audio_limits_are_refused_by_name(served, clips):
    status, body = _chat(served.url, [_wav(clips[0])] * 3)
    assert status == 400 and "--max-audio-clips 2" in body["error"]["message"]
    status, body = _chat(served.url, [_wav(np.zeros(RATE * 2))])
    assert status == 400 and "--max-audio-seconds 1" in body["error"]["message"]
    status, body = _chat(served.url, [_wav(np.zeros(800), rate=8000)])
    assert status == 400 and "sampled at 8000 Hz" in body["error"]["message"]
    assert _chat(served.url, "token20 token21")[0] == 200  # the server is still answering
