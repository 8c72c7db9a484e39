"""Decoding's attention in Dew's kernel (dew.kernels.decode_attention) against XLA's form (`attend` under
the decode mask), and the decoder's cached steps through it against the same steps in XLA.

Bound per output element, float32 (u = 2^-24, one unit of float32 rounding): each side sums a logit's
D products in its own order, so the two logits lie within 2 D u A apart (A = scale * sum_d |q_d k_d|,
the row's largest); a logit difference d moves a probability by a factor within exp(2 d) (numerator
and normalizer), each side's exponential is within 2 ulps (4 u apart), each normalizer sums n terms
(n u each), the chunks' rescaling adds an exponential and a product (3 u); the weighted values sum n
terms on each side (n u each, of sum p |v| <= max |v|). Together (4 D A + 4 n + 16) u max |v|.
bfloat16 cache: XLA's form also rounds the probabilities to bfloat16 before weighing the values
(2^-9 of sum p |v|) and its result to bfloat16 (2^-9 of |out|): 2^-8 max |v| more.
The kernel's bodies (portable, AVX2, AVX-512) each sum a logit's products in their own order, which the
bound already allows. Largest differences observed (Intel Xeon, every body; max |v| 4.6-4.8): 3.3e-7 in
float32, where the smallest bound is 2.7e-4, and 1.6e-3 in bfloat16, where the smallest is 8.8e-3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import kernels, models
from dew.kernels import decode_attention as decode_kernel
from dew.kernels import prefill_attention as prefill_kernel
from dew.nn.attention import attend
from dew.sampling import Sampling, generate
from tests.compiled import compiled
from tests.tolerances import assert_within, ulp_bound

AVAILABLE, WHY = decode_kernel._load()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"Dew's decode attention kernel is off here: {WHY}")

L, B, T, D = 2, 5, 600, 64  # 600 slots: two whole chunks of 256 and a short one


@pytest.fixture
def policy(monkeypatch):
    def set_policy(value: str):
        monkeypatch.setenv("DEW_KERNELS", value)
    return set_policy


def xla_form(q_BHD, keys_LBKTD, values_LBKTD, layer, starts_B, ends_B, scale, softcap):
    slot_T = jnp.arange(keys_LBKTD.shape[3])
    mask_B1T = ((slot_T >= starts_B[:, None]) & (slot_T < ends_B[:, None]))[:, None]
    return attend(q_BHD[:, None].astype(keys_LBKTD.dtype), keys_LBKTD[layer], values_LBKTD[layer], mask_B1T,
                  scale=scale, softcap=softcap)[:, 0]


def bound(q_BHD, keys_BKTD, values_BKTD, starts_B, ends_B, scale, dtype):
    """Each row and head's bound (the module's docstring), `[B, H, 1]`."""
    q = np.asarray(q_BHD, np.float64)
    k, v = np.asarray(keys_BKTD.astype(jnp.float32), np.float64), np.asarray(values_BKTD.astype(jnp.float32))
    H, K = q.shape[1], k.shape[1]
    out = np.zeros((q.shape[0], H, 1))
    for b in range(q.shape[0]):
        lo, hi = int(starts_B[b]), int(ends_B[b])
        for h in range(H):
            kh = h // (H // K)
            largest = scale * np.abs(k[b, kh, lo:hi] * q[b, h]).sum(-1).max(initial=0.0)
            peak = np.abs(v[b, kh, lo:hi]).max(initial=0.0)
            out[b, h] = ulp_bound(4 * q.shape[2] * largest + 4 * (hi - lo) + 16, peak)
            if dtype == jnp.bfloat16:
                out[b, h] += 2.0**-8 * peak
    return out


def instruction_sets() -> list[str]:
    """Every body this CPU runs, from the portable one up to its best."""
    from dew import _native_decode_attention

    ladder = ["portable", "avx2", "avx512"]
    return ladder[: ladder.index(_native_decode_attention.isa()) + 1]


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,D", [((6, 2), 64), ((10, 2), 96)])
def test_the_kernel_matches_xla_at_ragged_lengths(policy, dtype, heads, D):
    """Rows reading 1 slot, an odd count across a chunk's edge, the whole capacity, a window's last
    slots, and nothing (zeros); 3 or 5 query heads a key/value head (AVX-512 takes them in groups of at
    most 4); head widths 64 and 96 (two and three blocks of 32); a traced layer; with and without a
    softcap (Gemma 2's); every instruction set's body."""
    from dew import _native_decode_attention

    policy("native")
    H, K = heads
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.standard_normal((L, B, K, T, D)), dtype)
    values = jnp.asarray(rng.standard_normal((L, B, K, T, D)), dtype)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.float32)
    if dtype == jnp.bfloat16:
        q = q.astype(jnp.bfloat16).astype(jnp.float32)  # the model's queries are bfloat16 there
    starts, ends = jnp.asarray([0, 0, 0, 471, 0], jnp.int32), jnp.asarray([1, 257, T, 599, 0], jnp.int32)
    scale = D**-0.5
    limit = bound(q, keys[1], values[1], starts, ends, scale, dtype)
    for softcap in (None, 5.0):
        run = jax.jit(lambda q, k, v, layer: decode_kernel.decode_attention(q, k, v, layer, starts, ends, scale,
                                                                            softcap))
        theirs = xla_form(q, keys, values, 1, starts, ends, scale, softcap)
        try:
            for isa in instruction_sets():
                _native_decode_attention.set_isa(isa)
                ours = run(q, keys, values, jnp.int32(1))
                assert ours.dtype == jnp.float32 and ours.shape == (B, H, D)
                assert_within(ours[:4], theirs[:4].astype(jnp.float32), limit[:4],
                              f"{isa} {jnp.dtype(dtype).name} softcap {softcap}")
                assert not np.asarray(ours[4]).any(), "a row reading nothing gets zeros"
        finally:
            _native_decode_attention.set_isa(instruction_sets()[-1])


@needs_kernel
def test_the_first_rows_of_a_larger_cache_are_read_in_place(policy):
    """Query row b reads cache row b of a cache with more rows (a server's step over its first rows, the
    rest left as they are): bit for bit what the cache cut to those rows gives, at both layers."""
    policy("native")
    rng = np.random.default_rng(1)
    keys, values = (jnp.asarray(rng.standard_normal((L, B, 2, 40, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((2, 4, D)), jnp.float32)
    starts, ends = jnp.asarray([0, 3], jnp.int32), jnp.asarray([17, 40], jnp.int32)
    for layer in range(L):
        whole = decode_kernel.decode_attention(q, keys, values, layer, starts, ends, 0.125)
        cut = decode_kernel.decode_attention(q, keys[:, :2], values[:, :2], layer, starts, ends, 0.125)
        np.testing.assert_array_equal(np.asarray(whole), np.asarray(cut))


@needs_kernel
def test_bad_operands_are_refused(policy):
    policy("native")
    keys = jnp.zeros((1, 2, 2, 16, 8), jnp.float32)
    q, ends = jnp.zeros((2, 4, 8)), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"one dtype .*got q \(2, 4, 8\), keys float32 .* values bfloat16"):
        decode_kernel.decode_attention(q, keys, keys.astype(jnp.bfloat16), 0, ends, ends, 1.0)
    with pytest.raises(ValueError, match=r"C >= B"):  # more query rows than the cache holds
        decode_kernel.decode_attention(jnp.zeros((3, 4, 8)), keys, keys, 0, ends[:1].repeat(3), ends[:1].repeat(3), 1.0)
    with pytest.raises(ValueError, match=r"multiples of 8"):
        decode_kernel.decode_attention(q[..., :4], keys[..., :4], keys[..., :4], 0, ends, ends, 1.0)
    with pytest.raises(ValueError, match=r"starts \(3,\) and ends \(2,\) must be \[B\] = \[2\]"):
        decode_kernel.decode_attention(q, keys, keys, 0, jnp.zeros((3,), jnp.int32), ends, 1.0)
    with pytest.raises(ValueError, match=r"softcap is -1.0; it must be above 0"):
        decode_kernel.decode_attention(q, keys, keys, 0, ends, ends, 1.0, softcap=-1.0)


def test_off_under_xla_and_for_widths_it_cannot_take(policy):
    keys = jnp.zeros((1, 2, 2, 16, 8), jnp.float32)
    policy("xla")
    assert not decode_kernel.usable(keys, keys) and "policy is xla" in decode_kernel.status()[1]
    policy("native")
    assert not decode_kernel.usable(keys[..., :4], keys[..., :4])
    assert not decode_kernel.usable(keys.astype(jnp.float16), keys.astype(jnp.float16))
    assert decode_kernel.usable(keys, keys) == AVAILABLE


def decoded(kernel_policy: str, dtype, prompts, **config):
    """(greedy tokens, the choices a trace made) of a small model's cached generation under `kernel_policy`."""
    model = models.build("causal_transformer", vocab_size=96, emb_features=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=96, max_seq_len=64, dtype=dtype, kernels=kernel_policy,
                         **config)
    params = compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
    with kernels.recording() as choices:
        out = generate(model, params, prompts, 12, key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    return out.tokens, choices


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_decoding_through_the_kernel_keeps_xla_tokens(dtype):
    """Rows of prompts 1, 5 and 19 tokens long decode 12 tokens each, with a sliding window of 6 on
    the second layer: the cached steps read the kernel under `auto` (and the prefill Dew's prefill attention
    kernel, where this CPU runs it), and the greedy tokens are XLA's."""
    prompts = [[3], [5, 9, 11, 2, 7], list(range(1, 20))]
    config = dict(layer_types=("full_attention", "sliding_attention"), sliding_window=6)
    ours, chose = decoded("auto", dtype, prompts, **config)
    theirs, chose_xla = decoded("xla", dtype, prompts, **config)
    assert chose[f"decode_attention/{jnp.dtype(dtype).name}"] == "dew"
    assert chose_xla[f"decode_attention/{jnp.dtype(dtype).name}"] == "xla"
    prefill, name = "dew" if prefill_kernel.status("auto")[0] else "xla", f"prefill_attention/{jnp.dtype(dtype).name}"
    assert (chose[name], chose_xla[name]) == (prefill, "xla")
    np.testing.assert_array_equal(ours, theirs)
