"""Benchmarks' own references, held to what they stand in for (a benchmark is not run by the suite)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.large_vocab import UnchunkedHead
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective

STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))


def test_large_vocab_reference_scores_what_the_objective_scores(tiny_model, tiny_variables):
    """benchmarks/large_vocab.py times LMObjective's tiled head against `UnchunkedHead`, the whole
    `[N, V]` logits: both must score the same loss and accuracy, or the ratio compares different work."""
    rows = np.random.default_rng(0).integers(0, 64, (2, 9))
    # Row 0 greedy (each token its predecessor's argmax), so the accuracy compared is not 0 against 0.
    logits = jax.jit(lambda r: tiny_model.apply(tiny_variables, r, head=False).logits())
    for i in range(8):
        rows[0, i + 1] = int(jnp.argmax(logits(jnp.asarray(rows, jnp.int32))[0, i]))
    tokens = {"text": jnp.asarray(rows, jnp.int32)}
    whole = UnchunkedHead(tiny_model, seq_len=8).loss(tiny_variables, tokens, STEP)[0]
    tiled = LMObjective(tiny_model, seq_len=8, head_chunks=3).loss(tiny_variables, tokens, STEP)[0]
    assert float(whole.ce.count) == float(tiled.ce.count) == 16.0
    # Each token's log-sum-exp over 64 logits, in float32 both ways (one pass, or three tiles combined
    # online): the sums of exponentials differ by at most ~64 ulps (4e-6 relative), so each token's
    # cross entropy by ~4e-6; 16 of them summed, 2e-4 bounds the totals' difference. Observed
    # (Intel Xeon): equal.
    assert abs(float(whole.ce.total) - float(tiled.ce.total)) < 2e-4
    assert float(whole.token_accuracy.total) == float(tiled.token_accuracy.total) >= 8.0
