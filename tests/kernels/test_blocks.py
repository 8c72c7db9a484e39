"""GGUF's quantized blocks (dew.kernels.blocks, native/blocks.cc): the dequantization against gguf's own,
and Dew's kernel against dequantize-then-matmul in float32, for every kind, loop set and path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels.blocks import (BYTES, KINDS, blocks_product, dequantize, kernel_product, kernel_status, kind,
                                xla_product)
from tests.tolerances import assert_within, ulp_bound

gguf = pytest.importorskip("gguf")
ON, WHY = kernel_status()
_dequantize = jax.jit(dequantize)


def instruction_sets() -> list[str]:
    """Every loop set this CPU runs, from the portable one up to its best."""
    from dew import _native_blocks

    ladder = ["portable", "avx2", "avx512"]
    return ladder[: ladder.index(_native_blocks.isa()) + 1]


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
        ours = np.asarray(jax.jit(blocks_product, static_argnums=2)(jnp.asarray(x), w, jnp.float32))
        reference = np.asarray(xla_product(jnp.asarray(x), w, jnp.float32))
        assert_within(ours, reference, reorder_bound(x, np.asarray(w), "Q4_1"), f"N={N}")


def test_a_block_of_another_size_is_refused():
    with pytest.raises(ValueError, match=r"blocks of Q4_0 \(18 bytes\).*got uint8 \(4, 2, 22\)"):
        kind(jnp.zeros((4, 2, 22), jnp.uint8))
