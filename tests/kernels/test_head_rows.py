"""Dew's head kernel (`dew.kernels.head_rows`, native/head_rows.cc): the logits of a few rows against the
output head in both layouts, float32 and bfloat16, every instruction set against a float64 reference, and
the head's logits through it against the product it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import head_rows, policy
from dew.nn.head import Head, vocab_logits
from tests.tolerances import assert_within, ulp_bound

ON, WHY = head_rows.status("auto")
pytestmark = pytest.mark.skipif(not ON, reason=f"the head kernel is off: {WHY}")

_LADDER = ["portable", "avx2", "avx512", "avx512_bf16", "amx"]


def _native():
    from dew import _native_head_rows

    return _native_head_rows


def _operands(M, E, V, dtype, transposed, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, E), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((V, E) if transposed else (E, V), np.float32), dtype)
    return x, w


def _exact(x, w, transposed):
    """float64 logits and the sums of their terms' magnitudes."""
    x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    head = w64.T if transposed else w64
    return x64 @ head, np.abs(x64) @ np.abs(head)


# Shapes that reach every path: hidden rows in groups of 4, 2 and 1 (M = 7) and eight groups of 4 (32); E
# with a masked last step (70: 64 + 6, both dtypes) and an odd one (33: half a bfloat16 pair); vocabularies
# that end inside a tile of 16 rows (37, 131, 40), and [E, V] columns in 64-wide tiles, 16-wide ones and a
# masked remainder (131); AMX's two tiles of hidden rows (17 = 16 + 1) and its last vocabulary rows in the
# FMA body (40 = 2 x 16 + 8).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("transposed", [True, False], ids=["VE", "EV"])
@pytest.mark.parametrize("M,E,V", [(7, 70, 131), (32, 33, 37), (17, 64, 40)])
def test_every_body_is_the_exact_product_to_within_its_roundings(dtype, transposed, M, E, V):
    native = _native()
    x, w = _operands(M, E, V, dtype, transposed, seed=M + E + V)
    exact, magnitude = _exact(x, w, transposed)
    # E products, each exact (bfloat16) or rounded once into its FMA (float32), summed in E - 1 more
    # roundings, each at most half an ulp of the sum of the terms' magnitudes. Observed: at most 1.2e-5
    # from float64 here, 4% of the bound.
    bound = ulp_bound(E, magnitude)
    run = jax.jit(head_rows.head_logits, static_argnums=2)
    default, results = native.isa(), {}
    try:
        for isa in _cpu_sets():
            native.set_isa(isa)
            results[isa] = np.asarray(run(x, w, transposed))
            assert_within(results[isa], exact, bound, f"{isa} logits")
    finally:
        native.set_isa(default)
    # One order of sums (the header's), the same in every body but AMX's (its tiles' own order, which it
    # takes for bfloat16 [V, E] heads of whole steps of 32): the same bits (no subnormals here, which
    # vdpbf16ps alone flushes).
    amx = dtype == jnp.bfloat16 and transposed and E % head_rows.AMX_STEP == 0
    for isa, result in results.items():
        if not (isa == "amx" and amx):
            np.testing.assert_array_equal(result, results["portable"], err_msg=isa)


def _cpu_sets() -> list[str]:
    """The sets this CPU runs: set_isa refuses the ones beyond it."""
    native, default, found = _native(), _native().isa(), []
    try:
        for isa in _LADDER:
            try:
                native.set_isa(isa)
                found.append(isa)
            except ValueError:
                break
    finally:
        native.set_isa(default)
    return found


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_the_head_runs_its_few_rows_in_the_kernel_with_the_old_products_numbers(dtype):
    # A tied head as a bfloat16 or float32 model holds it, [V, E], and an untied one, [E, V]: its logits
    # under the auto policy (the kernel) against the xla policy (XLA's dot: what a float32 head ran before;
    # a bfloat16 one ran oneDNN's gemm, which sums in its own order too).
    for transposed in (True, False):
        hidden, weight = _operands(5, 64, 300, dtype, transposed, seed=1)
        # Tied heads: float32 where the kernel's loops are AVX-512's, and bfloat16 where AMX's tiles take it;
        # else XLA's dot or oneDNN's gemm as before.
        kernel = transposed and (head_rows.wide_takes() if dtype == jnp.float32
                                 else head_rows.amx_takes(weight, transposed))
        logits = {}
        for kernels in ("auto", "xla"):
            with policy.recording() as choices:
                logits[kernels] = np.asarray(jax.jit(Head(weight, transposed, softcap=30.0, kernels=kernels).logits)(hidden))
            taken = "dew" if kernels == "auto" and kernel else "xla"
            assert choices[f"head_rows/5x64x300/{jnp.dtype(dtype).name}"] == taken
        # Each side within E / 2 roundings of the exact logits (the softcap's tanh shrinks differences).
        # Observed: at most 1.9e-6 apart.
        _, magnitude = _exact(hidden, weight, transposed)
        assert_within(logits["auto"], logits["xla"], ulp_bound(64, magnitude) + ulp_bound(4, 30.0), "auto vs xla")


def test_the_rows_it_takes_and_its_gradient():
    x32, w32 = _operands(33, 32, 40, jnp.float32, True)
    # A float32 head only where the kernel's loops are AVX-512's: with AVX2's, XLA's dot is the faster.
    assert head_rows.takes(x32[:32], w32, True, "native") == head_rows.takes(x32[:32], w32, True, "exact") \
        == head_rows.wide_takes()
    from dew import _native_head_rows as native

    best = native.isa()
    try:
        for isa in ("portable", "avx2"):
            native.set_isa(isa)
            assert not head_rows.wide_takes() and not head_rows.takes(x32[:8], w32, True, "auto")
    finally:
        native.set_isa(best)
    assert head_rows.wide_takes() == (best in ("avx512", "avx512_bf16", "amx"))
    assert not head_rows.takes(x32, w32, True, "auto")  # past MAX_ROWS
    assert not head_rows.takes(x32[:1], w32, True, "xla")
    assert not head_rows.takes(x32[:1], w32.T, False, "auto")  # untied: XLA's dot
    x, w = _operands(32, 64, 40, jnp.bfloat16, True)
    assert not head_rows.takes(x[:1].astype(jnp.float32), w, True, "auto")  # dtypes differ
    assert head_rows.takes(x, w, True, "auto") == head_rows.amx_takes(w, True)
    assert not head_rows.takes(x, w.T, False, "auto")  # a bfloat16 [E, V] head: oneDNN's gemm
    x32, w32 = x32[:32], w32.T
    with pytest.raises(ValueError, match="one dtype"):
        head_rows.head_logits(x32, w, True)

    # The gradient is XLA's products of the cotangent, as vocab_logits' dot's is: bound by the roundings of
    # V (or N) terms each. Observed: the same bits.
    cotangent = jnp.asarray(np.random.default_rng(2).standard_normal((32, 40)), jnp.float32)

    def loss(logits_of):
        return lambda h, w: jnp.sum(logits_of(h, w) * cotangent)

    kernel = jax.grad(loss(lambda h, w: head_rows.head_logits(h, w, False)), argnums=(0, 1))(x32, w32)
    with policy.using("xla"):
        xla = jax.grad(loss(lambda h, w: vocab_logits(h, w, False)), argnums=(0, 1))(x32, w32)
    c, h, wt = (np.abs(np.asarray(a, np.float64)) for a in (cotangent, x32, w32))
    assert_within(kernel[0], xla[0], ulp_bound(40, c @ wt.T), "d hidden")
    assert_within(kernel[1], xla[1], ulp_bound(32, h.T @ c), "d head")
