"""Attention's masked softmax in Dew's kernel (dew.nn.fast_softmax) against the same math in XLA.

Bounds, per element, from the computation. Forward: each side's exponential is within 2 ulps of the
exact value (`LIBRARY_ULPS` apart), the row's sum of T terms in another order is T - 1 roundings of
the sum apart, and the division rounds once: `p` lands within `LIBRARY_ULPS + T + 1` ulps of itself.
Backward, `ds = scale * p * (g - sum(g p))`: the two sides' `p` differ as above, and `sum(g p)` by
T - 1 roundings of `sum |g p|` plus the `p` differences weighted by `|g|`; three more roundings.
The largest differences observed (AMD EPYC, AVX-512) are a few ulps of 1 (forward) and of the largest
gradient entry (backward), far inside those bounds.
"""

from __future__ import annotations

import platform
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import fast_softmax
from dew.nn.attention import attend
from tests.tolerances import LIBRARY_ULPS, ulp_bound

AVAILABLE, WHY = fast_softmax._load()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"Dew's softmax kernel is off here: {WHY}")
EPS = float(jnp.finfo(jnp.float32).eps)


@pytest.fixture
def policy(monkeypatch):
    def set_policy(value: str):
        monkeypatch.setenv("DEW_FAST_MATMUL", value)
    return set_policy


def scores_and_mask(t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    scores = jnp.asarray(rng.standard_normal((2, 3, 5, t)) * 6, jnp.float32)
    mask = rng.random((2, 5, t)) < 0.7
    mask[0, 1, :] = False  # a row with nothing to read: uniform over its keys, on both sides
    mask[1, 2, :] = np.arange(t) == 3  # a row reading one key
    return scores, jnp.asarray(mask)


def test_the_kernel_builds_where_it_can():
    if sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("c++"):
        assert AVAILABLE, WHY
    else:
        assert isinstance(WHY, str) and WHY


@needs_kernel
@pytest.mark.parametrize("t", [12, 37, 256])  # rows shorter than the lanes, with a tail past them, without
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_backward_match_xla(policy, t, dtype):
    policy("on")
    scores, mask = scores_and_mask(t)
    scale = 0.125
    g = jnp.asarray(np.random.default_rng(1).standard_normal(scores.shape), dtype)
    ours, ours_vjp = jax.vjp(lambda s: fast_softmax.masked_softmax(s, mask, scale, dtype), scores)
    theirs, theirs_vjp = jax.vjp(lambda s: fast_softmax.reference(s, mask, scale, dtype), scores)
    assert ours.dtype == theirs.dtype == jnp.dtype(dtype)
    p = np.asarray(fast_softmax.reference(scores, mask, scale, jnp.float32))
    p_bound = ulp_bound(LIBRARY_ULPS + t + 1, p)
    if dtype == jnp.float32:
        np.testing.assert_array_less(np.abs(np.asarray(ours) - np.asarray(theirs)), p_bound + 1e-30)
    else:  # each side rounds its float32 result once: equal, or one bfloat16 step apart at a tie
        step = np.abs(np.asarray(theirs, np.float32)) * 2.0**-7
        np.testing.assert_array_less(np.abs(np.asarray(ours, np.float32) - np.asarray(theirs, np.float32)),
                                     step + 1e-30)
    ds_ours, ds_theirs = np.asarray(ours_vjp(g)[0]), np.asarray(theirs_vjp(g)[0])
    g32 = np.abs(np.asarray(g, np.float32))
    gp = np.sum(g32 * p, axis=-1, keepdims=True)
    dot_bound = ulp_bound(t, gp) + np.sum(g32 * p_bound, axis=-1, keepdims=True)
    ds_bound = scale * (p_bound * (g32 + gp) + p * dot_bound + ulp_bound(3, p * (g32 + gp)))
    np.testing.assert_array_less(np.abs(ds_ours - ds_theirs), ds_bound + 1e-30)
    masked = ~np.asarray(mask)[:, None]
    assert not ds_ours[np.broadcast_to(masked, ds_ours.shape)].any(), "a masked score got a gradient"
    assert np.asarray(ours[0, :, 1], np.float32) == pytest.approx(1.0 / t, rel=2.0**-8)  # the empty row: uniform (bf16: one rounding)


@needs_kernel
def test_attention_takes_the_kernel_unless_off(policy):
    """`attend` calls the kernel under `auto` and `on`, XLA's operations under `off` or with a softcap,
    and the two agree on a causal pass (within the decoder-step bound of test_fast_matmul)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 40, 8)), jnp.float32) for _ in range(2))
    mask = jnp.tril(jnp.ones((40, 40), bool))[None].repeat(2, 0)
    run = lambda softcap=None: jax.jit(lambda q, k, v: attend(q, k, v, mask, causal_blocks=True, block=16,  # noqa: E731
                                                              softcap=softcap))
    outputs = {}
    for value in ("auto", "on", "off"):
        policy(value)
        text = run().lower(q, k, v).as_text()
        assert ("dew_softmax_f32" in text) == (value != "off"), value
        outputs[value] = np.asarray(run()(q, k, v))
    policy("on")
    assert "dew_softmax" not in run(softcap=30.0).lower(q, k, v).as_text()
    np.testing.assert_allclose(outputs["on"], outputs["off"], rtol=0, atol=1e-5)


@needs_kernel
def test_vmapped_softmax_runs_row_by_row(policy):
    policy("on")
    scores, mask = scores_and_mask(16)
    stacked = jnp.stack([scores, scores * 0.5])
    ours = jax.vmap(lambda s: fast_softmax.masked_softmax(s, mask, 1.0, jnp.float32))(stacked)
    theirs = jax.vmap(lambda s: fast_softmax.reference(s, mask, 1.0, jnp.float32))(stacked)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=ulp_bound(LIBRARY_ULPS + 17))


def test_off_and_several_devices_keep_xla(policy, monkeypatch):
    policy("off")
    assert fast_softmax.status() == (False, "turned off by DEW_FAST_MATMUL=off")
    assert not fast_softmax.usable(jnp.float32)
    policy("on")
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    available, reason = fast_softmax.status()
    assert not available and "2 devices" in reason
    assert not fast_softmax.usable(jnp.float16)


@needs_kernel
def test_bad_shapes_are_refused(policy):
    policy("on")
    scores, mask = scores_and_mask(8)
    with pytest.raises(ValueError, match=r"float32 scores \[B, H, R, T\] and a mask \[B, R, T\]; got float32 "
                                         r"\(2, 3, 5, 8\) and \(2, 5, 7\)"):
        fast_softmax.masked_softmax(scores, mask[..., :7], 1.0, jnp.float32)


@needs_kernel
@pytest.mark.parametrize("width", [1, 7, 16, 33, 4096])
def test_first_max_matches_xla(policy, width):
    """The first maximum's column, exactly: comparisons only, so both sides give the same integers.
    Rows with ties (the first one wins, in the vector body and in the tail), a maximum in the tail,
    -inf columns (the loss's shared tile columns), all -inf, and -0.0 against 0.0 (equal, so the
    first of them). A row holding a NaN is the kernel's `width`; XLA's answer there depends on which
    of its reductions runs (YNNPACK's max skips a NaN at 4096 columns, XLA's own keeps it), so that
    row is compared with `width` only."""
    policy("on")
    rng = np.random.default_rng(width)
    x = rng.standard_normal((12, width)).astype(np.float32)
    x[1, :] = 3.0  # every column ties: column 0
    x[2, width // 2:] = 9.0  # a tie from the middle on
    x[3, -1] = 50.0  # the maximum in the tail
    x[4, :] = -np.inf
    x[5, width // 3] = np.nan
    x[6, :] = np.where(np.arange(width) % 2 == 0, -0.0, -1.0)
    x[6, -1] = 0.0
    x[7, : width // 2] = -np.inf
    x[8, :] = np.float32(1e-30) * (np.arange(width) % 5)  # tiny values, ties every fifth column
    jitted = jax.jit(fast_softmax.first_max)
    assert "dew_softmax_first_max" in jitted.lower(jnp.asarray(x)).as_text()
    ours = np.asarray(jitted(jnp.asarray(x)))
    theirs = np.asarray(jax.jit(fast_softmax.first_max_reference)(jnp.asarray(x)))
    rows = np.arange(len(x)) != 5
    np.testing.assert_array_equal(ours[rows], theirs[rows])
    assert ours[1] == 0 and ours[4] == 0 and ours[5] == width and ours[3] == width - 1
    finite = np.isfinite(x).all(axis=1) & ~np.isnan(x).any(axis=1)
    np.testing.assert_array_equal(ours[finite], np.argmax(x[finite], axis=1))


def test_first_max_refuses_what_it_cannot_take(policy):
    policy("on")
    with pytest.raises(ValueError, match="float32 \\[N, C\\] with C >= 1"):
        fast_softmax.first_max(jnp.zeros((3, 0), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        fast_softmax.first_max(jnp.zeros((3, 4), jnp.bfloat16))
