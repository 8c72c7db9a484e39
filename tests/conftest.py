"""Shared fixtures: one tiny decoder and its variables, built once per session."""

from __future__ import annotations

import os

from tests.compile_flags import suite_flags

# Before JAX starts its backend (the first computation reads XLA_FLAGS); subprocesses inherit them.
os.environ["XLA_FLAGS"] = suite_flags(os.environ.get("XLA_FLAGS", ""))
# No test reaches the network: huggingface_hub reads only its cache (a test of a download mocks it and
# turns this off); subprocesses inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"
# No test process, and no process a test starts, uses JAX's persistent compilation cache unless its test names
# a directory: Dew's commands turn the cache on where they start (`dew.compilation_cache`), and a test that
# calls one in its own process would leave it on for the rest of the worker, which then wrote every later
# program of half a second's compile into ~/.cache/dew/jax (one that closes over a 135M model's weights spent
# 100 s compressing them) and read programs an earlier run had left there.
os.environ["DEW_COMPILATION_CACHE"] = "0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from dew import models  # noqa: E402

TINY = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=64, max_seq_len=64)


@pytest.fixture(scope="session")
def tiny_model():
    return models.build("causal_transformer", **TINY)


@pytest.fixture(scope="session")
def tiny_variables(tiny_model):
    return tiny_model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)


@pytest.fixture
def x64():
    """float64 inside the test (the reference checks of the recurrent mixers' chunked forms)."""
    with jax.enable_x64(True):
        yield
