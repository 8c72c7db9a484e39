"""Request bodies read field by field: defaults from the checkpoint, refusals in OpenAI's error shape,
bodies that are not JSON, nest too deeply or hold a lone surrogate refused."""

from __future__ import annotations

import pytest

from dew.sampling import Sampling
from dew.serve.protocol import MAX_DEPTH, MAX_STOPS, APIError, chat_messages, completion_prompts, parse_json, read_job

DEFAULTS = Sampling(temperature=0.7, top_k=40, eos_token_ids=(2,), pad_id=2)


def test_fields_left_out_take_the_checkpoints_defaults():
    job = read_job("completion", {"prompt": "a"}, DEFAULTS)
    assert job.sampling == DEFAULTS and job.max_tokens == 16 and job.n == 1 and not job.stream
    job = read_job("completion", {"temperature": 0, "top_p": 0.9, "top_k": -1, "seed": 5, "stop": "x", "n": 2},
                   DEFAULTS)
    assert job.sampling == Sampling(temperature=0.0, top_k=None, top_p=0.9, eos_token_ids=(2,), pad_id=2)
    assert (job.seed, job.stop, job.n) == (5, ("x",), 2)
    chat = read_job("chat", {"max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}},
                    DEFAULTS)
    assert (chat.max_tokens, chat.stream, chat.include_usage) == (9, True, True)
    assert read_job("chat", {}, DEFAULTS).max_tokens is None  # the server fills the context


@pytest.mark.parametrize("body, param, words", [
    ({"temperature": -1}, "temperature", "temperature is -1"),
    ({"top_p": 0}, "top_p", "lies in (0, 1]"),
    ({"n": 0}, "n", "n is 0; it is at least 1"),
    ({"max_tokens": 2.5}, "max_tokens", "is an integer"),
    ({"stop": 3}, "stop", "a string or a list of strings"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only read with stream: true"),
    ({"logprobs": 21}, "logprobs", "logprobs is 21; this server gives at most the 20 most likely tokens at each "
                                   "position (dew serve --max-logprobs): ask for at most 20"),
    ({"logprobs": -1}, "logprobs", "logprobs is -1; it is at least 0"),
    ({"echo": 1}, "echo", "echo is 1; it is true or false"),
    ({"echo": True, "stream": True}, "echo", "echo with stream: true is not supported"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens is 0; it is at least 1"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"best_of": 3}, "best_of", "best_of=3 is not supported"),
    ({"temprature": 1}, "temprature", "unrecognised request field(s) ['temprature']"),
    ({"seed": "7"}, "seed", "seed is '7'; a seed is an integer from -2**63 to 2**63 - 1"),
    ({"seed": 2**63}, "seed", f"seed is {2**63}; a seed is an integer from -2**63 to 2**63 - 1"),
    ({"seed": -(2**63) - 1}, "seed", "the 64-bit range of a JAX key"),
    ({"stop": ["x"] * (MAX_STOPS + 1)}, "stop", f"stop holds {MAX_STOPS + 1} strings; this server takes at most"),
    ({"stop": ""}, "stop", "stop is an empty string, which every text begins with: give stop strings of at least "
                           "one character, or leave stop out"),  # these two were once taken and ignored
    ({"stop": ["", "x"]}, "stop", "stop[0] is an empty string"),
])
def test_bad_fields_are_refused_by_name(body, param, words):
    with pytest.raises(APIError) as caught:
        read_job("completion", body, DEFAULTS)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param, words", [
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs is 3 without logprobs: true"),
    ({"logprobs": 2}, "logprobs", "logprobs is 2; in a chat it is true or false"),
    ({"logprobs": True, "top_logprobs": 25}, "top_logprobs", "top_logprobs is 25; this server gives at most the 20"),
    ({"echo": True}, "echo", "unrecognised request field(s) ['echo']"),
])
def test_bad_chat_log_probability_fields_are_refused_by_name(body, param, words):
    with pytest.raises(APIError) as caught:
        read_job("chat", body, DEFAULTS)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


def test_log_probability_fields():
    job = read_job("completion", {"logprobs": 1, "echo": True, "max_tokens": 0}, DEFAULTS)
    assert (job.log_probs, job.echo, job.max_tokens) == (1, True, 0)
    assert read_job("completion", {"logprobs": 0}, DEFAULTS).log_probs == 0
    assert read_job("completion", {}, DEFAULTS).log_probs is None
    assert read_job("chat", {"logprobs": True}, DEFAULTS).log_probs == 0
    assert read_job("chat", {"logprobs": True, "top_logprobs": 5}, DEFAULTS).log_probs == 5
    assert read_job("chat", {"logprobs": False, "top_logprobs": 0}, DEFAULTS).log_probs is None
    assert read_job("completion", {"logprobs": 3}, DEFAULTS, max_log_probs=3).log_probs == 3


def test_seeds_at_the_ends_of_the_64_bit_range_are_taken():
    assert read_job("completion", {"seed": 2**63 - 1}, DEFAULTS).seed == 2**63 - 1
    assert read_job("completion", {"seed": -(2**63)}, DEFAULTS).seed == -(2**63)


def test_prompts_and_messages():
    assert completion_prompts("ab", 256) == ["ab"]
    assert completion_prompts(["a", [5, 6]], 256) == ["a", [5, 6]]
    assert completion_prompts([1, 2], 256) == [[1, 2]]
    with pytest.raises(APIError, match="token id 300, outside the vocabulary of 256"):
        completion_prompts([[300]], 256)
    with pytest.raises(APIError, match="prompt 0 is empty"):
        completion_prompts([[]], 256)
    with pytest.raises(APIError, match=r"prompt 1 is \[1, 'a'\]; each prompt is a string or a list of token ids"):
        completion_prompts(["a", [1, "a"]], 256)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert chat_messages(parts) == ([{"role": "user", "content": "ab"}], [], [])
    with pytest.raises(APIError, match="reads text only"):
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError, match="reads text only"):  # a type that is no string is named, not a TypeError
        chat_messages([{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}])
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json(b"{")
    with pytest.raises(APIError, match="a JSON list; send a JSON object"):
        parse_json(b"[]")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_json_nested_too_deeply_is_refused_by_name(depth):
    raw = b'{"prompt": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    with pytest.raises(APIError) as caught:
        parse_json(raw)
    assert caught.value.status == 400 and f"nests deeper than the {MAX_DEPTH} levels" in caught.value.message
    assert parse_json(b'{"prompt": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}")  # the limit itself


@pytest.mark.parametrize("raw, where, param", [
    (b'{"prompt": "ab\\ud800c"}', "prompt holds a lone surrogate U+D800 at character 2", "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content holds a lone surrogate U+DFFF",
     "messages"),
    (b'{"stop": ["x", "\\ud83d"]}', "stop[1] holds a lone surrogate U+D83D", "stop"),
    (b'{"\\ud800": 1}', "\\ud800 holds a lone surrogate", "\\ud800"),
])
def test_a_lone_surrogate_anywhere_is_refused_by_name(raw, where, param):
    with pytest.raises(APIError) as caught:
        parse_json(raw)
    assert caught.value.status == 400 and where in caught.value.message and caught.value.param == param
    caught.value.message.encode("utf-8")  # the answer itself is valid UTF-8
    assert parse_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}  # a pair is a character


def test_chat_messages_take_audio_parts_only_where_the_model_reads_them():
    clip = {"data": "UklGRg==", "format": "wav"}
    content = [{"type": "text", "text": "hear"}, {"type": "input_audio", "input_audio": clip},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    messages = [{"role": "user", "content": content}]
    out, images, clips = chat_messages(messages, images=True, audio=True)
    assert out == [{"role": "user", "content": [{"type": "text", "text": "hear"}, {"type": "audio"}, {"type": "image"}]}]
    assert images == ["data:image/png;base64,AA=="] and clips == [clip]
    with pytest.raises(APIError, match=r"types \['input_audio'\]; this model reads text and image_url"):
        chat_messages(messages, images=True)
    with pytest.raises(APIError, match="types \\['input_audio'\\]; this model reads text only"):
        chat_messages([{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}])


@pytest.mark.parametrize("kind, value, shape", [
    ("image_url", "data:image/png;base64,AAAA", '"image_url": {"url": "data:image/png;base64,..."}'),
    ("input_audio", "UklGRg==", '"input_audio": {"data": "<base64 WAV>", "format": "wav"}'),
    ("image_url", None, '"image_url": {"url": '),
])
def test_a_media_part_that_is_not_an_object_says_what_it_is(kind, value, shape):
    """An image_url given as the URL itself once read "holds content parts of types [...]; this model reads
    text and image_url", which a part of type image_url seems to be."""
    content = [{"type": "text", "text": "look"}, {"type": kind, kind: value}]
    with pytest.raises(APIError) as caught:
        chat_messages([{"role": "user", "content": content}], images=True, audio=True)
    assert caught.value.message.startswith(f"message 0, part 1: {kind} is {value!r}; it is an object, as in")
    assert shape in caught.value.message and caught.value.param == "messages"
