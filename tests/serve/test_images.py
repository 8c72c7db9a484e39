"""`dew serve` on a Gemma 3 checkpoint: OpenAI's vision message format in chat completions, answered as
`text_generation` answers the same inputs, with image and text requests batched together, and the
image limits refused by name (tests/fixtures/hf/gemma3-native-tiny)."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.sampling import Sampling
from dew.serve.images import ImageLimits, decode_image
from dew.serve.protocol import APIError
from tests.serve.conftest import post_raw, running

pytest.importorskip("fastapi")
PIL = pytest.importorskip("PIL.Image")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "gemma3-native-tiny"
# The fixture is a base model with no chat template; this one writes each message's text, and
# `<start_of_image>` where an image stands, separated by spaces.
TEMPLATE = ("{%- for message in messages -%}{%- if message['content'] is string -%}{{ message['content'] }}"
            "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}"
            "{{ ' <start_of_image> ' }}{%- else -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
            "{{ ' ' }}{%- endfor -%}")
NEW_TOKENS = 4


def _png(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    PIL.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(url: str, content, **extra) -> tuple[int, dict]:
    body = {"model": "gemma3", "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS,
            "temperature": 0, **extra}
    return post_raw(f"{url}/v1/chat/completions", json.dumps(body).encode())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3-serve")
    (directory / "template.jinja").write_text(TEMPLATE)
    with running(FIXTURE, "--name", "gemma3", "--slots", "4", "--capacity", "64", "--chat-template",
                 str(directory / "template.jinja"), "--max-images", "2", "--max-image-pixels", str(64 * 64),
                 log=directory / "serve.log") as process:
        yield process


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", max_seq_len=64)


def _expected(bundle, text: str, images) -> str:
    """What text_generation continues the same rendered prompt and images with, special tokens left out."""
    inputs = bundle.processor([text], images=None if images is None else [images])
    result = bundle.text_generation(sampling=Sampling(temperature=0))(inputs, NEW_TOKENS, seed=0)
    new = result.continuations()[0]
    return bundle.processor.tokenizer.decode([t for t in new if t not in (1,)], skip_special_tokens=True)


def test_chat_with_an_image_answers_as_text_generation(served, bundle):
    pixels = np.load(FIXTURE / "raw_images.npy")
    content = [{"type": "text", "text": "token5"}, {"type": "image_url", "image_url": {"url": _png(pixels[0])}},
               {"type": "text", "text": "token8"}]
    text_content = "token5 token8 token9"
    with ThreadPoolExecutor(4) as pool:  # image and text requests side by side in the engine's batches
        image_answers = [pool.submit(_chat, served.url, content) for _ in range(2)]
        text_answers = [pool.submit(_chat, served.url, text_content) for _ in range(2)]
        results = [future.result() for future in image_answers + text_answers]
    assert all(status == 200 for status, _ in results), results
    expected_image = _expected(bundle, "token5 <start_of_image> token8 ", [pixels[0]])
    expected_text = _expected(bundle, text_content + " ", None)
    # the word-level fixture's words; the server's stream may put its space before the first
    answers = [body["choices"][0]["message"]["content"].split() for _, body in results]
    expected_image, expected_text = expected_image.split(), expected_text.split()
    assert answers[:2] == [expected_image] * 2
    assert answers[2:] == [expected_text] * 2
    assert expected_image != expected_text  # the image changed the answer


def test_image_limits_are_refused_by_name(served):
    small = _png(np.zeros((8, 8, 3), np.uint8))
    part = {"type": "image_url", "image_url": {"url": small}}
    status, body = _chat(served.url, [part, part, part])
    assert status == 400 and "--max-images 2" in body["error"]["message"]
    status, body = _chat(served.url, [{"type": "image_url", "image_url": {"url": _png(np.zeros((80, 80, 3), np.uint8))}}])
    assert status == 400 and "--max-image-pixels 4,096" in body["error"]["message"]
    status, body = _chat(served.url, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert status == 400 and "--fetch-images" in body["error"]["message"]
    status, body = _chat(served.url, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert status == 400 and "not an image Pillow reads" in body["error"]["message"]
    # the server is still answering
    assert _chat(served.url, "token5 token8")[0] == 200


def test_audio_is_refused_by_name_where_the_model_does_not_hear(served):
    clip = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    status, body = _chat(served.url, [{"type": "text", "text": "token5"}, clip])
    assert status == 400 and "types ['input_audio']; this model reads text and image_url" in body["error"]["message"]


def _png_header(width: int, height: int) -> str:
    """A data URL of a PNG whose header claims `width` x `height` (its pixel data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.parametrize("width, height", [(5000, 5000), (20000, 20000)])
def test_an_image_past_the_pixel_limit_names_the_flag_however_large(width, height):
    """A PNG claiming 20000x20000 is past Pillow's own bound, which Pillow refuses as it opens it: that once read
    "not an image Pillow reads (...decompression bomb...): send a PNG, JPEG, GIF or WebP" (it was a PNG)."""
    with pytest.raises(APIError) as caught:
        decode_image(_png_header(width, height), 1, ImageLimits())
    assert caught.value.message == (f"image 1 is {width}x{height}, {width * height:,} pixels, past this server's "
                                    "--max-image-pixels 16,777,216: send a smaller image")
    with pytest.raises(APIError) as caught:  # a limit above Pillow's: Pillow's bound is said to be its own
        decode_image(_png_header(width, height), 1, ImageLimits(max_pixels=width * height))
    if width * height > 2 * PIL.MAX_IMAGE_PIXELS:
        assert caught.value.message.startswith(f"image 1 is {width}x{height}, {width * height:,} pixels, past the "
                                               "most pixels Pillow opens")
    else:
        assert "not an image Pillow reads" in caught.value.message  # the claim passes; its few bytes do not
