"""No request stops `dew serve`: bad bodies are refused in OpenAI's error shape naming the limit, slow
and surplus connections are closed, a full queue is a 503 that passes, and mixed traffic leaves every
good request answered and no slot taken. Against the session's server (tests/serve/conftest.py:
read timeout 2 s, body limit 64 KiB, 48 connections)."""

from __future__ import annotations

import json
import random
import socket
import struct
import time
import urllib.error
import urllib.request

import pytest

from benchmarks.serve_soak import Target, drive
from tests.serve.conftest import CAPACITY, MAX_BODY, MAX_CONNECTIONS, NAME, QUEUE, READ_TIMEOUT, SLOTS, get, post_raw

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow  # the session's server compiles at start


def _still_serving(server) -> None:
    health = server.health()
    assert health["status"] == "ok" and health["busy"] == 0, health
    answer = server.client().completions.create(model=NAME, prompt="the quick", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path, body, param, words", [
    ("completions", {"prompt": "a", "seed": 2**63}, "seed", f"seed is {2**63}; a seed is an integer from -2**63"),
    ("completions", {"prompt": "a", "seed": 10**23}, "seed", "the 64-bit range of a JAX key"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "seed": -(2**63) - 1}, "seed",
     "the 64-bit range of a JAX key"),
    ("completions", {"prompt": "a", "n": 100_000}, "n",
     f"times n=100000 ask for 100000 continuations at once, and this server takes at most {SLOTS + QUEUE}"),
    ("completions", {"prompt": ["a"] * 300}, "prompt", "300 prompts times n=1 ask for 300 continuations"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": SLOTS + QUEUE + 1}, "n",
     f"({SLOTS} generating, dew serve --slots, and {QUEUE} waiting, --queue)"),
    # token ids are checked before any text is encoded: prompt 1 is named, though prompt 0 comes first
    ("completions", {"prompt": ["a " * 40, [1] * CAPACITY], "max_tokens": 1}, "max_tokens",
     f"prompt 1: the prompt's {CAPACITY} tokens plus max_tokens 1"),
    ("completions", {"prompt": "x" * 2000}, "max_tokens", f"beyond this server's context of {CAPACITY} tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, "max_tokens",
     "plus max_tokens 1 make"),
])
def test_a_request_that_can_never_be_served_is_a_400_naming_the_limit(server, path, body, param, words):
    status, answer = post_raw(f"{server.url}/v1/{path}", json.dumps({"model": NAME, **body}).encode())
    assert status == 400 and answer["error"]["param"] == param and words in answer["error"]["message"], answer
    _still_serving(server)


@pytest.mark.parametrize("path, raw, words", [
    ("completions", b'{"prompt": "ab\\ud800c", "max_tokens": 2}', "prompt holds a lone surrogate U+D800"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "x\\udc00"}]}',
     "messages[0].content holds a lone surrogate U+DC00"),
    # 30,000 deep (within the body limit): past Python's recursion limit, which the JSON reader meets first
    ("completions", b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "nests deeper than the 64 levels"),
    ("chat/completions", b'{"messages": ' + b"[" * 65 + b"]" * 65 + b"}", "nests deeper than the 64 levels"),
])
def test_a_lone_surrogate_or_json_nested_deeply_is_a_400(server, path, raw, words):
    status, answer = post_raw(f"{server.url}/v1/{path}", raw)
    assert status == 400 and words in answer["error"]["message"], answer
    _still_serving(server)


def test_a_body_past_the_limit_is_a_413_before_it_is_read(server):
    body = json.dumps({"model": NAME, "prompt": "a" * MAX_BODY}).encode()
    status, answer = post_raw(f"{server.url}/v1/completions", body)  # Content-Length names the size
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert f"of {len(body)} bytes is beyond this server's limit of {MAX_BODY} bytes (dew serve --max-body-bytes)" in \
        answer["error"]["message"]
    pieces = (body[i: i + 4096] for i in range(0, len(body), 4096))  # no Content-Length: chunked, counted as read
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=pieces,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 413 and f"of more than {MAX_BODY} bytes" in json.loads(caught.value.read())[
        "error"]["message"]
    _still_serving(server)


def _closed_within(connection: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing `connection`, which it must close within `seconds`."""
    connection.settimeout(seconds)
    received = b""
    while chunk := connection.recv(4096):
        received += chunk
    return received


def test_connections_that_send_their_head_or_body_slowly_are_closed(server):
    port = int(server.url.rsplit(":", 1)[1])
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as idle, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as partial, \
            socket.create_connection(("127.0.0.1", port), timeout=10) as slow_body:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the head
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")
        assert _closed_within(idle, READ_TIMEOUT + 5) == b""
        assert _closed_within(partial, READ_TIMEOUT + 5).startswith(b"HTTP/1.1 408 Request Timeout")
        late = _closed_within(slow_body, READ_TIMEOUT + 5)
    assert late.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in late and b"--read-timeout" in late
    assert time.monotonic() - started < READ_TIMEOUT + 5  # the three at once
    _still_serving(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_closes_its_side_after_its_request_gets_the_answer(server, stream):
    """A whole request, then a half-close (`nc -N`): the answer once was an empty reply, and nothing was logged."""
    port = int(server.url.rsplit(":", 1)[1])
    body = json.dumps({"model": NAME, "prompt": "the quick", "max_tokens": 3, "temperature": 0, "stream": stream})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        client.shutdown(socket.SHUT_WR)
        answer = _closed_within(client, 30)  # the server closes once it has answered
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), answer[:300]
    assert (b"data: [DONE]" in rest) if stream else b'"finish_reason"' in rest
    _still_serving(server)


def test_a_client_that_resets_its_connection_is_logged(server):
    """A client gone (a reset) before its answer: the answer is dropped, and the log says so."""
    port = int(server.url.rsplit(":", 1)[1])
    log = server.pretrained.directory / "serve.log"
    before = log.read_text().count("a client went away before its answer")
    # every slot, each to the end of its context: the answer takes many steps, and the reset comes amid them
    body = json.dumps({"model": NAME, "prompt": "the quick", "max_tokens": CAPACITY - 8, "n": SLOTS, "seed": 3})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 10
        while not server.health()["busy"] and time.monotonic() < deadline:
            time.sleep(0.01)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    deadline = time.monotonic() + 10
    while log.read_text().count("a client went away before its answer") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text().count("a client went away before its answer") == before + 1
    _still_serving(server)


def test_connections_past_the_limit_are_refused_at_once(server):
    port = int(server.url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as surplus:
            answer = _closed_within(surplus, 5)
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable") and b"--max-connections" in answer
    finally:
        for connection in held:
            connection.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the server has seen the held connections close
        try:
            if get(f"{server.url}/health")[0] == 200:
                break
        except (OSError, ValueError):  # refused, or its plain-text 503
            time.sleep(0.2)
    _still_serving(server)


def test_a_full_queue_is_a_503_and_the_request_is_taken_once_it_fits(server):
    client = server.client()
    # A greedy prompt that draws no EOS within its budget, so that no row ends and frees a slot meanwhile.
    prompt = next(text for text in ("a lazy dog", "old songs", "seven wizards", "the quick brown fox")
                  if server.solo(server.ids(text), CAPACITY - 8, temperature=0.0)[1][0] == "length")
    # SLOTS generating and QUEUE waiting: everything the server holds
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=CAPACITY - 8, temperature=0,
                                       n=SLOTS + QUEUE, stream=True)
    try:
        next(iter(stream))
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=NAME, prompt="a", max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "queue_full"
        assert "retry later" in caught.value.body["message"]
    finally:
        stream.close()
    deadline = time.monotonic() + 30
    while server.health()["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    _still_serving(server)


def test_mixed_traffic_answers_every_good_request_and_leaves_no_slot_taken(server):
    """The soak's mix (benchmarks/serve_soak.py), 90 requests: whole, streamed, cancelled and bad."""
    tally = drive(Target.of(server.url, MAX_BODY), 90, random.Random(0), concurrency=8)
    assert not tally.failures, tally.failures[:5]
    assert sum(tally.counts.values()) == 90
    assert {"completion", "chat, streamed", "cancelled stream"} <= set(tally.counts)
    assert sum(count for name, count in tally.counts.items() if name.startswith("bad: ")) >= 9, tally.counts
    deadline = time.monotonic() + 30
    while server.health()["busy"] and time.monotonic() < deadline:  # the last cancelled streams end
        time.sleep(0.1)
    _still_serving(server)
