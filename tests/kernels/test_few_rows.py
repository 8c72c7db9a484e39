"""Dew's few-rows kernel (`dew.kernels.matmul.few_rows_product`, native/few_rows.cc) against XLA's product,
and where the kernel policy sends a decode step's float32 products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import matmul, policy
from tests.tolerances import ulp_bound

ON, WHY = matmul.few_rows_status("auto")
pytestmark = pytest.mark.skipif(not ON, reason=f"the few-rows kernel is off: {WHY}")


def instruction_sets() -> list[str]:
    """Every loop set this CPU runs, from the portable one up to its best."""
    from dew import _native_few_rows

    ladder = ["portable", "avx2", "avx512"]
    return ladder[: ladder.index(_native_few_rows.isa()) + 1]


# Shapes that reach every path: 8-, 4-, 2- and 1-row tiles and their remainders (M = 13 = 8 + 4 + 1; 3; 2;
# 32), the widest column tiles, the single 16- and 8-column ones and the scalar tail (N = 131, 40, 130), K
# below one block of 16, off the blocks, and weights large enough for two and four slices (520 x 131, 1030
# x 130 floats; 128 KiB a slice).
@pytest.mark.parametrize("M,K,N", [(13, 520, 131), (3, 7, 40), (32, 64, 96), (2, 1030, 130)])
def test_the_kernel_is_the_xla_product_in_another_order(M, K, N):
    from dew import _native_few_rows

    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K), np.float32)
    w = rng.standard_normal((K, N), np.float32)
    reference = np.asarray(matmul.xla_product(jnp.asarray(x), jnp.asarray(w), False, False))
    # Each side sums K products, each rounded once (an FMA rounds the product into the sum), in its own
    # order: within K - 1 roundings of the sum of the terms' magnitudes apart, plus one for the products.
    bound = ulp_bound(K, np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    run = jax.jit(matmul.few_rows_product)
    results = {}
    try:
        for isa in instruction_sets():
            _native_few_rows.set_isa(isa)
            results[isa] = np.asarray(run(x, w))
            # Observed: at most 9.2e-5 apart (K = 1,030), 0.2% of the bound at most.
            difference = np.abs(results[isa] - reference)
            assert np.all(difference <= bound), f"{isa}: {difference.max()}"
    finally:
        _native_few_rows.set_isa(instruction_sets()[-1])
    # One chain of FMAs per output and slice, slices added in order: every instruction set gives the same bits.
    for isa, result in results.items():
        np.testing.assert_array_equal(result, results["portable"], err_msg=isa)


def test_the_policy_sends_only_measured_decode_products_to_it(monkeypatch):
    measured = {"1x8x576x576/float32/NN/float32": {"onednn": False, "few_rows": True},
                "1x8x576x192/float32/NN/float32": {"onednn": False, "few_rows": False}}
    assert policy.choose_few_rows(8, 576, 576, "auto", measured=measured)
    assert policy.choose_few_rows(6, 400, 700, "exact", measured=measured)  # within a factor 2 of the entry
    assert not policy.choose_few_rows(8, 576, 192, "auto", measured=measured)  # measured slower
    assert not policy.choose_few_rows(8, 576, 4096, "auto", measured=measured)  # no entry near
    assert not policy.choose_few_rows(33, 576, 576, "auto", measured=measured)  # past FEW_ROWS
    assert not policy.choose_few_rows(8, 576, 576, "native", measured=measured)  # native: oneDNN's
    assert not policy.choose_few_rows(8, 576, 576, "xla", measured=measured)

    # Through `product`: the table's choice under auto, XLA's own dot under xla, with the same numbers.
    monkeypatch.setattr(policy, "table", lambda: {"classes": {policy.cpu_class(): {"products": measured}}})
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 576)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((576, 576)), jnp.float32)
    results = {}
    for name in ("auto", "xla"):
        with policy.recording() as choices:
            results[name] = np.asarray(jax.jit(lambda x, w, name=name: matmul.product(x, w, policy=name))(x, w))
        assert choices == {"1x8x576x576/float32/NN/float32": "dew" if name == "auto" else "xla"}
    bound = ulp_bound(576, np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)))
    assert np.all(np.abs(results["auto"] - results["xla"]) <= bound)
    assert policy.summary(choices | {"1x8x576x192/float32/NN/float32": "dew"}).endswith("1 in Dew's few-rows kernel")
