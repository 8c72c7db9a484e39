"""Request bodies read field by field: defaults from the checkpoint, refusals in OpenAI's error shape."""

from __future__ import annotations

import pytest

from dew.sampling import Sampling
from dew.serve.protocol import APIError, chat_messages, completion_prompts, parse_json, read_job

DEFAULTS = Sampling(temperature=0.7, top_k=40, eos_token_ids=(2,), pad_id=2)


def test_fields_left_out_take_the_checkpoints_defaults():
    job = read_job("completion", {"prompt": "a"}, [[1]], DEFAULTS)
    assert job.sampling == DEFAULTS and job.max_tokens == 16 and job.n == 1 and not job.stream
    job = read_job("completion", {"temperature": 0, "top_p": 0.9, "top_k": -1, "seed": 5, "stop": "x", "n": 2},
                   [[1]], DEFAULTS)
    assert job.sampling == Sampling(temperature=0.0, top_k=None, top_p=0.9, eos_token_ids=(2,), pad_id=2)
    assert (job.seed, job.stop, job.n) == (5, ("x",), 2)
    chat = read_job("chat", {"max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}},
                    [[1]], DEFAULTS)
    assert (chat.max_tokens, chat.stream, chat.include_usage) == (9, True, True)
    assert read_job("chat", {}, [[1]], DEFAULTS).max_tokens is None  # the server fills the context


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": -1}, "temperature", "temperature is -1"),
    ({"top_p": 0}, "top_p", "lies in (0, 1]"),
    ({"n": 0}, "n", "n is 0; it is at least 1"),
    ({"max_tokens": 2.5}, "max_tokens", "is an integer"),
    ({"stop": 3}, "stop", "a string or a list of strings"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only read with stream: true"),
    ({"logprobs": 0}, "logprobs", "logprobs=0 is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"best_of": 3}, "best_of", "best_of=3 is not supported"),
    ({"temprature": 1}, "temprature", "unrecognised request field(s) ['temprature']"),
    ({"seed": "7"}, "seed", "seed is '7'; it is an integer"),
])
def test_bad_fields_are_refused_by_name(body, param, words):
    with pytest.raises(APIError) as caught:
        read_job("completion", body, [[1]], DEFAULTS)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_prompts_and_messages():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    assert completion_prompts("ab", encode, 256) == [[97, 98]]
    assert completion_prompts(["a", [5, 6]], encode, 256) == [[97], [5, 6]]
    assert completion_prompts([1, 2], encode, 256) == [[1, 2]]
    with pytest.raises(APIError, match="token id 300, outside the vocabulary of 256"):
        completion_prompts([[300]], encode, 256)
    with pytest.raises(APIError, match="prompt 0 is empty"):
        completion_prompts([""], encode, 256)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_messages(parts) == [{"role": "user", "content": "ab"}]
    with pytest.raises(APIError, match="reads text only"):
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json(b"{")
    with pytest.raises(APIError, match="a JSON list; send a JSON object"):
        parse_json(b"[]")
