"""Shared fixtures: one tiny decoder and its variables, built once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from tests.compile_flags import suite_flags

# Before JAX starts its backend (the first computation reads XLA_FLAGS); subprocesses inherit them.
os.environ["XLA_FLAGS"] = suite_flags(os.environ.get("XLA_FLAGS", ""))
# No test reaches the network: huggingface_hub reads only its cache (a test of a download mocks it and
# turns this off); subprocesses inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"
# One persistent compilation cache for the whole run, empty at its start, shared by the workers and every
# process a test starts (a second `dew train` that resumes, `dew serve`), and never the user's ~/.cache/dew/jax:
# Dew's commands leave a configured cache alone, so a test that calls one in its own process no longer turns
# the home cache on for the rest of its worker, and no run reads programs an earlier run left. A size bound
# makes JAX lock the directory, so no process reads an entry another is still writing.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="dew-suite-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")  # Dew's own floor

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from dew import models  # noqa: E402
from tests.compiled import compiled  # noqa: E402

# On an accelerator, the parity tests compare with float32 oracles: a TPU multiplies float32 operands in one
# bfloat16 pass unless asked otherwise (a GPU in TF32), which no float32 tolerance allows for. "highest" gives
# float32 products there; on the CPU it changes nothing (its products are float32 already), so it is left alone.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=64, max_seq_len=64)


@pytest.fixture(scope="session")
def tiny_model():
    return models.build("causal_transformer", **TINY)


@pytest.fixture(scope="session")
def tiny_variables(tiny_model):
    return compiled(tiny_model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)


@pytest.fixture
def x64():
    """float64 inside the test (the reference checks of the recurrent mixers' chunked forms)."""
    with jax.enable_x64(True):
        yield

