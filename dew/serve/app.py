"""The OpenAI-compatible HTTP server over a `Served` checkpoint (FastAPI on uvicorn).

    GET  /health                 200 with the engine's load once it is ready (503 "compiling" before, as the
                                 engine compiles its first programs; 503 "stopped" once it has stopped)
    GET  /v1/models              the one model served
    GET  /tokenizer_info         the special tokens and chat template (vLLM's; read by lm-eval)
    POST /tokenize, /detokenize  text to token ids and back with the served tokenizer (vLLM's shapes)
    POST /v1/completions         text completions, `stream: true` as server-sent events
    POST /v1/chat/completions    chat completions rendered with the checkpoint's chat template

A streamed answer is `data: {chunk}` events (a chat's first delta carries the role, each choice's
last its `finish_reason`, and with `stream_options.include_usage` a last chunk with empty `choices`
carries the usage), then `data: [DONE]`. A client that goes away frees its slots.

No request can stop the server. A body past `Limits.max_body_bytes` is answered 413 as soon as that
is known (before it is read, when its Content-Length says so), and one that does not arrive within
`Limits.read_timeout` 408. Parsing, rendering and tokenizing run off the event loop,
`PREPARE_THREADS` requests at a time, so `/health` and the streams in flight go on meanwhile. A
request is refused (400, naming the limit) as soon as it is known that it can never be served: more
rows than the slots and queue hold, or a prompt past the capacity (token ids before any text is
encoded, each text prompt as soon as it is). Should the engine's thread fail anyway, `run` stops
serving and raises `EngineFailed`, so the process exits with status 1 and a supervisor can start it
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:
    import uvicorn
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
except ImportError:
    raise ImportError("dew serve needs FastAPI and uvicorn: pip install 'dew-ml[serve]'") from None

from dew.data.inputs import MEDIA_FIELDS
from dew.serve import protocol
from dew.serve.engine import QueueFull, Request, TooLong
from dew.serve.audio import decode_audio
from dew.serve.images import decode_image
from dew.serve.network import Limits
from dew.serve.protocol import APIError, Job
from dew.serve.service import Served
from dew.serve.text import Spelling, TextStream

logger = logging.getLogger("dew.serve")

PREPARE_THREADS = 2
"""Requests parsed, rendered and tokenized at once, on threads that live as long as the server. The
tokenizer lets go of Python's lock, the JSON reader and the template do not: more threads would hold
more bodies in memory and take the lock from the event loop and the engine's thread, for no faster
answers. Threads made afresh would each get memory of their own from the allocator, kept after they end."""


class EngineFailed(RuntimeError):
    """The engine's thread failed (a bug; its traceback is in the log), so the server stopped."""


def create_app(served: Served, limits: Limits):
    """The FastAPI application answering for `served` (whose engine must be started) within `limits`."""
    preparing = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="dew-serve-prepare")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        preparing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dew serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    vocab = served.task.model.config.vocab_size
    engine = served.engine

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def fault(request, error: Exception):  # a bug: logged with its traceback by the server, answered in shape
        message = f"internal error: {type(error).__name__}: {error}".encode("utf-8", "backslashreplace").decode()
        return JSONResponse(APIError(500, message, kind="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        load = engine.load()
        status = "stopped" if not load["running"] else "ok" if load["ready"] else "compiling"
        return JSONResponse({"status": status, **load}, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "dew", "max_model_len": engine.capacity}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return served.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        raw = await _read_body(request, limits)
        return await asyncio.get_running_loop().run_in_executor(preparing, prepare_tokenize, raw)

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        raw = await _read_body(request, limits)
        return await asyncio.get_running_loop().run_in_executor(preparing, prepare_detokenize, raw)

    def prepare_tokenize(raw: bytes) -> dict:
        text, special = protocol.tokenize_request(protocol.parse_json(raw), served.name)
        ids = served.tokenize(text, special)
        return {"count": len(ids), "max_model_len": engine.capacity, "tokens": ids}

    def prepare_detokenize(raw: bytes) -> dict:
        ids = protocol.detokenize_request(protocol.parse_json(raw), served.name, vocab)
        return {"prompt": served.task.tokenizer.decode(ids) if ids else ""}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        raw = await _read_body(request, limits)
        job = await asyncio.get_running_loop().run_in_executor(preparing, prepare_completion, raw)
        return await answer(job, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        raw = await _read_body(request, limits)
        job = await asyncio.get_running_loop().run_in_executor(preparing, prepare_chat, raw)
        return await answer(job, request)

    def prepare_completion(raw: bytes) -> Job:
        body = protocol.parse_json(raw)
        protocol.check_model(body, served.name)
        job = protocol.read_job("completion", body, served.task.sampling, engine.max_log_probs)
        prompts = protocol.completion_prompts(body.get("prompt"), vocab)
        job.texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        check_rows(len(prompts), job.n)
        order = sorted(range(len(prompts)), key=lambda i: isinstance(prompts[i], str))  # token ids first: no encoding
        for index in order:
            if isinstance(prompts[index], str):
                prompts[index] = served.prompts.text(prompts[index])
                protocol.check_ids(index, prompts[index], vocab)
            check_fits(prompts[index], job, f"prompt {index}: " if len(prompts) > 1 else "")
        job.prompts = prompts
        return job

    def prepare_chat(raw: bytes) -> Job:
        body = protocol.parse_json(raw)
        protocol.check_model(body, served.name)
        hears = served.processor is not None and served.processor.audio is not None
        messages, urls, clips = protocol.chat_messages(body.get("messages"), images=served.processor is not None,
                                                       audio=hears)
        if len(urls) > served.images.max_images:
            raise APIError(400, f"the messages hold {len(urls)} images, past this server's --max-images "
                           f"{served.images.max_images}: send at most {served.images.max_images} a request",
                           param="messages")
        if len(clips) > served.audio.max_clips:
            raise APIError(400, f"the messages hold {len(clips)} audio clips, past this server's --max-audio-clips "
                           f"{served.audio.max_clips}: send at most {served.audio.max_clips} a request",
                           param="messages")
        if served.chat is None:
            raise APIError(400, f"{served.name} has no chat template (its tokenizer files and metadata name none): "
                           "use /v1/completions, or start dew serve with --chat-template FILE", param="messages")
        job = protocol.read_job("chat", body, served.task.sampling, engine.max_log_probs)
        check_rows(1, job.n)
        pictures = [decode_image(url, index, served.images) for index, url in enumerate(urls)]
        waveforms = [decode_audio(clip, index, served.audio, served.processor.sampling_rate)
                     for index, clip in enumerate(clips)]
        try:
            prompt = served.prompts.chat(served.chat, messages)
            if pictures or waveforms:  # each placeholder the template wrote expands to its image's or clip's tokens
                inputs = served.processor.from_ids(prompt, pictures, waveforms)
                prompt = [int(i) for i in inputs.tokens[0]]
                # the image fields (Qwen 3.5's three-axis positions too) and the images (and their grids)
                job.media = {name: np.asarray(values[0]) for name, values in inputs.token_fields.items()
                             if name in MEDIA_FIELDS + ("rotary_positions",)}
                job.media.update({name: np.asarray(values[0]) for name, values in inputs.conditioning.items()})
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from None
        protocol.check_ids(0, prompt, vocab)
        check_fits(prompt, job, "")
        if job.max_tokens is None:  # as much as the context leaves
            job.max_tokens = engine.capacity - len(prompt)
        job.prompts = [prompt]
        return job

    def check_rows(prompts: int, n: int) -> None:
        if prompts * n > engine.max_rows:
            raise APIError(400, f"{prompts} prompt{'s' if prompts > 1 else ''} times n={n} ask for {prompts * n} "
                           f"continuations at once, and this server takes at most {engine.max_rows} ({engine.slots} "
                           f"generating, dew serve --slots, and {engine.queue_limit} waiting, --queue): ask for at "
                           f"most {engine.max_rows} a request", param="n" if prompts == 1 else "prompt")

    def check_fits(prompt: list[int], job: Job, where: str) -> None:
        try:  # a chat that names no budget takes what the context leaves, at least one token
            engine.check(len(prompt), job.max_tokens or 1, job.sampling)
        except TooLong as error:
            raise APIError(400, where + str(error), param="max_tokens", code="context_length_exceeded") from None
        except ValueError as error:
            raise APIError(400, where + str(error)) from None

    async def answer(job: Job, request: HTTPRequest):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)  # noqa: E731 (engine thread)
        decode = served.decode()
        prompt_log_probs = job.log_probs if job.echo else None
        # an echo of max_tokens 0 draws one token, as vLLM does, and leaves it out of the answer
        requests = [Request(prompt, job.max_tokens or 1, job.sampling, job.seed,
                            _Choice(i * job.n + j, TextStream(decode, prompt, job.stop), emit,
                                    prompt_log_probs is not None), i, j, media=job.media,
                            log_probs=job.log_probs, prompt_log_probs=prompt_log_probs)
                    for i, prompt in enumerate(job.prompts) for j in range(job.n)]
        try:
            engine.submit(requests)
        except TooLong as error:
            raise APIError(400, str(error), param="max_tokens", code="context_length_exceeded") from None
        except ValueError as error:
            raise APIError(400, str(error)) from None
        except QueueFull as error:
            raise APIError(503, str(error), kind="server_error", code="queue_full") from None
        except RuntimeError:  # the engine's thread has stopped
            raise _engine_stopped(503) from None
        prompt_tokens = sum(len(prompt) for prompt in job.prompts)
        if job.stream:
            return StreamingResponse(_streamed(job, served, requests, events, prompt_tokens),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await _whole(job, served, requests, events, prompt_tokens, request))

    return app


async def _read_body(request: HTTPRequest, limits: Limits) -> bytes:
    """The whole body, refused (413) as soon as it is known to pass `limits.max_body_bytes` (by its
    Content-Length, before reading) and (408) when it does not arrive within `limits.read_timeout`
    seconds. Starlette's own body limit answers in plain text, not in OpenAI's error shape."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"of {declared} bytes", limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.read_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"of more than {limit} bytes", limit)
                chunks.append(chunk)
    except TimeoutError:
        # the rest of the body may still come: the connection cannot carry another request
        raise APIError(408, f"the request body did not arrive within {limits.read_timeout:g} s (dew serve "
                       "--read-timeout): send it whole at once", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        logger.info("a client closed the connection before its whole request body came; nothing to answer")
        raise APIError(400, "the client closed the connection before its whole body came") from None
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body {size} is beyond this server's limit of {limit} bytes (dew serve "
                    "--max-body-bytes): send a shorter request, or start the server with a higher limit",
                    code="request_too_large")


class _Choice:
    """A `Consumer` that turns one choice's tokens into text events for the answering coroutine: the
    prompt's log-probabilities first (`prompt_scored`), then each piece of text with those of the tokens
    drawn since the last piece, and at the end the rest."""

    def __init__(self, index: int, stream: TextStream, emit, prompt_scored: bool = False):
        self.index, self.stream, self.emit = index, stream, emit
        self.prompt_scored = prompt_scored
        self.entries: list = []  # drawn tokens' scores not yet sent

    def scores(self, entries: list) -> None:
        if self.prompt_scored:
            self.prompt_scored = False
            self.emit(("prompt", self.index, entries))
        else:
            self.entries.extend(entries)

    def token(self, token_id: int) -> bool:
        text = self.stream.push(token_id)
        if text:
            self.emit(("text", self.index, text, self._taken()))
        return self.stream.stopped

    def finish(self, reason: str, completion_tokens: int) -> None:
        if reason != "cancelled":
            tail = self.stream.close()
            if tail:
                self.emit(("text", self.index, tail, self._taken()))
        self.emit(("end", self.index, reason, completion_tokens, self._taken()))

    def _taken(self) -> list:
        entries, self.entries = self.entries, []
        return entries


def _engine_stopped(status: int = 500) -> APIError:
    return APIError(status, "the serving engine has stopped (see the server's log)", kind="server_error",
                    code="engine_stopped")


async def _whole(job: Job, served: Served, requests, events: asyncio.Queue, prompt_tokens: int, request) -> dict:
    texts, reasons, completion_tokens = [""] * len(requests), [None] * len(requests), 0
    prompt_entries, entries = [[] for _ in requests], [[] for _ in requests]
    try:
        while None in reasons:
            try:
                event = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    logger.info("a client went away before its answer (%s %s): its %d continuations were cancelled",
                                request.method, request.url.path, sum(reason is None for reason in reasons))
                    return {}
                continue
            if event[0] == "prompt":
                prompt_entries[event[1]] = event[2]
            elif event[0] == "text":
                texts[event[1]] += event[2]
                entries[event[1]] += event[3]
            else:
                if event[2] == "cancelled":
                    raise _engine_stopped()
                reasons[event[1]] = event[2]
                completion_tokens += event[3]
                entries[event[1]] += event[4]
    finally:
        _cancel_unfinished(served, requests)
    if await request.is_disconnected():
        logger.info("a client went away before its answer (%s %s): the answer was dropped", request.method,
                    request.url.path)
        return {}
    if job.kind == "completion" and job.max_tokens == 0:  # echo alone: the one token drawn is left out
        texts, reasons, entries, completion_tokens = [""] * len(requests), ["length"] * len(requests), \
            [[] for _ in requests], 0
    scores = [None] * len(requests)
    echoed = [0] * len(requests)  # characters of each answer's text before its continuation
    if job.kind == "completion" and job.echo:
        decode = served.decode()
        for index, row in enumerate(requests):
            sent = job.texts[row.prompt_index]
            prompt = decode(row.prompt) if sent is None else sent
            texts[index], echoed[index] = prompt + texts[index], len(prompt)
    if job.log_probs is not None:
        decode, spell = served.decode(), served.spell()
        for i, row in enumerate(requests):
            if job.kind == "chat":
                scores[i] = protocol.chat_log_probs(entries[i], spell)
                continue
            # the prompt's tokens (echoed) from the text's start, then the continuation's from the echo's end
            echo = protocol.completion_log_probs(prompt_entries[i], Spelling(decode, spell))
            drawn = Spelling(decode, spell, row.prompt, echoed[i])
            scores[i] = protocol.completion_log_probs(entries[i], drawn, echo)
    return protocol.response(job, served.name, list(zip(texts, reasons, scores)),
                             protocol.usage(prompt_tokens, completion_tokens))


async def _streamed(job: Job, served: Served, requests, events: asyncio.Queue, prompt_tokens: int) -> AsyncIterator[str]:
    send = lambda chunk: f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"  # noqa: E731
    left, completion_tokens = len(requests), 0
    decode, spell = served.decode(), served.spell()
    spellings = [Spelling(decode, spell, request.prompt) for request in requests]  # each choice's, across chunks

    def scored(index: int, entries: list) -> dict | None:
        if job.log_probs is None:
            return None
        if job.kind == "chat":
            return protocol.chat_log_probs(entries, spell)
        return protocol.completion_log_probs(entries, spellings[index])

    ended = False
    try:
        if job.kind == "chat":
            for index in range(len(requests)):
                yield send(protocol.chunk(job, served.name, index, text="", role=True))
        while left:
            event = await events.get()
            if event[0] == "text":
                yield send(protocol.chunk(job, served.name, event[1], text=event[2], log_probs=scored(event[1], event[3])))
                continue
            if event[2] == "cancelled":
                ended = True
                yield send(_engine_stopped().body())
                return
            left -= 1
            completion_tokens += event[3]
            yield send(protocol.chunk(job, served.name, event[1], finish_reason=event[2],
                                      log_probs=scored(event[1], event[4]) if event[4] else None))
        if job.include_usage:
            yield send(protocol.chunk(job, served.name, None, usage_=protocol.usage(prompt_tokens, completion_tokens)))
        ended = True
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream: its slots go back at once
        if not ended:
            logger.info("a client went away mid-stream: its %d unfinished continuations were cancelled", left)
        _cancel_unfinished(served, requests)


def _cancel_unfinished(served: Served, requests) -> None:
    for request in requests:
        if not request.ended:
            served.engine.cancel(request)


def run(served: Served, listener: socket.socket, limits: Limits, log_level: str = "info") -> None:
    """Serve on `listener` (`dew.serve.network.bind`) within `limits` until interrupted (SIGINT or
    SIGTERM), then stop the engine. Should the engine's thread fail, stop serving and raise `EngineFailed`."""
    config = uvicorn.Config(create_app(served, limits), log_level=log_level, http=limits.protocol(),
                            timeout_keep_alive=limits.keep_alive_timeout,
                            # past max_connections a connection is refused as it opens (network.Guarded); each
                            # open one may run a request
                            limit_concurrency=limits.max_connections + 1)
    server = uvicorn.Server(config)

    def stop(error: BaseException) -> None:  # on the engine's thread; uvicorn's loop reads the flag every 0.1 s
        server.should_exit = True

    served.engine.start(on_failure=stop)
    # what the first chat prompt would otherwise make, made while the engine waits for its KV cache's zeros:
    # made once ready, it held Python's lock (tokenizers keeps it) as /health first answered 200
    threading.Thread(target=served.prompts.prepare, daemon=True, name="dew-serve-prepare-chat").start()
    try:
        server.run(sockets=[listener])
    finally:
        served.engine.close()
        listener.close()
    if served.engine.failure is not None:
        raise EngineFailed("the serving engine's thread failed (its traceback is logged above), so no request could "
                           "be answered: dew serve stopped, for its supervisor to start it again")
