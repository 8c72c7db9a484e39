"""A prefill's attention in Dew's kernel (dew.kernels.prefill_attention) against `attend` (the path it replaces)
and against float64, on a fresh cache and at an offset (a cached generation through it keeps XLA's tokens:
tests/kernels/test_decode_attention.py, whose generations prefill through it).

Bound per output element, float32 (u = 2^-24, one unit of float32 rounding), as for the decode kernel
(tests/kernels/test_decode_attention.py): each side sums a score's D products in its own order, so the two
scores lie within 2 D u A apart (A = scale * sum_d |q_d k_d|, the row's largest); a score difference d moves a
probability by a factor within exp(2 d), each side's exponential is within 2 ulps, each normalizer sums n terms
(n u each, n the keys a row scores) and the weighted values sum n terms on each side (n u each, of
sum p |v| <= max |v|): (4 D A + 4 n + 16) u max |v| (the kernel's products are fused multiply-adds, one rounding
where `attend`'s may take two: within the same count; its normalizer's reciprocal multiplies where `attend`
divides, one rounding more, inside the 16). Both sides score, exponentiate and sum the same keys (those the mask
allows; a masked key's exponential is exactly 0 on both), so n is the capacity at most. bfloat16: both sides
round the probabilities to bfloat16 (each within 2^-8 of its own, so 2^-7 of sum p |v| apart) and the result
(2^-7 of |out| apart): 2^-6 max |v| more. Against float64, the same bound holds (one side's roundings only).
Largest differences observed (Intel Xeon, AVX-512; max |v| about 4): float32 4.8e-7 against `attend`
and 8.0e-7 against float64, where the smallest bound is 3.6e-4; bfloat16 6.1e-5 against `attend` and 7.6e-3
against float64 (the result's rounding to bfloat16), where the smallest bound is 5.2e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import prefill_attention as prefill_kernel
from dew.nn.attention import attend, attention_mask
from tests.tolerances import assert_within, ulp_bound

AVAILABLE, WHY = prefill_kernel.status("native")
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"Dew's prefill attention kernel is off here: {WHY}")

L, B, C, T, S = 2, 3, 4, 96, 40  # 40 queries: blocks of 16, 16 and 8; a cache of 4 rows, the first 3 read


@pytest.fixture
def policy(monkeypatch):
    def set_policy(value: str):
        monkeypatch.setenv("DEW_KERNELS", value)
    return set_policy


def operands(dtype, H, K, D, offset, seed=0):
    """Queries `[B, H, S, D]`, a cache `[L, C, K, T, D]` and the prefill's mask at `offset`: row 0 all real,
    row 1 real for its first 29 queries (the rest padding, reading the unfilled slots up to theirs), row 2
    padding throughout; the last query of row 0 in a segment no key holds (it reads nothing)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
    keys, values = (jnp.asarray(rng.standard_normal((L, C, K, T, D)), dtype) for _ in range(2))
    slots = jnp.broadcast_to(jnp.arange(offset, offset + S, dtype=jnp.int32), (B, S))
    real = jnp.asarray([S, 29, 0])
    segments = (jnp.arange(S)[None] < real[:, None]).astype(jnp.int32).at[0, S - 1].set(7)
    key_slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    filled = (key_slots < offset + real[:, None]).astype(jnp.int32)
    mask = attention_mask(slots, key_slots, segments, filled, causal=True, window=None)
    return q, keys, values, mask


def bound(q, keys_BKTD, values_BKTD, mask, scale, dtype):
    """Each query's bound (the module's docstring), `[B, S, H, 1]`."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (keys_BKTD, values_BKTD))
    H, K, D = q.shape[1], k.shape[1], q.shape[3]
    k_BHTD, v_BHTD = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    largest = scale * np.einsum("bhsd,bhtd->bhst", np.abs(q), np.abs(k_BHTD)).max(-1)  # [B, H, S]
    peak = np.abs(v_BHTD).max(axis=(2, 3))[:, :, None]
    limit = ulp_bound(4 * D * largest + 4 * k.shape[2] + 16, peak)
    if dtype == jnp.bfloat16:
        limit = limit + 2.0**-6 * peak
    return limit.transpose(0, 2, 1)[..., None]


def float64_attention(q, keys_BKTD, values_BKTD, mask, scale, dtype):
    """`attend`'s arithmetic in float64 (probabilities rounded to bfloat16 for a bfloat16 cache), `[B, S, H, D]`."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (keys_BKTD, values_BKTD))
    H, K = q.shape[1], k.shape[1]
    k_BHTD, v_BHTD = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    scores = np.where(np.asarray(mask)[:, None], scale * np.einsum("bhsd,bhtd->bhst", q, k_BHTD), -np.inf)
    with np.errstate(invalid="ignore"):  # a query reading nothing: NaN, left out of the comparison
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)
    if dtype == jnp.bfloat16:
        probs = np.asarray(jnp.asarray(probs, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    return np.einsum("bhst,bhtd->bshd", probs, v_BHTD)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((2, 2), 32)], ids=["gqa-9-3", "mha-2"])
def test_the_kernel_matches_attend_fresh_and_at_an_offset(policy, dtype, heads, D):
    """SmolLM2's 9 query heads over 3 key/value heads and 2 over 2; a fresh cache (`attend`'s causal blocks)
    and a prefill at slot 37 over 37 filled slots (`attend` scores the whole capacity); padding queries and
    a padding row (read as `attend` reads them); a query that may read nothing gets zeros; a traced layer
    of a cache with a row more than the queries'."""
    policy("native")
    H, K = heads
    scale = D**-0.5
    run = jax.jit(lambda q, k, v, layer, mask: prefill_kernel.prefill_attention(q, k, v, layer, mask, scale))
    for offset in (0, 37):
        q, keys, values, mask = operands(dtype, H, K, D, offset)
        ours = run(q, keys, values, jnp.int32(1), mask)
        assert ours.dtype == jnp.dtype(dtype) and ours.shape == (B, S, H, D)
        keys_BKTD, values_BKTD = keys[1, :B], values[1, :B]
        theirs = attend(q, keys_BKTD, values_BKTD, mask, causal_blocks=offset == 0, heads_major=True)
        limit = bound(q, keys_BKTD, values_BKTD, mask, scale, dtype)
        reads = np.asarray(mask.any(-1))  # [B, S]
        assert not reads[0, S - 1] and reads.sum() == B * S - 1
        what = f"{jnp.dtype(dtype).name} H {H} K {K} offset {offset}"
        assert_within(np.asarray(ours, np.float32)[reads], np.asarray(theirs, np.float32)[reads],
                      np.broadcast_to(limit, ours.shape)[reads], f"{what} against attend")
        exact = float64_attention(q, keys_BKTD, values_BKTD, mask, scale, dtype)
        assert_within(np.asarray(ours, np.float32)[reads], exact[reads], np.broadcast_to(limit, ours.shape)[reads],
                      f"{what} against float64")
        assert not np.asarray(ours[0, S - 1], np.float32).any(), "a query reading nothing gets zeros"


@needs_kernel
def test_bad_operands_are_refused(policy):
    policy("native")
    keys = jnp.zeros((1, 2, 2, 16, 16), jnp.float32)
    q, mask = jnp.zeros((2, 4, 3, 16)), jnp.ones((2, 3, 16), bool)
    with pytest.raises(ValueError, match=r"of its dtype .*got q float32 \(2, 4, 3, 16\), keys bfloat16"):
        prefill_kernel.prefill_attention(q, keys.astype(jnp.bfloat16), keys.astype(jnp.bfloat16), 0, mask, 1.0)
    with pytest.raises(ValueError, match=r"C >= B"):
        prefill_kernel.prefill_attention(jnp.zeros((3, 4, 3, 16)), keys, keys, 0, mask, 1.0)
    with pytest.raises(ValueError, match=r"multiples of 16"):
        prefill_kernel.prefill_attention(q[..., :8], keys[..., :8], keys[..., :8], 0, mask, 1.0)
    with pytest.raises(ValueError, match=r"the mask is \(2, 3, 15\); it must be \[B, S, T\] = \(2, 3, 16\)"):
        prefill_kernel.prefill_attention(q, keys, keys, 0, mask[..., :15], 1.0)


def test_off_under_xla_and_for_operands_it_cannot_take(policy):
    keys = jnp.zeros((1, 2, 2, 16, 16), jnp.float32)
    q = jnp.zeros((2, 4, 3, 16))
    policy("xla")
    assert not prefill_kernel.usable(q, keys, keys) and "policy is xla" in prefill_kernel.status()[1]
    policy("native")
    assert not prefill_kernel.usable(q[..., :8], keys[..., :8], keys[..., :8])
    assert not prefill_kernel.usable(q, keys.astype(jnp.bfloat16), keys.astype(jnp.bfloat16))
    assert not prefill_kernel.usable(q.astype(jnp.float16), keys.astype(jnp.float16), keys.astype(jnp.float16))
    assert prefill_kernel.usable(q.astype(jnp.bfloat16), keys.astype(jnp.uint16), keys.astype(jnp.uint16)) == AVAILABLE
    assert prefill_kernel.usable(q, keys, keys) == AVAILABLE


@needs_kernel
def test_a_cached_pass_is_differentiated_as_attend(policy):
    """The kernel has no backward: `dew.nn.attention` gives its call `attend`'s (block diffusion's encoder
    trains through a cached pass). The forward is the kernel's; the gradients are exactly those of `attend`
    over the layer's cache, as its vjp computes them."""
    from dew.nn.attention import _prefill_attention

    policy("native")
    q, keys, values, mask = operands(jnp.float32, 4, 2, 16, 37)
    weights = jnp.asarray(np.random.default_rng(1).standard_normal((B, S, 4, 16)), jnp.float32)
    loss = lambda attention: jax.jit(jax.grad(  # noqa: E731
        lambda q, k, v: jnp.sum(attention(q, k, v) * weights), argnums=(0, 1, 2)))(q, keys, values)
    ours = loss(lambda q, k, v: _prefill_attention(q, k, v, jnp.int32(1), mask, 0.25))
    theirs = loss(lambda q, k, v: attend(q, k[1, :B], v[1, :B], mask, scale=0.25, heads_major=True))
    for got, expected in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert "dew_prefill_attention_f32" in jax.jit(
        lambda q, k, v: _prefill_attention(q, k, v, jnp.int32(1), mask, 0.25)).lower(q, keys, values).as_text()
