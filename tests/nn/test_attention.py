"""The attention kernel: causal blocks against one full pass, and the mask rule."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.attention import attend, attention_mask
from tests.tolerances import ulp_bound


@pytest.mark.parametrize("window", [None, 3])
def test_causal_blocks_equal_one_full_pass(window):
    rng = np.random.default_rng(0)
    B, S, H, K, D = 2, 11, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
    slots = jnp.broadcast_to(jnp.arange(S), (B, S))
    segments = jnp.asarray([[1] * 5 + [2] * 6, [1] * 9 + [0] * 2], jnp.int32)
    mask = attention_mask(slots, slots, segments, segments, causal=True, window=window)
    full = attend(q, k, v, mask)
    blocked = attend(q, k, v, mask, causal_blocks=True, block=4)  # blocks of 4, 4 and 3 queries
    # The same fp32 computation over fewer (all masked) keys, summed in another order, one library. A
    # weight moves by twice its score's error (8 roundings of an 8-term dot product and its scale, 2 of
    # the max subtracted, in units of the largest score's terms) plus 12 roundings (exp, an 11-term sum,
    # a division); the output adds 10 more, in units of the largest value. Bound 4.8e-5; observed: equal.
    score_size = float(np.einsum("bshd,bktd->bhkst", np.abs(q), np.abs(k)).max()) * D**-0.5
    bound = ulp_bound(2 * (8 + 2) * score_size + 12 + 10, magnitude=float(np.abs(v).max()))
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=bound, rtol=0)


def test_mask_rule():
    slots = jnp.arange(5)[None]
    segments = jnp.asarray([[1, 1, 2, 2, 0]])
    mask = np.asarray(attention_mask(slots, slots, segments, segments, causal=True, window=None))[0]
    expected = np.array([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],  # padding reads only itself, so no row is empty
    ], bool)
    np.testing.assert_array_equal(mask, expected)
    windowed = np.asarray(attention_mask(slots, slots, jnp.ones((1, 5)), jnp.ones((1, 5)), causal=True, window=2))[0]
    assert windowed[4].tolist() == [False, False, False, True, True]
