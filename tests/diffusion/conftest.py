"""Shared fixtures: one tiny bidirectional decoder with a mask id, and its variables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dew import models
from dew.diffusion.discrete import MDLM

VOCAB = 48
"""Clean ids are 0..47; the mask takes 48, the id after the last."""
MASK_ID = VOCAB
BIDIRECTIONAL = dict(vocab_size=VOCAB + 1, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     mlp_features=64, max_seq_len=48, causal=False)


@pytest.fixture(scope="session")
def process():
    return MDLM(mask_id=MASK_ID)()


@pytest.fixture(scope="session")
def masked_model():
    return models.build("causal_transformer", **BIDIRECTIONAL)


@pytest.fixture(scope="session")
def masked_variables(masked_model):
    variables = masked_model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
    # Larger weights make the predictions depend on the context, so a masking error would show.
    return jax.tree_util.tree_map(lambda x: x * 4.0, variables)
