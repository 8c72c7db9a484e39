"""The attention kernel: causal blocks against one full pass, and the mask rule."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.attention import attend, attention_mask


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
    # The same scores summed over fewer (all masked) keys: observed differences are 0 or 1 ulp.
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=1e-6, rtol=0)


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
