"""GGUF's quantized blocks (dew.kernels.blocks, native/blocks.cc): the dequantization against gguf's own,
Dew's kernel against dequantize-then-matmul in float32 (the exact path) and against the same with x
rounded to two layers of 8-bit integers a block (the integer path), for every kind, loop set and path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import policy
from dew.kernels.blocks import (BYTES, KINDS, ROUNDED_KINDS, blocks_product, dequantize, kernel_product, kernel_status,
                                kind, rounds, xla_product)
from tests.tolerances import assert_within, ulp_bound

gguf = pytest.importorskip("gguf")
ON, WHY = kernel_status()
_dequantize = jax.jit(dequantize)


def instruction_sets() -> list[str]:
    """Every loop set this CPU runs, from the portable one up to its best."""
    from dew import _native_blocks

    ladder = ["portable", "avx2", "avx512"]
    return ladder[: ladder.index(_native_blocks.isa()) + 1]


def each_instruction_set():
    """Run the loop body under every loop set this CPU runs, yielding the integer path's loops' name."""
    from dew import _native_blocks

    try:
        for isa in instruction_sets():
            _native_blocks.set_isa(isa)
            yield _native_blocks.rounded_isa()
    finally:
        _native_blocks.set_isa(instruction_sets()[-1])


def values_per_block(name: str) -> int:
    return KINDS[BYTES[name]][1]


def random_blocks(rng, name: str, F: int, K: int) -> np.ndarray:
    """A blocks weight `[F, K / E, B]` of random bytes with finite float16 scales, a tenth of them
    subnormal (files hold those: small `dmin`s), so every path meets one."""
    E, B = values_per_block(name), BYTES[name]
    w = rng.integers(0, 256, (F, K // E, B), dtype=np.uint8)
    halves = rng.standard_normal((F, K // E, 2)) * 0.02
    halves[rng.random(halves.shape) < 0.1] *= 1e-3  # below float16's least normal, 6.1e-5
    count = 2 if name in ("Q4_1", "Q4_K") else 1
    w[..., :2 * count] = halves[..., :count].astype(np.float16).view(np.uint8).reshape(F, K // E, 2 * count)
    return w


def offsets(w: np.ndarray, name: str) -> np.ndarray:
    """Each value's offset part (Q4_1's m, Q4_K's -dmin m; Q4_0's and Q8_0's are 0) as float32 `[F, K]`:
    the blocks with every q set to its zero point, dequantized."""
    zeroed = w.copy()
    start = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2, "Q4_K": 16}[name]
    zeroed[..., start:] = 0x88 if name == "Q4_0" else 0
    return np.asarray(_dequantize(jnp.asarray(zeroed)))


def theirs(w: np.ndarray, name: str) -> np.ndarray:
    """gguf's dequantization of a blocks weight, float32 `[F, K]`."""
    rows = gguf.quants.dequantize(w.reshape(w.shape[0], -1), getattr(gguf.GGMLQuantizationType, name))
    return np.asarray(rows, np.float32)


@pytest.mark.parametrize("name", list(BYTES))
def test_dequantize_is_ggufs(name):
    rng = np.random.default_rng(1)
    w = random_blocks(rng, name, 7, 2 * values_per_block(name))
    ours = np.asarray(_dequantize(jnp.asarray(w)))
    np.testing.assert_array_equal(ours, theirs(w, name))  # the same roundings, so the same bits


def reorder_bound(x, w, name):
    """How far the kernel may lie from dequantize-then-matmul in float32. The reference rounds each
    weight at most twice (`d * q`, then `+ m`), each product once and its sum of K terms K - 1 times; the
    kernel rounds each sub-block's sum of 32 products (31), its product with the scale (1), the sum over
    sub-blocks, each sub-block's sum of x and its product with the offset, and their sum: at most K + 2
    roundings either side, each within half an ulp of the sum of the terms' magnitudes, where a term's
    magnitude is |x| (|d q| + |m|) <= |x| (|w| + 2 |m|). So the two differ by at most K + 4 ulps of it."""
    magnitude = np.abs(x).astype(np.float64) @ (np.abs(theirs(w, name)) + 2 * np.abs(offsets(w, name))).T
    return ulp_bound(x.shape[1] + 4, magnitude)


# 1 to 5 rows of x (the kernel's 3-row tile and each remainder, and one row alone), rows of w in tiles
# of 4 and a tail (F = 4 n + 1, 2, 3), K of 1 to 3 blocks.
SHAPES = [(1, 37, 3), (2, 10, 1), (5, 7, 2), (4, 4, 1)]


@pytest.mark.skipif(not ON, reason=f"the blocks kernel is off: {WHY}")
@pytest.mark.parametrize("name", list(BYTES))
def test_kernel_is_dequantize_then_matmul(name):
    from dew import _native_blocks

    rng = np.random.default_rng(2)
    worst = 0.0
    product = jax.jit(kernel_product)
    try:
        for isa in instruction_sets():
            _native_blocks.set_isa(isa)
            for N, F, blocks in SHAPES:
                K = blocks * values_per_block(name)
                w = random_blocks(rng, name, F, K)
                x = rng.standard_normal((N, K), np.float32)
                ours = np.asarray(product(jnp.asarray(x), jnp.asarray(w)))
                reference = x @ theirs(w, name).T  # numpy's float32 product
                bound = reorder_bound(x, w, name)
                assert_within(ours, reference, bound, f"{name} {isa} N={N} F={F} K={K}")
                worst = max(worst, float(np.max(np.abs(ours - reference) / bound)))
    finally:
        _native_blocks.set_isa(instruction_sets()[-1])
    # Observed: at most 2.8% of the bound (Q4_0; Q4_1 1.2%, Q8_0 1.6%, Q4_K 0.08%).
    assert worst < 1.0


@pytest.mark.skipif(not ON, reason=f"the blocks kernel is off: {WHY}")
def test_blocks_product_takes_the_kernel_for_few_rows_and_xla_for_many():
    rng = np.random.default_rng(3)
    w = jnp.asarray(random_blocks(rng, "Q4_1", 8, 64))
    for N in (2, 40):  # under and over KERNEL_MAX_ROWS
        x = rng.standard_normal((N, 64), np.float32)
        with policy.using("exact"):  # unjitted: a jit's cache would not see the policy change
            ours = np.asarray(blocks_product(jnp.asarray(x), w, jnp.float32))
        reference = np.asarray(xla_product(jnp.asarray(x), w, jnp.float32))
        assert_within(ours, reference, reorder_bound(x, np.asarray(w), "Q4_1"), f"N={N}")


def test_a_block_of_another_size_is_refused():
    with pytest.raises(ValueError, match=r"blocks of Q4_0 \(18 bytes\).*got uint8 \(4, 2, 22\)"):
        kind(jnp.zeros((4, 2, 22), jnp.uint8))


# ---- the integer path: x rounded to two layers of 8-bit integers in blocks of 32 ----


def rounded(x: np.ndarray):
    """(d, q1, d2, q2) of x float32 `[N, K]` rounded as the integer path rounds it, a block of 32 at a
    time (d and d2 float32 `[N, K / 32, 1]`, q1 and q2 integers `[N, K / 32, 32]`): d = max |x| / 127,
    s = x * (1 / d), q1 = s rounded to the nearest integer (ties to even), q2 = (s - q1) * 254 rounded,
    d2 = d / 254, all in float32; x is taken as d q1 + d2 q2."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    s = blocks * inverse
    q1 = np.rint(s)
    return d, q1, d / np.float32(254), np.rint((s - q1) * np.float32(254))


def rounded_x(x: np.ndarray) -> np.ndarray:
    """The rounded x, d q1 + d2 q2, as float64 (exact but for float64's last bit)."""
    d, q1, d2, q2 = rounded(x)
    return (d.astype(np.float64) * q1 + d2.astype(np.float64) * q2).reshape(x.shape)


def identity_blocks(name: str, K: int) -> np.ndarray:
    """A blocks weight `[K, K / E, B]` whose row i is 1 at input i and 0 elsewhere, with d = 1 (and Q4_1's
    m = 0; Q4_K's sub-scales 1 and mins 0), so the product's output i is x's rounded value i as the kernel
    sums it (`kernel_rounded_x`)."""
    B, E, zero = BYTES[name], values_per_block(name), {"Q4_0": 8, "Q4_1": 0, "Q8_0": 0, "Q4_K": 0}[name]
    values = np.full((K, K), zero, np.int64) + np.eye(K, dtype=np.int64)
    w = np.zeros((K, K // E, B), np.uint8)
    w[..., 0:2] = np.array([1], np.float16).view(np.uint8)
    if name == "Q4_K":  # dmin 0; 6-bit sub-scales 1 (bytes 4-7 and the low nibbles of 12-15), mins 0
        w[..., 4:8] = 1
        w[..., 12:16] = 1
        chunks = values.reshape(K, K // E, 4, 2, 32)  # 32 bytes: sub-block 2i low, 2i + 1 high
        w[..., 16:] = (chunks[..., 0, :] | chunks[..., 1, :] << 4).reshape(K, K // E, 128).astype(np.uint8)
    elif name == "Q8_0":
        w[..., 2:] = values.reshape(K, K // 32, 32).astype(np.int8).view(np.uint8)
    else:  # nibbles: values 0-15 low, 16-31 high; Q4_1's m (bytes 2-3) stays 0
        blocks = values.reshape(K, K // 32, 32)
        w[..., B - 16:] = (blocks[..., :16] | blocks[..., 16:] << 4).astype(np.uint8)
    return w


def kernel_rounded_x(x: np.ndarray, loops: str) -> np.ndarray:
    """x's rounded values as float32 `[N, K]` as the integer loops `loops` (`rounded_isa()`) scale them.
    The AVX-512 VNNI loops (the layered scheme) take d q1 rounded to float32, then d2 q2 added with one
    rounding (a multiply-add). The AVX2 and portable loops (the combined scheme) take the integer
    x16 = 254 q1 + q2 times d2 with one rounding: the same integers, but the first layer's step is 254 d2,
    which differs from d by d2's own rounding (at most 2^-24 of d), so the value can differ from the
    layered one's by that much of |d q1| beside each scheme's last rounding."""
    d, q1, d2, q2 = rounded(x)
    if loops == "avx512_vnni":
        first = (d * q1).astype(np.float64)  # float32's product, exact in float64, as is the sum below
        return (first + d2.astype(np.float64) * q2).astype(np.float32).reshape(x.shape)
    # |x16| <= 32385 and d2 has 24 bits: their product is exact in float64, rounded once to float32.
    return (d2.astype(np.float64) * (254 * q1 + q2)).astype(np.float32).reshape(x.shape)


@pytest.mark.skipif(not ON, reason=f"the blocks kernel is off: {WHY}")
@pytest.mark.parametrize("name", ROUNDED_KINDS)
def test_integer_path_rounds_x_as_the_reference_does(name):
    # One row of blocks with ties (d = 1: 2.5 and -3.5 go to the even 2 and -4), a zero block (d = 0) and
    # random ones, through weights that pass x's rounded values out unchanged: exactly equal.
    rng = np.random.default_rng(4)
    K = 2 * values_per_block(name) if name == "Q4_K" else 160
    x = rng.standard_normal((2, K)).astype(np.float32)
    x[0, :8] = [127, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127]
    x[0, 32:64] = 0
    x[1, 64:96] *= 1e3
    d, q1, d2, q2 = rounded(x)
    assert q1[0, 0, :8].tolist() == [127, 2, -4, 0, -0, 2, 126, -127]
    assert q2[0, 0, :8].tolist() == [0, 127, 127, 127, -127, -127, 127, 0]  # the ties' halves, in the second layer
    w = jnp.asarray(identity_blocks(name, K))
    product = jax.jit(kernel_product, static_argnums=2)
    for loops in each_instruction_set():
        expected = kernel_rounded_x(x, loops)
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x), w, True)), expected, err_msg=loops)
        x_nan = x.copy()
        x_nan[1, 40] = np.nan  # a NaN reaches every output of its row, not a silent number
        y = np.asarray(product(jnp.asarray(x_nan), w, True))
        assert np.isnan(y[1]).all() and not np.isnan(y[0]).any(), loops


# Beside SHAPES (every group partial): K of 6 and 9 blocks, whole groups of 4 (and of 2) and a tail.
ROUNDED_SHAPES = [*SHAPES, (1, 9, 6), (3, 5, 9)]


@pytest.mark.skipif(not ON, reason=f"the blocks kernel is off: {WHY}")
@pytest.mark.parametrize("name", ROUNDED_KINDS)
def test_integer_path_is_rounded_x_times_the_dequantized_weight(name):
    rng = np.random.default_rng(5)
    worst = 0.0
    product = jax.jit(kernel_product, static_argnums=2)
    cases = []
    for N, F, blocks in ROUNDED_SHAPES:
        K = blocks * values_per_block(name)
        cases.append((random_blocks(rng, name, F, K), rng.standard_normal((N, K), np.float32)))
    combined = None  # the combined scheme's outputs: the AVX2 and portable loops give the same bits
    for loops in each_instruction_set():
        outputs = []
        for w, x in cases:
            (N, K), F = x.shape, w.shape[0]
            ours = np.asarray(product(jnp.asarray(x), jnp.asarray(w), True))
            outputs.append(ours)
            x_hat = rounded_x(x)
            reference = x_hat @ theirs(w, name).astype(np.float64).T  # exact but for float64's roundings
            # The integers' sums are exact, so the kernel's float32 roundings are fewer than the exact path's
            # (each sub-block's d_w d, its multiply-add, Q4_1's d sum q and its multiply-add, the sums over
            # sub-blocks): `reorder_bound` of the rounded x bounds them.
            bound = reorder_bound(x_hat, w, name)
            assert_within(ours, reference, bound, f"{name} {loops} N={N} F={F} K={K}")
            worst = max(worst, float(np.max(np.abs(ours - reference) / bound)))
        if loops != "avx512_vnni":
            if combined is not None:
                for ours, theirs_ in zip(outputs, combined):
                    np.testing.assert_array_equal(ours, theirs_, err_msg=f"{name} {loops}")
            combined = outputs
    # Observed on an AVX2 EPYC (the combined scheme, AVX2 and portable loops): at most 2.0% of the bound
    # (Q8_0; Q4_0 1.1%, Q4_1 0.7%, Q4_K 0.04%); the layered scheme (AVX-512 VNNI) had at most 1.7%.
    assert worst < 1.0


@pytest.mark.skipif(not ON, reason=f"the blocks kernel is off: {WHY}")
def test_the_policy_chooses_the_path():
    rng = np.random.default_rng(6)
    for name in ("Q4_1", "Q4_K"):
        K = 2 * values_per_block(name) if name == "Q4_K" else 64
        w = random_blocks(rng, name, 8, K)
        x = rng.standard_normal((2, K), np.float32)
        for chosen in ("auto", "exact"):
            with policy.using(chosen), policy.recording() as choices:  # unjitted: see the test above
                ours = np.asarray(blocks_product(jnp.asarray(x), jnp.asarray(w), jnp.float32))
            takes_q8 = chosen == "auto"
            assert rounds(jnp.asarray(w), chosen) == takes_q8
            assert list(choices) == [f"{'blocks-q8' if takes_q8 else 'blocks'}/{name}/2x{K}x8"]
            x_used = rounded_x(x) if takes_q8 else x
            reference = x_used @ theirs(w, name).astype(np.float64).T
            assert_within(ours, reference, reorder_bound(x_used, w, name), f"{name} {chosen}")
    assert "round x to two 8-bit layers" in kernel_status("auto")[1]
    assert "x in float32 (the exact path: the policy is exact)" in kernel_status("exact")[1]
