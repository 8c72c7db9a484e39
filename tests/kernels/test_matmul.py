"""oneDNN's products through jax.ffi (dew.kernels.matmul) against XLA's.

Both sides accumulate in float32: bfloat16 operands multiply exactly in float32, so for either dtype
the two results differ only by the order of the K additions, at most K - 1 roundings of the running
sum, each half an ulp of at most `sum_k |a_ik b_kj|` per side: `ulp_bound(K, |a| @ |b|)` holds. The
largest differences observed (AMD EPYC with AVX-512) are written in each test.
"""

from __future__ import annotations

import platform
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.kernels import matmul as fast_matmul
from dew.kernels.loader import onednn_path
from dew.kernels.matmul import dot, product
from tests.tolerances import ulp_bound

AVAILABLE, WHY = fast_matmul._load()
needs_library = pytest.mark.skipif(not AVAILABLE, reason=f"oneDNN path off here: {WHY}")
# oneDNN's bfloat16 gemm needs AVX512-core (or AVX2-VNNI-2): AVX2-only CPUs keep bfloat16 products in XLA.
BFLOAT16, WHY_BFLOAT16 = fast_matmul._bfloat16() if AVAILABLE else (False, WHY)
needs_bfloat16 = pytest.mark.skipif(not BFLOAT16, reason=WHY_BFLOAT16)


@pytest.fixture
def policy(monkeypatch):
    def set_policy(value: str):
        monkeypatch.setenv("DEW_KERNELS", value)
    return set_policy


def operands(shape_a, shape_b, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_a), dtype), jnp.asarray(rng.standard_normal(shape_b), dtype))


def bound(a, b, transpose_a=False, transpose_b=False):
    """Elementwise `ulp_bound(K, |op(a)| @ |op(b)|)` in float32 (see the module docstring)."""
    a = np.abs(np.asarray(a, np.float32))
    b = np.abs(np.asarray(b, np.float32))
    a = np.swapaxes(a, -1, -2) if transpose_a else a
    b = np.swapaxes(b, -1, -2) if transpose_b else b
    return ulp_bound(a.shape[-1], a @ b)


def test_the_path_builds_where_it_can():
    """On x86-64 Linux with a C++ compiler, `pip install` builds the extension and the wheel is there;
    elsewhere the reason is a sentence, and the products stay XLA's."""
    if sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("c++"):
        assert AVAILABLE, WHY
        assert WHY.startswith("oneDNN 2023.2.0")
    else:
        assert isinstance(WHY, str) and WHY


@needs_library
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m, k, n", [(301, 130, 51), (37, 130, 301)], ids=["row-pieces", "column-pieces"])
def test_products_match_xla(policy, dtype, transpose_a, transpose_b, m, k, n):
    # Observed: bit-identical for the 301-row cases (AMD EPYC with AVX-512 for the first three
    # transposes, Intel Xeon for all four); the 37-row ones differ by up to 2.3e-5 on the Xeon,
    # entries of size ~11 summed in another order, which the bound allows.
    policy("native")
    if dtype == jnp.bfloat16 and not BFLOAT16:
        pytest.skip(WHY_BFLOAT16)  # test_bfloat16_goes_to_the_library_where_it_runs covers this CPU
    # Odd sizes, which no kernel's tile divides. 301 rows split into pieces on XLA's threads (up to
    # two per thread, at least 64 rows each), each starting mid-way down (or across, transposed) `a`;
    # with `a` transposed (a weight gradient), 301 columns against 37 rows (4x wider or more) split
    # into column pieces of 80 (a multiple of 16), the last 61 wide, each starting mid-way across the
    # result and across `b` (down it, transposed); with `a` as stored, its 37 rows are one piece.
    a, b = operands((k, m) if transpose_a else (m, k), (n, k) if transpose_b else (k, n), dtype)
    ours = jax.jit(lambda a, b: fast_matmul.onednn_product(a, b, transpose_a, transpose_b))(a, b)
    xla = jax.jit(lambda a, b: fast_matmul.xla_product(a, b, transpose_a, transpose_b, cpu_layout=True))(a, b)
    assert ours.dtype == xla.dtype == jnp.float32 and ours.shape == xla.shape == (m, n)
    np.testing.assert_array_less(np.abs(np.asarray(ours) - np.asarray(xla)), bound(a, b, transpose_a, transpose_b) + 1e-30)


@needs_library
def test_bfloat16_goes_to_the_library_where_it_runs(policy):
    """oneDNN's bfloat16 gemm says `dnnl_unimplemented` without AVX512-core (or AVX2-VNNI-2, which
    brings AVX-NE-CONVERT): there even `native` keeps bfloat16 products in XLA, with the reason in
    `status`, while float32 ones still go to the library."""
    policy("native")
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert BFLOAT16, WHY_BFLOAT16
    elif "avx_ne_convert" not in flags:
        assert not BFLOAT16 and "unavailable on this CPU (status 3" in WHY_BFLOAT16
    assert fast_matmul.status(jnp.bfloat16) == (BFLOAT16, WHY_BFLOAT16)
    a, b = operands((512, 256), (256, 512), jnp.bfloat16)
    lowered = jax.jit(lambda a, b: dot(a, b, out_dtype=jnp.bfloat16)).lower(a, b).as_text()
    assert ("dew_gemm_bf16_to_bf16" in lowered) == BFLOAT16
    as_float32 = a.astype(jnp.float32), b.astype(jnp.float32)
    assert "dew_gemm_f32" in jax.jit(lambda a, b: dot(a, b)).lower(*as_float32).as_text()  # a fresh trace
    out = jax.jit(lambda a, b: dot(a, b, out_dtype=jnp.bfloat16))(a, b)  # runs here whichever path
    reference = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    # Either path sums in float32 (in its own order: `bound`) and rounds once to bfloat16 (half an
    # ulp, 2^-8 of the sum at most).
    sums = bound(a, b)
    limit = 2**-8 * (np.abs(reference) + sums) + sums
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float32) - reference), limit + 1e-30)


@needs_library
@needs_bfloat16
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (True, False)])
@pytest.mark.parametrize("m, k, n", [(301, 64, 40), (37, 64, 301)], ids=["row-pieces", "column-pieces"])
def test_bfloat16_results_round_as_xla_converts(policy, transpose_a, transpose_b, m, k, n):
    """The handler that rounds each piece's rows to bfloat16 itself gives what XLA's convert gives for
    the same float32 products, bit for bit: ties to even, infinities, NaN (any NaN counts as equal),
    whether the pieces are chunks of rows or of columns (written into the result's rows at an offset)."""
    policy("native")
    a, b = operands((k, m) if transpose_a else (m, k), (k, n), jnp.float32, seed=4)
    a = a.at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf)  # a NaN row of results, and infinities
    a, b = a.astype(jnp.bfloat16), (b * 1e3).astype(jnp.bfloat16)
    rounded = jax.jit(lambda a, b: fast_matmul.onednn_product(a, b, transpose_a, transpose_b, jnp.bfloat16))(a, b)
    converted = jax.jit(lambda a, b: fast_matmul.onednn_product(a, b, transpose_a, transpose_b).astype(jnp.bfloat16))(a, b)
    assert rounded.dtype == jnp.bfloat16
    assert np.isnan(np.asarray(rounded, np.float32)).any() and np.isinf(np.asarray(rounded, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(rounded, np.float32), np.asarray(converted, np.float32))


@needs_library
def test_batched_and_vmapped_products(policy):
    policy("native")
    a, b = operands((2, 3, 16, 24), (2, 3, 40, 24), jnp.float32)
    ours = jax.jit(lambda a, b: dot(a, b, True))(a, b)
    reference = jnp.einsum("xyik,xyjk->xyij", a, b)
    np.testing.assert_array_less(np.abs(ours - reference), bound(a, b, transpose_b=True) + 1e-30)
    mapped = jax.jit(jax.vmap(lambda a, b: dot(a, b, True)))(a, b)
    np.testing.assert_array_equal(mapped, ours)  # the same library call per matrix, in the same order
    assert "dew_gemm_f32" in jax.jit(lambda a, b: dot(a, b, True)).lower(a, b).as_text()


@needs_library
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gradients_match_autodiff(policy, transpose_b):
    """The custom VJP's products (each through oneDNN) against autodiff of XLA's float32 product."""
    policy("native")
    a, b = operands((48, 20), (36, 20) if transpose_b else (20, 36), jnp.float32, seed=1)
    g = jnp.asarray(np.random.default_rng(2).standard_normal((48, 36)), jnp.float32)

    def reference(a, b):
        return (a @ (b.T if transpose_b else b) * g).sum()

    ours = jax.jit(jax.grad(lambda a, b: (dot(a, b, transpose_b) * g).sum(), argnums=(0, 1)))(a, b)
    theirs = jax.grad(reference, argnums=(0, 1))(a, b)
    # da = g op(b)^T sums 36 terms, db sums 48: their bounds as products of the magnitudes.
    bound_a = bound(g, b, transpose_b=not transpose_b)
    bound_b = bound(g, a, transpose_a=True) if transpose_b else bound(a, g, transpose_a=True)
    np.testing.assert_array_less(np.abs(ours[0] - theirs[0]), bound_a + 1e-30)
    np.testing.assert_array_less(np.abs(ours[1] - theirs[1]), bound_b + 1e-30)


@needs_library
def test_a_decoder_step_matches_with_and_without(policy, tiny_model, tiny_variables):
    """A tiny decoder's loss and gradients with every product in oneDNN against XLA only: within
    float32 rounding of a few layers (relative 1e-5: each product's K <= 4 * width additions, a few
    hundred ulps of float32 at most through the layers and softmax). Observed: equal losses, gradients
    4.8e-7 of their largest entry apart."""
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, tiny_model.config.vocab_size, (2, 16)), jnp.int32)

    def loss(params):
        logits = tiny_model.apply({**tiny_variables, "params": params}, tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

    results = {}
    for value in ("xla", "native"):
        policy(value)
        results[value] = jax.jit(jax.value_and_grad(loss))(tiny_variables["params"])  # a fresh trace per policy
    (loss_off, grads_off), (loss_on, grads_on) = results["xla"], results["native"]
    np.testing.assert_allclose(loss_on, loss_off, rtol=1e-5)
    for off, on in zip(jax.tree.leaves(grads_off), jax.tree.leaves(grads_on)):
        scale = float(jnp.max(jnp.abs(off))) or 1.0
        np.testing.assert_allclose(on, off, rtol=0, atol=1e-5 * scale)


def test_xla_keeps_plain_products(policy):
    """Under `xla` a product is one `dot_general`: no foreign call, and no barrier around a transposed
    operand (the CPU layout trick is part of the other policies)."""
    policy("xla")
    a, b = operands((512, 256), (512, 256), jnp.float32)
    lowered = jax.jit(lambda a, b: jax.grad(lambda a: dot(a, b, True).sum())(a)).lower(a, b).as_text()
    weight_gradient = jax.jit(lambda a, b: product(a, b, transpose_a=True)).lower(a, a).as_text()
    for text in (lowered, weight_gradient):
        assert "custom_call" not in text and "optimization_barrier" not in text
    assert fast_matmul.status() == (False, "the policy is xla, so every product is XLA's own")
    policy("auto")  # a small product stays XLA's under auto, laid out for XLA's CPU matmul
    small = a[:16, :8]
    assert "optimization_barrier" in jax.jit(lambda a: product(a, a, transpose_a=True)).lower(small).as_text()


def test_several_devices_keep_xla(policy, monkeypatch):
    policy("native")
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    available, reason = fast_matmul.status()
    assert not available and "2 devices" in reason


def test_product_refuses_mismatched_operands():
    a, b = operands((4, 6), (5, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"the contracted axes differ"):
        product(a, b)
    with pytest.raises(ValueError, match=r"cast the operands to one dtype"):
        product(a, b.astype(jnp.bfloat16))


@needs_library
def test_the_callers_openmp_threads_are_left_as_they_were(policy):
    """Pieces run with one OpenMP thread each; the thread that ran them gets its setting back, so a
    library sharing the runtime (torch loads one under the same soname) keeps its threads. This fails
    only when XLA runs the call on this thread, as it may for a small product; elsewhere it passes
    either way."""
    import ctypes

    policy("native")
    runtime = ctypes.CDLL(str(onednn_path()))
    before = runtime.omp_get_max_threads()
    a, b = operands((301, 64), (64, 40), jnp.float32)
    with jax.ensure_compile_time_eval():  # small: XLA may run it on this thread
        jax.jit(lambda a, b: fast_matmul.onednn_product(a, b, False, False))(a, b).block_until_ready()
    assert runtime.omp_get_max_threads() == before
