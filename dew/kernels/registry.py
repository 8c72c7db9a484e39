"""Every native kernel's XLA targets registered at once: a program compiled in another process and loaded
from its bytes (`dew.serve.programs`) calls its kernels by name, where tracing would have registered them."""

from __future__ import annotations

from dew.kernels import blocks, decode_attention, head_rows, int8, matmul, prefill_attention, softmax

# Each function that registers a kernel's targets with XLA (tests/kernels/test_registry.py finds them all).
LOADERS = (matmul._load, matmul._few_rows, softmax._load, softmax._load_attention, int8._load, decode_attention._load,
           blocks._load, head_rows._load, prefill_attention._load)


def register_targets() -> None:
    """Load each kernel this machine built and register its targets (once; a kernel that did not build is
    skipped, as tracing skips it)."""
    for load in LOADERS:
        load()
