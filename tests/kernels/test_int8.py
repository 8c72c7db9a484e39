"""Dew's int8 kernel (dew.kernels.int8, native/int8.cc) against the XLA form of the same product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels.int8 import (KERNEL_MAX_ROWS, dequantize, group_size, int8_product, kernel_product, kernel_status,
                              kernel_takes, xla_product)
from dew.sampling import Sampling, generate
from tests.interop.test_quantize import SHAPE, built
from tests.tolerances import decoder_ulps, ulp_bound

ON, WHY = kernel_status()
pytestmark = pytest.mark.skipif(not ON, reason=f"the int8 kernel is off: {WHY}")


def instruction_sets() -> list[str]:
    """Every loop set this CPU runs, from the portable one up to its best."""
    from dew import _native_int8

    ladder = ["portable", "avx2", "avx512"]
    return ladder[: ladder.index(_native_int8.isa()) + 1]


def operands(rng, N: int, D: int, F: int, transposed: bool, G: int = 1):
    """x `[N, D]`, q int8 and its scales (`[D, F]` and `[G, F]`, or `[F, D]` and `[F, G]`)."""
    x = rng.standard_normal((N, D), np.float32)
    q = rng.integers(-127, 128, (F, D) if transposed else (D, F), dtype=np.int8)
    scale = (rng.random((F, G) if transposed else (G, F), np.float32) + 0.5) / 127
    return x, q, scale


def reorder_bound(x, q, scale, transposed: bool):
    """How far two float32 evaluations of `x @ (q * scale)` may lie apart: each side rounds every term at
    most twice (the weight times its scale, or a group's sum times its scale; and the product with x),
    and its sum of D terms D - 1 times, each by half an ulp of the sum of the terms' magnitudes (an FMA
    rounds less), so the two differ by at most D + 1 ulps of it."""
    w = np.abs(np.asarray(dequantize(q, scale, axis=-1 if transposed else -2), np.float64))
    magnitude = np.abs(x).astype(np.float64) @ (w.T if transposed else w)
    return ulp_bound(x.shape[1] + 1, magnitude)


# Shapes that reach every path: 256-, 128- and 64-column tiles and the column tail (F = 321 = 256 + 64
# + 1), 1 to 8 rows of x (the 4- and 2-row tiles and each remainder), D off the 16-term steps and below
# one; groups of 64 (SmolLM2's), one group, and groups off the vector steps with a shorter last one
# (577 in 10 groups of 58, the last 55; 129 in 3 of 43).
@pytest.mark.parametrize("N,D,F,G", [(1, 577, 321, 10), (8, 129, 200, 3), (3, 64, 1024, 1), (2, 192, 96, 3),
                                     (5, 7, 37, 1)])
@pytest.mark.parametrize("transposed", [False, True], ids=["DF", "FD"])
def test_the_kernel_is_the_xla_product_in_another_order(N, D, F, G, transposed):
    from dew import _native_int8

    assert group_size(D, group_size(D, G)) == G
    x, q, scale = operands(np.random.default_rng(N * D + F), N, D, F, transposed, G)
    reference = np.asarray(xla_product(x, q, scale, jnp.float32, transposed))
    run = jax.jit(lambda x, q, s: kernel_product(x, q, s, transposed))
    bound = reorder_bound(x, q, scale, transposed)
    try:
        for isa in instruction_sets():
            _native_int8.set_isa(isa)
            ours = np.asarray(run(x, q, scale))
            # Observed: at most 6e-7 relative to the largest output, a few ulps.
            assert np.all(np.abs(ours - reference) <= bound), f"{isa}: {np.abs(ours - reference).max()}"
    finally:
        _native_int8.set_isa(instruction_sets()[-1])


def test_bfloat16_compute_and_vmap_match_the_xla_form():
    rng = np.random.default_rng(0)
    x, q, scale = operands(rng, 2, 96, 80, transposed=False, G=2)
    # bfloat16: x rounds to the compute dtype first on both sides; int8 values are exact in bfloat16.
    ours = np.asarray(jax.jit(lambda x: int8_product(x, q, scale, jnp.bfloat16))(x))
    x_rounded = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    reference = np.asarray(xla_product(x, q, scale, jnp.bfloat16))
    assert np.all(np.abs(ours - reference) <= reorder_bound(x_rounded, q, scale, False))
    # vmap over x alone (shared weights), and over x, q and scales together.
    xs = rng.standard_normal((3, 2, 96), np.float32)
    qs = rng.integers(-127, 128, (3, 96, 80), dtype=np.int8)
    scales = rng.random((3, 2, 80), np.float32)
    shared = np.asarray(jax.jit(jax.vmap(lambda x: kernel_product(x, q, scale)))(xs))
    each = np.asarray(jax.jit(jax.vmap(kernel_product))(xs, qs, scales))
    for b in range(3):
        reference = np.asarray(xla_product(xs[b], q, scale, jnp.float32))
        assert np.all(np.abs(shared[b] - reference) <= reorder_bound(xs[b], q, scale, False))
        reference = np.asarray(xla_product(xs[b], qs[b], scales[b], jnp.float32))
        assert np.all(np.abs(each[b] - reference) <= reorder_bound(xs[b], qs[b], scales[b], False))


def test_the_policy_turns_the_kernel_off_and_bad_operands_are_refused(monkeypatch):
    x, q, scale = operands(np.random.default_rng(1), 1, 16, 16, transposed=False)
    with pytest.raises(ValueError, match=r"scales of shape \(16,\) do not fit an int8 weight of shape \(16, 16\)"):
        kernel_product(x, q, scale[0])
    # Past KERNEL_MAX_ROWS rows (a prefill) the product is XLA's.
    assert kernel_takes(np.zeros((KERNEL_MAX_ROWS, 16), np.float32), q, jnp.float32)
    assert not kernel_takes(np.zeros((KERNEL_MAX_ROWS + 1, 16), np.float32), q, jnp.float32)
    with pytest.raises(ValueError, match="cast them first"):
        kernel_product(x.astype(np.float16), q, scale)
    monkeypatch.setenv("DEW_KERNELS", "xla")
    assert kernel_status() == (False, "the policy is xla, so every product is XLA's own")
    with pytest.raises(RuntimeError, match="the int8 kernel is off: the policy is xla"):
        kernel_product(x, q, scale)
    monkeypatch.setenv("DEW_KERNELS", "fast")
    with pytest.raises(ValueError, match="DEW_KERNELS='fast' is not a kernel policy: use one of auto, native, xla"):
        kernel_status()
    monkeypatch.delenv("DEW_KERNELS")
    monkeypatch.setenv("DEW_INT8_KERNEL", "off")  # the old switch is refused, not ignored
    with pytest.raises(ValueError, match="DEW_INT8_KERNEL is no longer read: set DEW_KERNELS"):
        kernel_status()


@pytest.mark.parametrize("tie_embeddings", [True, False], ids=["tied", "untied"])
def test_an_int8_model_generates_the_same_tokens_with_and_without_the_kernel(tie_embeddings, monkeypatch):
    model, _, quantized = built(tie_embeddings)
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, SHAPE["vocab_size"])
    greedy = Sampling(temperature=0.0)
    ours = model.apply(quantized, tokens)
    with_kernel = generate(model, quantized, tokens.tolist(), 8, key=jax.random.key(0), sampling=greedy)
    monkeypatch.setenv("DEW_KERNELS", "xla")
    # Traced anew (a compiled generation keeps the form it was traced with): another budget, 9 tokens.
    reference = model.apply(quantized, tokens)
    without = generate(model, quantized, tokens.tolist(), 9, key=jax.random.key(0), sampling=greedy)
    # One decoder rounded in two orders. Observed: about 1e-7 on logits of 0.5.
    ulps = decoder_ulps(layers=9, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=10, libraries=1)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=ulp_bound(ulps, np.abs(reference).max()))
    np.testing.assert_array_equal(with_kernel.tokens, without.tokens[:, :-1])
