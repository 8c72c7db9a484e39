"""Serving: `Engine`, continuous batching over a fixed set of KV-cache slots, and the OpenAI-compatible
HTTP server `dew serve` runs over it (`dew.serve.app`, which needs the `serve` extra)."""

from dew.serve.engine import Engine, QueueFull, Request, TooLong

__all__ = ["Engine", "QueueFull", "Request", "TooLong"]
