"""Shared fixtures: one tiny decoder and its variables, built once per session."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dew import models

TINY = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=64, max_seq_len=64)


@pytest.fixture(scope="session")
def tiny_model():
    return models.build("causal_transformer", **TINY)


@pytest.fixture(scope="session")
def tiny_variables(tiny_model):
    return tiny_model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
