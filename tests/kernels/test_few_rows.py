"""Dew's few-rows kernel (`dew.kernels.matmul.few_rows_product`, native/few_rows.cc) against XLA's product,
and where the kernel policy sends a decode step's products and a prefill's bfloat16 ones."""

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
# x 130 floats; 128 KiB a slice). AVX2's tiles are of 3, 2 and 1 rows (13 = 3 * 4 + 1), and from 16 rows
# its strips of 32 columns: one panel (32 x 64 x 96), panels of 128 rows continued and a strip of 24 columns
# then the scalar tail (17 x 300 x 155), four slices of strips (20 x 1030 x 72). AVX-512's strips take the
# same shapes in 8-, 4- and 1-row tiles (17 = 8 + 8 + 1, 20 = 8 + 8 + 4, 32), with a 16-column strip before
# the tail (155) and a tail of 8 columns after whole strips (72).
@pytest.mark.parametrize("M,K,N", [(13, 520, 131), (3, 7, 40), (32, 64, 96), (2, 1030, 130), (17, 300, 155),
                                   (20, 1030, 72)])
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


def _bfloat16_bodies() -> list[tuple[str, bool, bool]]:
    """Every bfloat16 body this CPU runs: (instruction set, whether vdpbf16ps, whether AMX), the FMA ones first."""
    from dew import _native_few_rows

    bodies = [(isa, False, False) for isa in instruction_sets()]
    for pairs, tiles in ((True, False), (False, True)):
        try:
            _with_body("avx512", pairs, tiles, lambda: None)
            bodies.append(("avx512", pairs, tiles))
        except ValueError:  # no AVX512_BF16, or no AMX, here
            pass
    return bodies


def _with_body(isa: str, pairs: bool, tiles: bool, run):
    """`run()` under the bfloat16 body (`isa`, `pairs`, `tiles`), the CPU's best restored after."""
    from dew import _native_few_rows

    best = instruction_sets()[-1], _native_few_rows.pairs(), _native_few_rows.tiles()
    try:
        _native_few_rows.set_isa(isa)
        _native_few_rows.set_pairs(pairs)
        _native_few_rows.set_tiles(tiles)
        return run()
    finally:
        _native_few_rows.set_isa(best[0])
        _native_few_rows.set_pairs(best[1])
        _native_few_rows.set_tiles(best[2])


# Shapes that reach every bfloat16 path: 8-, 4- and 1-row tiles (M = 13), one row's 128-column tiles and the
# 32- and 16-column ones with a scalar tail (N = 177, 131, 40, 144), K odd (the last row alone in vdpbf16ps),
# below one block, and a weight of two slices (1031 x 144 bfloat16s; 128 KiB a slice); AMX's tiles of 2 to 16
# rows and of 17 to 32 (M = 13, 32, 20), with a 16-column half group (N = 144); AVX2's and AVX-512's strips
# from 16 rows (M = 17, 32, 20: panels continued, a 24- or 16-column strip and a scalar tail).
@pytest.mark.parametrize("M,K,N", [(1, 521, 177), (13, 521, 131), (17, 300, 155), (3, 7, 40), (32, 64, 96),
                                   (2, 1031, 144), (20, 1031, 144)])
def test_bfloat16_bodies_are_one_float32_chain(M, K, N):
    rng = np.random.default_rng(M * K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = x64 @ w64
    # Each product of two bfloat16s is exact in float32, so a chain of K fused multiply-adds from zero rounds
    # only its K - 1 sums, each by at most half an ulp of the sum of the terms' magnitudes (float64's own
    # roundings are 2^-29 of that). AMX adds the same K exact products into float32 sums in its own order,
    # rounding at most as often.
    bound = ulp_bound(K / 2, np.abs(x64) @ np.abs(w64))
    run = jax.jit(matmul.few_rows_product)
    results = {}
    for body in _bfloat16_bodies():
        results[body] = _with_body(*body, lambda: np.asarray(run(x, bits)))
        # Observed: at most 2.6e-5 from the exact sums (K = 1,031), 1.8% of the bound at most (K = 64).
        difference = np.abs(results[body] - exact)
        assert np.all(difference <= bound), f"{body}: {difference.max()}"
    # vdpbf16ps adds a pair's high half (row k) then its low half (row k + 1), each addition rounded: the FMA
    # bodies' chain over k in order, the same bits. AMX (2 rows or more) is not that chain.
    for body, result in results.items():
        if not (body[2] and M >= 2):
            np.testing.assert_array_equal(result, results["portable", False, False], err_msg=str(body))
    # A bfloat16 weight as itself is its bits.
    np.testing.assert_array_equal(np.asarray(run(x, w)), np.asarray(run(x, bits)))


@pytest.mark.parametrize("rows", [8, 40])  # 40: AMX's body for many rows
def test_every_bfloat16_body_flushes_denormals_under_xla(rows):
    # x = 1, 1 against w's rows 2^-130 (a bfloat16 denormal) and 0. vdpbf16ps and AMX read denormals as zero
    # on their own; XLA runs its CPU threads with denormals flushed (MXCSR's FTZ and DAZ), so the FMA bodies
    # do too.
    x = jnp.ones((rows, 2), jnp.bfloat16)
    w = jnp.asarray([[2.0**-130] * 16, [0.0] * 16], jnp.bfloat16)
    assert float(w[0, 0]) == 2.0**-130
    run = jax.jit(matmul.few_rows_product)
    for body in _bfloat16_bodies():
        result = _with_body(*body, lambda: np.asarray(run(x, w)))
        np.testing.assert_array_equal(result, np.zeros((rows, 16), np.float32), err_msg=str(body))


TILES = matmul.few_rows_tiles()


# AMX's body for more than FEW_ROWS rows (a prefill's): rows read in place in whole blocks of 32 with a tail of
# one (M = 33, K = 64 a whole number of 32-row steps), whole blocks and whole 32-column panels (M = 64, K =
# 576), every block copied out for a K off the steps with a tail of 4 rows, and groups of 3 and 2 panels, the
# last of 3 columns (M = 100, K = 521, N = 131), and one 16-column panel whose rows split between threads.
@pytest.mark.skipif(not TILES, reason="no AMX bfloat16 tiles on this CPU, or Linux refused them to this process")
@pytest.mark.parametrize("M,K,N", [(33, 64, 48), (64, 576, 96), (100, 521, 131), (257, 4100, 16)])
def test_the_amx_body_for_many_rows_is_within_k_roundings(M, K, N):
    rng = np.random.default_rng(M * K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    stack = jnp.asarray(rng.standard_normal((2, K, N)), jnp.bfloat16)
    x64, w64 = np.asarray(x, np.float64), np.asarray(stack[1], np.float64)
    # As in test_bfloat16_bodies_are_one_float32_chain: the K products are exact in float32, and tdpbf16ps
    # adds them into float32 sums in its own order, at most K - 1 roundings of the terms' magnitudes.
    bound = ulp_bound(K / 2, np.abs(x64) @ np.abs(w64))
    result = np.asarray(jax.jit(matmul.few_rows_product)(x, stack, jnp.int32(1)))
    # Observed: at most 8.1e-5 from the exact sums (K = 4,100), 1.1% of the bound at most (K = 64).
    difference = np.abs(result - x64 @ w64)
    assert np.all(difference <= bound), difference.max()


def test_bfloat16_decode_products_take_it_lone_or_stacked():
    assert [policy.choose_bfloat16_few_rows(m, 576, 1536, "auto", False) for m in (1, 2, 8, 9, 32, 33)] == [
        False, True, True, False, False, False]
    assert [policy.choose_bfloat16_few_rows(m, 576, 1536, "auto", True) for m in (1, 2, 8, 9, 16, 17, 32, 33)] == [
        True, True, True, True, True, True, True, False]  # with AMX's tiles
    assert policy.choose_bfloat16_few_rows(4, 576, 1536, "exact", False)
    assert not policy.choose_bfloat16_few_rows(4, 576, 1536, "native", True)  # native: oneDNN's
    assert not policy.choose_bfloat16_few_rows(4, 576, 1536, "xla", True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    stack = jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((2, 64, 48)), jnp.bfloat16), jnp.uint16)
    weight = jax.lax.bitcast_convert_type(stack[1], jnp.bfloat16)
    with policy.recording() as choices:
        stacked = jax.jit(lambda x, s: matmul.stacked_product(x, s, jnp.int32(1), jnp.bfloat16, "auto"))(x, stack)
        lone = jax.jit(lambda x, w: matmul.product(x, w, out_dtype=jnp.bfloat16, policy="auto"))(x, weight)
    assert choices == {"1x3x64x48/bfloat16/NN/bfloat16": "dew"}
    assert matmul.stacked_takes(x, stack, "auto") and not matmul.stacked_takes(x, stack, "xla")
    # The same kernel on the same bytes, rounded once to bfloat16: the same bits as each other and as the
    # float32 result rounded.
    np.testing.assert_array_equal(np.asarray(stacked, np.float32), np.asarray(lone, np.float32))
    rounded = np.asarray(jax.jit(matmul.few_rows_product)(x, weight).astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(lone, np.float32), rounded)


def test_bfloat16_prefill_products_read_the_layer_in_place_where_there_are_tiles():
    assert [policy.choose_bfloat16_prefill(m, 576, 1536, "auto", True) for m in (32, 63, 64, 4096, 4097)] == [
        False, False, True, True, False]
    assert policy.choose_bfloat16_prefill(64, 576, 1536, "exact", True)
    assert not policy.choose_bfloat16_prefill(64, 576, 1536, "auto", False)  # no tiles: the copy and XLA's dot
    assert not policy.choose_bfloat16_prefill(64, 576, 1536, "native", True)  # native: oneDNN's
    assert not policy.choose_bfloat16_prefill(64, 576, 1536, "xla", True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((65, 64)), jnp.bfloat16)
    stack = jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((2, 64, 48)), jnp.bfloat16), jnp.uint16)
    assert matmul.stacked_takes(x, stack, "auto") == TILES and not matmul.stacked_takes(x, stack, "xla")
    if not TILES:
        pytest.skip("no AMX bfloat16 tiles here: a prefill's products index the layer out (XLA's copy)")
    run = jax.jit(lambda x, s: matmul.stacked_product(x, s, jnp.int32(1), jnp.float32, "auto"))
    with policy.recording() as choices:
        result = np.asarray(run(x, stack))
    assert choices == {"1x65x64x48/bfloat16/NN/float32": "dew"}
    program = run.lower(x, stack).compile().as_text()
    assert "dew_few_rows_bf16" in program and "dynamic-slice" not in program  # the layer is not copied out
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(jax.lax.bitcast_convert_type(stack[1], jnp.bfloat16), np.float64)
    # The bound of test_the_amx_body_for_many_rows_is_within_k_roundings. Observed: 3.1e-6 (1.8% of it).
    difference = np.abs(result - x64 @ w64)
    assert np.all(difference <= ulp_bound(64 / 2, np.abs(x64) @ np.abs(w64))), difference.max()
    # Asked for bfloat16, the call rounds the same float32 sums once, to nearest even, as XLA's convert does.
    rounded = jax.jit(lambda x, s: matmul.stacked_product(x, s, jnp.int32(1), jnp.bfloat16, "auto"))(x, stack)
    np.testing.assert_array_equal(np.asarray(rounded, np.float32),
                                  np.asarray(jnp.asarray(result).astype(jnp.bfloat16), np.float32))
