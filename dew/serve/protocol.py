"""OpenAI's wire format for `dew serve`: request bodies read into a `Job`, and the response, chunk
and error objects.

A body is checked field by field on the host, and a bad field answers 400 in OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`) naming the value, the limit and the fix; so does
a body that is not JSON, nests deeper than `MAX_DEPTH`, or holds a lone surrogate (`"\\ud800"`, which
is no character and which no tokenizer takes). A field
Dew does not apply (tools, penalties other than its repetition penalty) is refused by name rather than
ignored. Log-probabilities (a completion's `logprobs` and `echo`, a chat's `logprobs` and
`top_logprobs`) are the model's float32 log-softmax of the logits, whatever the temperature and
filters, as vLLM reports them by default; `-inf` is written as -9999.0, as vLLM does (JSON has no
infinity). Besides OpenAI's fields, `top_k`, `min_p` and `repetition_penalty` are read
(vLLM's extensions), and fields a request leaves out take the served checkpoint's own defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dew.sampling import Sampling
from dew.sampling.sampling import check_seed

# Read but with nothing to apply: an end-user id for abuse monitoring.
_INFORMATIONAL = {"user"}
# Fields OpenAI defines that Dew does not apply, with the values that ask for nothing.
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "suffix": ("",),
            "tools": ([],),
            "tool_choice": ("none",), "response_format": ({"type": "text"},),
            "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (True, False)}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options",
           "top_k", "min_p", "repetition_penalty"}
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "logprobs", "echo"} | _INFORMATIONAL | set(_NEUTRAL)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"} | _INFORMATIONAL | \
    set(_NEUTRAL)
DEFAULT_COMPLETION_TOKENS = 16
"""`max_tokens` of a completion that names none (OpenAI's default); a chat fills the context."""
MAX_DEPTH = 64
"""How deeply a request body's JSON may nest (an OpenAI request is a few levels deep)."""
MAX_STOPS = 16
"""Stop strings a request may give (OpenAI takes 4): each is looked for at every token, on the engine's thread."""
LOWEST_LOG_PROB = -9999.0
"""Log-probabilities are written at least this (vLLM's floor), so `-inf` becomes a JSON number."""
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An answer in OpenAI's error shape with HTTP `status` (and `headers`, such as Connection: close)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    """One request as the engine takes it: `prompts` (token ids; a chat has one, and they are filled in
    after the other fields are read, with its images in `media`), `n` continuations of each, their
    budget, sampling policy, seed and stop strings, and how to answer: `log_probs`, the alternatives
    reported at each drawn position (None: no log-probabilities), and `echo`, whether a completion's
    answer begins with its prompt (with its log-probabilities, when `log_probs` is set)."""

    kind: str  # "completion" or "chat"
    max_tokens: int | None
    sampling: Sampling
    seed: int
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    log_probs: int | None = None
    echo: bool = False
    prompts: list[list[int]] = dataclasses.field(default_factory=list)
    texts: list[str | None] = dataclasses.field(default_factory=list)  # a completion's prompts as sent in text
    media: dict | None = None  # a chat's images for a multimodal model (`dew.serve.engine.Request.media`)
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON ({error}): send a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object")
    _check_tree(body)
    return body


def _too_deep() -> APIError:
    return APIError(400, f"the request body's JSON nests deeper than the {MAX_DEPTH} levels this server reads: "
                    "send an OpenAI request object (a few levels deep)")


def _check_tree(body: dict) -> None:
    """Refuse JSON nested past `MAX_DEPTH`, and any string (or key) holding a lone surrogate. Walked
    with a stack, not recursion, so no nesting can exhaust Python's."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{_printable(key)}" if path else \
                _printable(key)
            for text in (key, item):
                if isinstance(text, str) and not text.isascii() and (found := _SURROGATE.search(text)):
                    raise APIError(400, f"{where} holds a lone surrogate U+{ord(found.group()):04X} at character "
                                   f"{found.start()}, which is no Unicode character: send text as UTF-8, with "
                                   "surrogates only in pairs (\\ud83d\\ude00)", param=where.split(".")[0].split("[")[0])
            if isinstance(item, (dict, list)):
                stack.append((item, where, depth + 1))


def _printable(text: str) -> str:
    """`text` with any lone surrogate written as an escape, so the message itself encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_model(body: Mapping[str, Any], served: str) -> None:
    model = body.get("model", served)
    if model != served:
        raise APIError(404, f"the model {_brief(model)} does not exist: this server serves {served!r} "
                       "(GET /v1/models)", param="model", code="model_not_found")


def read_job(kind: str, body: Mapping[str, Any], defaults: Sampling, max_log_probs: int = 20) -> Job:
    """Everything but the prompts (which the caller encodes), checked, with `defaults` for what is left
    out; at most `max_log_probs` alternatives per position (`dew serve --max-logprobs`)."""
    allowed = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    unknown = sorted(set(body) - allowed - {"prompt", "messages"})
    if unknown:
        raise APIError(400, f"unrecognised request field(s) {unknown}: this endpoint reads {sorted(allowed)}",
                       param=unknown[0])
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        # same type as well as equal: a completion's logprobs=0 asks for something, unlike logprobs=false
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise APIError(400, f"{name}={_brief(body[name])} is not supported by dew serve; leave it out", param=name)
    n = _integer(body, "n", 1, low=1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, f"best_of={_brief(best_of)} is not supported (it would rank by log-probability); leave "
                       "it out or equal to n", param="best_of")
    log_probs, echo = _log_probs(kind, body, max_log_probs)
    # a completion that echoes its prompt may ask for no new token: it scores the prompt
    max_tokens = _integer(body, "max_tokens", None, low=0 if echo else 1)
    if kind == "chat":
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, low=1)
    elif max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_TOKENS
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, f"stream is {_brief(stream)}; it is true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError(400, "stream_options is only read with stream: true", param="stream_options")
    options = options or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(400, f"stream_options is {_brief(options)}; it holds only include_usage", param="stream_options")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)
    try:
        check_seed(seed)
    except ValueError as error:
        raise APIError(400, str(error), param="seed") from None
    try:
        sampling = _sampling(body, defaults)
    except ValueError as error:  # a value Sampling refuses that the checks above let through
        raise APIError(400, str(error)) from None
    if echo and stream:
        raise APIError(400, "echo with stream: true is not supported by dew serve: ask for the whole answer "
                       "(stream: false), or leave echo out", param="echo")
    return Job(kind, max_tokens, sampling, seed, n, _stop(body.get("stop")), stream,
               bool(options.get("include_usage")), log_probs, echo)


def _log_probs(kind: str, body: Mapping[str, Any], most: int) -> tuple[int | None, bool]:
    """(alternatives per position, or None for no log-probabilities; echo) of a completion's `logprobs`
    and `echo`, or a chat's `logprobs` and `top_logprobs`."""
    if kind == "completion":
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise APIError(400, f"echo is {_brief(echo)}; it is true or false", param="echo")
        alternatives = _integer(body, "logprobs", None, low=0)
        name = "logprobs"
    else:
        echo, wanted = False, body.get("logprobs") or False
        if not isinstance(wanted, bool):
            raise APIError(400, f"logprobs is {_brief(wanted)}; in a chat it is true or false (top_logprobs counts "
                           "the alternatives)", param="logprobs")
        alternatives = _integer(body, "top_logprobs", None, low=0)
        if alternatives and not wanted:
            raise APIError(400, f"top_logprobs is {alternatives} without logprobs: true; send logprobs: true with it",
                           param="top_logprobs")
        alternatives = (alternatives or 0) if wanted else None
        name = "top_logprobs"
    if alternatives is not None and alternatives > most:
        raise APIError(400, f"{name} is {alternatives}; this server gives at most the {most} most likely tokens at "
                       f"each position (dew serve --max-logprobs): ask for at most {most}", param=name)
    return alternatives, echo


def _sampling(body: Mapping[str, Any], defaults: Sampling) -> Sampling:
    overrides = {}
    temperature = _number(body, "temperature")
    if temperature is not None:
        if temperature < 0:
            raise APIError(400, f"temperature is {temperature}; use 0 for the most likely tokens or a positive value",
                           param="temperature")
        overrides["temperature"] = float(temperature)
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p is {top_p}; it lies in (0, 1]", param="top_p")
        overrides["top_p"] = None if top_p == 1 else float(top_p)
    top_k = _integer(body, "top_k", None, low=-1)
    if top_k is not None:
        overrides["top_k"] = top_k if top_k > 0 else None  # vLLM's -1 (and 0) keep every token
    min_p = _number(body, "min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise APIError(400, f"min_p is {min_p}; it lies in [0, 1]", param="min_p")
        overrides["min_p"] = float(min_p) or None
    penalty = _number(body, "repetition_penalty")
    if penalty is not None:
        if penalty <= 0:
            raise APIError(400, f"repetition_penalty is {penalty}; it is above 0 (1 changes nothing)",
                           param="repetition_penalty")
        overrides["repetition_penalty"] = None if penalty == 1 else float(penalty)
    return dataclasses.replace(defaults, **overrides)


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"{name} is {_brief(value)}; it is a finite number", param=name)
    return value


def _integer(body: Mapping[str, Any], name: str, default, *, low: int):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} is {_brief(value)}; it is an integer", param=name)
    if value < low:
        raise APIError(400, f"{name} is {value}; it is at least {low}", param=name)
    return value


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"stop is {_brief(stop)}; it is a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop holds {len(stops)} strings; this server takes at most {MAX_STOPS}", param="stop")
    empty = next((i for i, s in enumerate(stops) if not s), None)
    if empty is not None:
        where = "stop" if isinstance(stop, str) else f"stop[{empty}]"
        raise APIError(400, f"{where} is an empty string, which every text begins with: give stop strings of at "
                       "least one character, or leave stop out", param="stop")
    return tuple(stops)


def completion_prompts(prompt, vocab_size: int) -> list[str | list[int]]:
    """A completion's `prompt` (a string, a list of strings, a list of token ids, or a list of such
    lists) as a list of prompts, each a string (for the caller to encode) or checked token ids."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise APIError(400, f"prompt is {_brief(prompt)}; it is a string, a list of strings, a list of token ids, or a "
                       "list of such lists", param="prompt")
    for index, item in enumerate(prompts):
        if isinstance(item, str):
            continue
        if not isinstance(item, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise APIError(400, f"prompt {index} is {_brief(item)}; each prompt is a string or a list of token ids",
                           param="prompt")
        check_ids(index, item, vocab_size)
    return prompts


def tokenize_request(body: Mapping[str, Any], served: str) -> tuple[str, bool]:
    """(text, whether to add the tokenizer's special tokens) of a /tokenize body, vLLM's
    `{"prompt": str, "add_special_tokens": true}`."""
    _only(body, {"model", "prompt", "add_special_tokens"}, "/tokenize")
    check_model(body, served)
    text, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(text, str):
        raise APIError(400, f"prompt is {_brief(text)}; /tokenize takes a string (chat messages: render them first)",
                       param="prompt")
    if not isinstance(special, bool):
        raise APIError(400, f"add_special_tokens is {_brief(special)}; it is true or false", param="add_special_tokens")
    return text, special


def detokenize_request(body: Mapping[str, Any], served: str, vocab_size: int) -> list[int]:
    """The token ids of a /detokenize body, `{"tokens": [int, ...]}`, checked against the vocabulary."""
    _only(body, {"model", "tokens"}, "/detokenize")
    check_model(body, served)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, f"tokens is {_brief(ids)}; /detokenize takes a list of token ids", param="tokens")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens holds token id {bad}, outside the vocabulary of {vocab_size}", param="tokens")
    return ids


def _only(body: Mapping[str, Any], allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unrecognised request field(s) {unknown}: {endpoint} reads {sorted(allowed)}",
                       param=unknown[0])


def check_ids(index: int, row: Sequence[int], vocab_size: int) -> None:
    """Refuse prompt `index` when it is empty or holds an id outside the vocabulary."""
    bad = next((t for t in row if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt {index} holds token id {bad}, outside the vocabulary of {vocab_size}",
                       param="prompt")
    if not row:
        raise APIError(400, f"prompt {index} is empty; give at least one token", param="prompt")


def _brief(value, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters: an error message never echoes a whole prompt."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def chat_messages(messages, images: bool = False, audio: bool = False) -> tuple[list[dict], list, list]:
    """Chat `messages` for the template, each a role and its text (text parts joined), the image parts'
    `image_url` values and the audio parts' `input_audio` values, each in reading order. With `images`
    (`audio`), a model that reads them, a message holding media keeps its parts as the template reads
    them, `{"type": "image"}` (`{"type": "audio"}`) where each stands; otherwise such a part is refused
    by name."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, f"messages is {_brief(messages)}; it is a non-empty list of {{role, content}} objects",
                       param="messages")
    media = {"image_url": "image", "input_audio": "audio"}
    allowed = {"text"} | ({"image_url"} if images else set()) | ({"input_audio"} if audio else set())
    reads = " and ".join(["text", *sorted(allowed - {"text"})]) if len(allowed) > 1 else "text only"
    out, found = [], {"image_url": [], "input_audio": []}
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"message {index} is {_brief(message)}; each message has a role and content",
                           param="messages")
        content = message.get("content")
        if isinstance(content, list):
            for number, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind in allowed - {"text"} and not isinstance(part.get(kind), dict):
                    raise APIError(400, f"message {index}, part {number}: {kind} is {_brief(part.get(kind), 60)}; it "
                                   f"is an object, as in {_MEDIA_PART[kind]}", param="messages")
            kinds = sorted({str(part.get("type")) for part in content if isinstance(part, dict)} - allowed)
            well_formed = all(isinstance(part, dict) and (isinstance(part.get("text"), str) if part.get("type") == "text"
                                                          else isinstance(part.get("type"), str)
                                                          and isinstance(part.get(part["type"]), dict))
                              for part in content)
            if kinds or not well_formed:
                raise APIError(400, f"message {index} holds content parts of types {kinds or _brief(content)}; this "
                               f"model reads {reads}", param="messages")
            held = [part for part in content if part["type"] in media]
            for part in held:
                found[part["type"]].append(part["image_url"].get("url") if part["type"] == "image_url"
                                           else part["input_audio"])
            if held:
                content = [{"type": media[part["type"]]} if part["type"] in media else part for part in content]
            else:
                content = "".join(part["text"] for part in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"message {index} has content {_brief(content)}; it is a string or a list of content "
                           "parts", param="messages")
        out.append({**message, "content": content or ""})
    return out, found["image_url"], found["input_audio"]


# What a media part looks like, for a message that gives one otherwise.
_MEDIA_PART = {"image_url": '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}',
               "input_audio": '{"type": "input_audio", "input_audio": {"data": "<base64 WAV>", "format": "wav"}}'}


# -- answers ----------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(job: Job, model: str, choices: Sequence[tuple[str, str, dict | None]], usage_: dict) -> dict:
    """The whole answer; `choices` holds (text, finish_reason, log-probabilities or None) in choice order."""
    if job.kind == "completion":
        return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": model,
                "choices": [{"index": i, "text": text, "logprobs": scores, "finish_reason": reason}
                            for i, (text, reason, scores) in enumerate(choices)], "usage": usage_}
    return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": scores,
                         "finish_reason": reason} for i, (text, reason, scores) in enumerate(choices)], "usage": usage_}


def chunk(job: Job, model: str, index: int | None, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None, usage_: dict | None = None, log_probs: dict | None = None) -> dict:
    """One streamed chunk: a choice's new text (the role with a chat's first) and the log-probabilities
    of the tokens that made it, its finish reason, or (with `index` None) the closing usage chunk,
    whose `choices` is empty."""
    if job.kind == "completion":
        head = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": model}
        choice = {"index": index, "text": text or "", "logprobs": log_probs, "finish_reason": finish_reason}
    else:
        head = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created, "model": model}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": log_probs, "finish_reason": finish_reason}
    out = {**head, "choices": [] if index is None else [choice]}
    if job.include_usage:
        out["usage"] = usage_
    return out


def completion_log_probs(entries: Sequence, spelling, scores: dict | None = None) -> dict:
    """A completion's `logprobs` object over `entries` (`dew.serve.engine.Scored`, in order), added to `scores`
    when given: each token's text and its character offset in the answer's text (`spelling`, a
    `dew.serve.text.Spelling` of the tokens before these), its log-probability (null where nothing comes
    before it), and at each position a map from text to log-probability of the token and its alternatives
    (the larger value where two spell alike)."""
    scores = scores or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        spelled = [(spelling.alternative(token), value) for token, value in entry.top]  # before the token's place
        text, offset = spelling.push(entry.token)
        scores["tokens"].append(text)
        scores["text_offset"].append(offset)
        if entry.log_prob is None:
            scores["token_logprobs"].append(None)
            scores["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for alternative, value in spelled:  # most likely first: a later token that spells alike is less likely
            top.setdefault(alternative, _floored(value))
        scores["token_logprobs"].append(_floored(entry.log_prob))
        top.setdefault(text, scores["token_logprobs"][-1])
        scores["top_logprobs"].append(top)
    return scores


def chat_log_probs(entries: Sequence, spell: Callable[[int], str]) -> dict:
    """A chat's `logprobs` object (`{"content": [...], "refusal": null}`) over `entries`, in OpenAI's
    shape: each token's text, log-probability, UTF-8 bytes and its alternatives as a list."""
    def item(token: int, value: float) -> dict:
        text = spell(token)
        return {"token": text, "logprob": _floored(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(entry.token, entry.log_prob), "top_logprobs": [item(t, v) for t, v in entry.top]}
                        for entry in entries], "refusal": None}


def _floored(value: float) -> float:
    return value if value >= LOWEST_LOG_PROB else LOWEST_LOG_PROB  # NaN too
