"""The OpenAI-compatible HTTP server over a `Served` checkpoint (FastAPI on uvicorn).

    GET  /health                 200 with the engine's load (503 once the engine has stopped)
    GET  /v1/models              the one model served
    POST /v1/completions         text completions, `stream: true` as server-sent events
    POST /v1/chat/completions    chat completions rendered with the checkpoint's chat template

A streamed answer is `data: {chunk}` events (a chat's first delta carries the role, each choice's
last its `finish_reason`, and with `stream_options.include_usage` a last chunk with empty `choices`
carries the usage), then `data: [DONE]`. A client that goes away frees its slots.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

try:
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError:
    raise ImportError("dew serve needs FastAPI and uvicorn: pip install 'dew-ml[serve]'") from None

from dew.serve import protocol
from dew.serve.engine import QueueFull, Request, TooLong
from dew.serve.protocol import APIError, Job
from dew.serve.service import Served
from dew.serve.text import TextStream

logger = logging.getLogger("dew.serve")


def create_app(served: Served):
    """The FastAPI application answering for `served` (whose engine must be started)."""
    app = FastAPI(title="dew serve", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = served.task.tokenizer
    vocab = served.task.model.config.vocab_size

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def fault(request, error: Exception):  # a bug: logged with its traceback by the server, answered in shape
        body = APIError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        load = served.engine.load()
        return JSONResponse({"status": "ok" if load["running"] else "stopped", **load},
                            status_code=200 if load["running"] else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": served.created,
                                            "owned_by": "dew", "max_model_len": served.engine.capacity}]}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = protocol.parse_json(await request.body())
        protocol.check_model(body, served.name)
        prompts = protocol.completion_prompts(body.get("prompt"), tokenizer.encode, vocab)
        job = protocol.read_job("completion", body, prompts, served.task.sampling)
        return await answer(job, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = protocol.parse_json(await request.body())
        protocol.check_model(body, served.name)
        messages = protocol.chat_messages(body.get("messages"))
        if served.chat is None:
            raise APIError(400, f"{served.name} has no chat template (its tokenizer files and metadata name none): "
                           "use /v1/completions, or start dew serve with --chat-template FILE", param="messages")
        try:
            prompt = tokenizer.encode(served.chat.render(messages))
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from None
        job = protocol.read_job("chat", body, [prompt], served.task.sampling)
        if job.max_tokens is None:  # as much as the context leaves (at least one, so a full prompt is refused)
            job.max_tokens = max(served.engine.capacity - len(prompt), 1)
        return await answer(job, request)

    async def answer(job: Job, request: HTTPRequest):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)  # noqa: E731 (engine thread)
        decode = served.decode()
        requests = [Request(prompt, job.max_tokens, job.sampling, job.seed,
                            _Choice(i * job.n + j, TextStream(decode, prompt, job.stop), emit), i, j)
                    for i, prompt in enumerate(job.prompts) for j in range(job.n)]
        try:
            served.engine.submit(requests)
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


class _Choice:
    """A `Consumer` that turns one choice's tokens into text events for the answering coroutine."""

    def __init__(self, index: int, stream: TextStream, emit):
        self.index, self.stream, self.emit = index, stream, emit

    def token(self, token_id: int) -> bool:
        text = self.stream.push(token_id)
        if text:
            self.emit(("text", self.index, text))
        return self.stream.stopped

    def finish(self, reason: str, completion_tokens: int) -> None:
        if reason != "cancelled":
            tail = self.stream.close()
            if tail:
                self.emit(("text", self.index, tail))
        self.emit(("end", self.index, reason, completion_tokens))


def _engine_stopped(status: int = 500) -> APIError:
    return APIError(status, "the serving engine has stopped (see the server's log)", kind="server_error",
                    code="engine_stopped")


async def _whole(job: Job, served: Served, requests, events: asyncio.Queue, prompt_tokens: int, request) -> dict:
    texts, reasons, completion_tokens = [""] * len(requests), [None] * len(requests), 0
    try:
        while None in reasons:
            try:
                event = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return {}
                continue
            if event[0] == "text":
                texts[event[1]] += event[2]
            else:
                if event[2] == "cancelled":
                    raise _engine_stopped()
                reasons[event[1]] = event[2]
                completion_tokens += event[3]
    finally:
        _cancel_unfinished(served, requests)
    return protocol.response(job, served.name, list(zip(texts, reasons)),
                             protocol.usage(prompt_tokens, completion_tokens))


async def _streamed(job: Job, served: Served, requests, events: asyncio.Queue, prompt_tokens: int) -> AsyncIterator[str]:
    send = lambda chunk: f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"  # noqa: E731
    left, completion_tokens = len(requests), 0
    try:
        if job.kind == "chat":
            for index in range(len(requests)):
                yield send(protocol.chunk(job, served.name, index, text="", role=True))
        while left:
            event = await events.get()
            if event[0] == "text":
                yield send(protocol.chunk(job, served.name, event[1], text=event[2]))
                continue
            if event[2] == "cancelled":
                yield send(_engine_stopped().body())
                return
            left -= 1
            completion_tokens += event[3]
            yield send(protocol.chunk(job, served.name, event[1], finish_reason=event[2]))
        if job.include_usage:
            yield send(protocol.chunk(job, served.name, None, usage_=protocol.usage(prompt_tokens, completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream: its slots go back at once
        _cancel_unfinished(served, requests)


def _cancel_unfinished(served: Served, requests) -> None:
    for request in requests:
        if not request.ended:
            served.engine.cancel(request)


def run(served: Served, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until interrupted (SIGINT or SIGTERM), then stop the engine."""
    import uvicorn

    served.engine.start()
    try:
        uvicorn.run(create_app(served), host=host, port=port, log_level=log_level)
    finally:
        served.engine.close()
