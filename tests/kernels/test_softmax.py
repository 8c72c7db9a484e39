"""Attention's masked softmax in Dew's kernel (dew.kernels.softmax) against the same math in XLA.

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

from dew.kernels import softmax as fast_softmax
from dew.nn.attention import attend
from tests.compiled import compiled
from tests.tolerances import LIBRARY_ULPS, ulp_bound

AVAILABLE, WHY = fast_softmax._load()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"Dew's softmax kernel is off here: {WHY}")
EPS = float(jnp.finfo(jnp.float32).eps)


@pytest.fixture
def policy(monkeypatch):
    def set_policy(value: str):
        monkeypatch.setenv("DEW_KERNELS", value)
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
    policy("native")
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
@pytest.mark.parametrize("t", [12, 37, 256])
def test_skipped_masked_lanes_and_the_undifferentiated_call_keep_the_bits(policy, t):
    """A causal mask leaves whole vectors of a row masked, whose exponentials the kernel skips (each is
    exactly 0 when the row reads anything): the same bits as the same scores unmasked but equal to the
    masked value, where it computes them all. And the bfloat16 probabilities a pass nothing
    differentiates asks for alone (`dew_softmax_bf16_probs`) are bit for bit those of the forward that
    keeps float32 ones for its backward."""
    policy("native")
    scores, _ = scores_and_mask(t)
    causal = np.broadcast_to(np.arange(t) <= 3 * np.arange(5)[:, None] + 1, (2, 5, t)).copy()
    causal[0, 1, :] = False  # nothing to read: the exponentials are all computed (uniform row)
    as_masked = jnp.where(jnp.asarray(causal)[:, None], scores, fast_softmax.MASKED)  # scale 1: x is MASKED
    everything = jnp.ones_like(jnp.asarray(causal))
    for dtype in (jnp.float32, jnp.bfloat16):
        skipped = np.asarray(fast_softmax.masked_softmax(scores, jnp.asarray(causal), 1.0, dtype))
        computed = np.asarray(fast_softmax.masked_softmax(as_masked, everything, 1.0, dtype))
        np.testing.assert_array_equal(skipped.view(np.uint16 if dtype == jnp.bfloat16 else np.uint32),
                                      computed.view(np.uint16 if dtype == jnp.bfloat16 else np.uint32))
    alone = jax.jit(lambda s: fast_softmax.masked_softmax(s, jnp.asarray(causal), 0.125, jnp.bfloat16))
    assert "dew_softmax_bf16_probs" in alone.lower(scores).as_text()
    kept = fast_softmax._forward(scores, jnp.asarray(causal), 0.125, jnp.bfloat16)[0]
    np.testing.assert_array_equal(np.asarray(alone(scores)).view(np.uint16), np.asarray(kept).view(np.uint16))
    assert np.asarray(alone(scores), np.float32)[0, :, 1] == pytest.approx(1.0 / t, rel=2.0**-8)


@needs_kernel
def test_attention_takes_the_kernel_unless_xla(policy):
    """`attend` calls the kernel under `auto` and `native`, XLA's operations under `xla` or with a softcap,
    and the two agree on a causal pass (within the decoder-step bound of test_matmul)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 2, 40, 8)), jnp.float32) for _ in range(2))
    mask = jnp.tril(jnp.ones((40, 40), bool))[None].repeat(2, 0)
    run = lambda softcap=None: jax.jit(lambda q, k, v: attend(q, k, v, mask, causal_blocks=True, block=16,  # noqa: E731
                                                              softcap=softcap))
    outputs = {}
    for value in ("auto", "native", "xla"):
        policy(value)
        text = run().lower(q, k, v).as_text()
        assert ("dew_softmax_f32" in text) == (value != "xla"), value
        outputs[value] = np.asarray(run()(q, k, v))
    policy("native")
    assert "dew_softmax" not in run(softcap=30.0).lower(q, k, v).as_text()
    np.testing.assert_allclose(outputs["native"], outputs["xla"], rtol=0, atol=1e-5)


@needs_kernel
def test_vmapped_softmax_runs_row_by_row(policy):
    policy("native")
    scores, mask = scores_and_mask(16)
    stacked = jnp.stack([scores, scores * 0.5])
    ours = jax.vmap(lambda s: fast_softmax.masked_softmax(s, mask, 1.0, jnp.float32))(stacked)
    theirs = jax.vmap(lambda s: fast_softmax.reference(s, mask, 1.0, jnp.float32))(stacked)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=ulp_bound(LIBRARY_ULPS + 17))


def test_off_and_several_devices_keep_xla(policy, monkeypatch):
    policy("xla")
    assert fast_softmax.status() == (False, "the policy is xla, so every product is XLA's own")
    assert not fast_softmax.usable(jnp.float32)
    policy("native")
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    available, reason = fast_softmax.status()
    assert not available and "2 devices" in reason
    assert not fast_softmax.usable(jnp.float16)


@needs_kernel
def test_bad_shapes_are_refused(policy):
    policy("native")
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
    policy("native")
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
    policy("native")
    with pytest.raises(ValueError, match="float32 \\[N, C\\] with C >= 1"):
        fast_softmax.first_max(jnp.zeros((3, 0), jnp.float32))
    with pytest.raises(ValueError, match="float32"):
        fast_softmax.first_max(jnp.zeros((3, 4), jnp.bfloat16))


# The fused attention (`fast_softmax.attention`) against the same attention in float64. Bounds from
# the computation: a scaled score is within `scale * ulp_bound(D, |q| . |k|)` of exact (D float32
# roundings of the products' sum), which the softmax turns into a relative error in `p` of at most
# twice the row's largest score error, plus the kernel's own `LIBRARY_ULPS + T + 1` ulps (as above).
# The output, `sum_t p v`, adds T roundings of `p . |v|`. A gradient adds, to the relative error of
# each `p` it is made of (twice, for `ds = p (dp - sum p dp)`), the roundings of the sums along its
# chain (`dp = g . v`, Dv terms; the row's `sum p dp`, T; its own product, T or S G), each relative to
# the same chain taken over magnitudes. The largest observed differences (AMD EPYC Zen 4, AVX-512) are
# at most 2.5% of these bounds: 1.2e-6 of outputs of size ~1, and under 6.3e-7 relative to each gradient's
# largest entry.
def exact_attention(q, k, v, mask, g, scale, causal_blocks, block):
    """(out, dq, dk, dv, and each one's bound) in float64, as `attend` defines the math (masked scores
    at MASKED; with causal blocks a row scores the keys up to its block's last row only)."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    B, S, H, D = q.shape
    T, K = k.shape[1:3]
    group = H // K
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    mask = np.asarray(mask)[:, None]
    ends = np.minimum((np.arange(S) // block + 1) * block, S) if causal_blocks else np.full(S, T)
    scored = np.arange(T)[None, :] < ends[:, None]  # [S, T]: the keys each row's block scores
    x = np.where(mask, np.einsum("bshd,bthd->bhst", q, kk) * scale, fast_softmax.MASKED)
    x = np.where(scored, x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhst,bthd->bshd", p, vv)
    dp = np.einsum("bshd,bthd->bhst", g, vv)
    ds = np.where(mask, p * (dp - np.sum(dp * p, -1, keepdims=True)) * scale, 0.0)
    dq = np.einsum("bhst,bthd->bshd", ds, kk)
    dk = np.einsum("bhst,bshd->bthd", ds, q).reshape(B, T, K, group, D).sum(3)
    dv = np.einsum("bhst,bshd->bthd", p, g).reshape(B, T, K, group, v.shape[-1]).sum(3)
    # Magnitudes: the same chains over absolute values.
    x_err = scale * ulp_bound(D, np.einsum("bshd,bthd->bhst", np.abs(q), np.abs(kk)))
    p_rel = 2 * np.max(np.where(mask & scored, x_err, 0.0), -1, keepdims=True) + ulp_bound(LIBRARY_ULPS + T + 1)
    out_mag = np.einsum("bhst,bthd->bshd", p, np.abs(vv))
    out_bound = np.einsum("bhs,bshd->bshd", p_rel[..., 0], out_mag) + ulp_bound(T, out_mag)
    dp_mag = np.einsum("bshd,bthd->bhst", np.abs(g), np.abs(vv))
    ds_mag = np.where(mask, p * (dp_mag + np.sum(dp_mag * p, -1, keepdims=True)) * scale, 0.0)
    rel = 2 * p_rel.max() + ulp_bound(v.shape[-1] + T + 3 + max(T, S * group))
    bounds = [rel * np.einsum("bhst,bthd->bshd", ds_mag, np.abs(kk)),
              rel * np.einsum("bhst,bshd->bthd", ds_mag, np.abs(q)).reshape(B, T, K, group, D).sum(3),
              rel * np.einsum("bhst,bshd->bthd", p, np.abs(g)).reshape(B, T, K, group, v.shape[-1]).sum(3)]
    return (out, dq, dk, dv), (out_bound, *bounds)


ATTENTION_AVAILABLE, ATTENTION_WHY = fast_softmax._load_attention() if AVAILABLE else (False, WHY)
needs_attention = pytest.mark.skipif(not ATTENTION_AVAILABLE, reason=f"Dew's attention kernel is off: {ATTENTION_WHY}")


@needs_attention
@pytest.mark.parametrize("B, S, H, K, D, Dv, causal, padding", [
    (2, 256, 4, 4, 64, 64, True, 0),    # the benchmark's micro-batch: two whole blocks
    (2, 200, 4, 2, 32, 48, True, 30),   # a short last block, query heads sharing keys, narrower keys
    (1, 130, 2, 1, 16, 16, False, 0),   # bidirectional: every block scores every key
    (3, 40, 6, 3, 8, 8, True, 7),       # one block; padding rows that read only padding
])
def test_fused_attention_matches_exact_math(policy, B, S, H, K, D, Dv, causal, padding):
    policy("native")
    rng = np.random.default_rng(3)
    q, k, v, g = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                  for shape in ((B, S, H, D), (B, S, K, D), (B, S, K, Dv), (B, S, H, Dv)))
    segments = np.ones((B, S), np.int32)
    segments[:, S - padding:] = 0
    slots = np.broadcast_to(np.arange(S), (B, S))
    mask = (segments[:, :, None] == segments[:, None, :]) & ((slots[:, None, :] <= slots[:, :, None]) | (not causal))
    scale = 0.3
    run = lambda q, k, v: fast_softmax.attention(q, k, v, jnp.asarray(mask), scale, causal, 64)  # noqa: E731
    out, vjp = jax.vjp(jax.jit(run), q, k, v)
    ours = [out, *vjp(g)]
    exact, bounds = exact_attention(q, k, v, mask, g, scale, causal, 64)
    for name, mine, truth, bound in zip(("out", "dq", "dk", "dv"), ours, exact, bounds):
        np.testing.assert_array_less(np.abs(np.asarray(mine, np.float64) - truth), bound + 1e-30, err_msg=name)


@needs_attention
def test_the_decoder_takes_fused_attention_in_float32_without_a_cache(policy, monkeypatch):
    """The attention layer calls the fused kernel for a float32 pass without a cache (training's),
    and keeps `attend` (with its own softmax kernel) under a softcap, in bfloat16, or with `xla`."""
    from dew import models

    def targets(policy_value, dtype=jnp.float32, **config):
        policy(policy_value)
        model = models.build("causal_transformer", vocab_size=32, max_seq_len=16, num_layers=1, emb_features=16,
                             num_heads=2, num_kv_heads=1, mlp_features=32, dtype=dtype, **config)
        tokens = jnp.zeros((2, 16), jnp.int32)
        params = compiled(model.init, jax.random.key(0), tokens)
        return jax.jit(lambda p: jax.grad(lambda p: model.apply(p, tokens).astype(jnp.float32).sum())(p)).lower(
            params).as_text()

    assert "dew_softmax_attention_f32" in targets("auto") and "dew_softmax_attention_grad_f32" in targets("native")
    assert "dew_softmax_attention" not in targets("xla")
    assert "dew_softmax_attention" not in targets("native", dtype=jnp.bfloat16)


@needs_attention
def test_fused_attention_refuses_what_it_cannot_take(policy):
    policy("native")
    q = jnp.zeros((1, 8, 3, 4), jnp.float32)
    k = jnp.zeros((1, 8, 2, 4), jnp.float32)
    mask = jnp.ones((1, 8, 8), bool)
    with pytest.raises(ValueError, match=r"3 query heads over 2 key/value heads"):
        fast_softmax.attention(q, k, k, mask, 1.0, True, 4)
    with pytest.raises(ValueError, match=r"float32 q \[B, S, H, D\].*bfloat16"):
        fast_softmax.attention(q.astype(jnp.bfloat16), k, k, mask, 1.0, True, 4)
    with pytest.raises(ValueError, match=r"block is 0; it must be at least 1 query row"):
        fast_softmax.attention(q[:, :, :2], k, k, mask, 1.0, True, 0)
    with pytest.raises(ValueError, match=r"at least as many keys as queries"):
        fast_softmax.attention(jnp.zeros((1, 8, 2, 4)), k[:, :6], k[:, :6], mask[..., :6], 1.0, True, 4)


@needs_attention
def test_fused_attention_keeps_only_the_scored_blocks_for_its_backward(policy):
    """Its residual probabilities hold each block's scored keys only: 64 x 64 + 64 x 128 + 64 x 192 +
    8 x 200 of a causal pass's 200 x 200 (the last block is short), every key for a bidirectional one."""
    policy("native")
    q = jnp.zeros((1, 200, 2, 8), jnp.float32)
    k = jnp.zeros((1, 200, 1, 8), jnp.float32)
    mask = jnp.ones((1, 200, 200), bool)
    for causal, packed in ((True, 64 * 64 + 64 * 128 + 64 * 192 + 8 * 200), (False, 200 * 200)):
        out, probs = jax.eval_shape(lambda: fast_softmax._attention(q, k, k, mask, 1.0, causal, 64))
        assert out.shape == (1, 200, 2, 8) and probs.shape == (1, 2, packed)
