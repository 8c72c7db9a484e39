"""Products with an int8 weight and one float32 scale per output column: `(x @ q) * scale`.

Decoding reads every weight once per token, so its speed is the speed of streaming the int8 bytes.
XLA's CPU backend converts the int8 operand into a float copy before its dot, moving more bytes than
the weight holds; Dew's kernel (`native/int8.cc`, the extension `dew._native_int8` that `pip install`
builds, called through `jax.ffi`) widens the int8 values in registers instead, across XLA's intra-op
threads, with AVX-512, AVX2 or portable loops chosen by what the CPU reports at run time. Both forms
accumulate in float32 and multiply the finished sum by the scale; they differ by the order of the sums.

The kernel takes products of up to `KERNEL_MAX_ROWS` rows of x (decoding; a long prefill is XLA's)
where `kernel_status()` says it is on: the extension built, the backend is the CPU,
the process sees one device (GSPMD cannot partition a foreign call), and `DEW_INT8_KERNEL` is not
`off`. Elsewhere the products are XLA's. The variable is read when a product is traced, so set it
before the first generation of a process (a compiled generation keeps the form it was traced with).
`DEW_INT8_KERNEL=on` (or unset) asks for the kernel where it can run.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

_MATMUL = (((1,), (0,)), ((), ()))  # [N, D] x [D, F]
_MATMUL_T = (((1,), (1,)), ((), ()))  # [N, D] x [F, D]
_TARGET = "dew_int8_product"
# The compute dtypes whose values float32 holds exactly, so the kernel's float32 operand is the XLA
# form's operand.
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Rows of x up to which the kernel runs: it reads q once for every 4 rows, so past a few dozen rows (a
# prompt's prefill, a perplexity pass) the product is bound by arithmetic, where XLA's blocked matrix
# product with one converted copy of q is faster (measured on SmolLM2's 576 x 1536, weights in cache:
# equal at 16 and 32 rows, XLA 1.3x faster at 128 and 1.4-1.9x at 512).
KERNEL_MAX_ROWS = 32


def _policy() -> str:
    value = os.environ.get("DEW_INT8_KERNEL", "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"DEW_INT8_KERNEL={value!r} is not a setting: use 'on' or 'off'")
    return value


@functools.cache
def _load() -> tuple[bool, str]:
    """(whether the kernel is registered with XLA, which bodies it runs or why it is not)."""
    if jax.default_backend() != "cpu":
        return False, f"the backend is {jax.default_backend()}, and the int8 kernel is for the CPU"
    try:
        from dew import _native_int8
    except ImportError as error:
        return False, (f"the extension dew._native_int8 did not build ({error}); reinstall Dew where a C++ "
                       "compiler and Python's headers are present")
    jax.ffi.register_ffi_target(_TARGET, _native_int8.handler(), platform="cpu")
    return True, f"dew._native_int8 with {_native_int8.isa()} loops"


def kernel_status() -> tuple[bool, str]:
    """(whether int8 products run in Dew's kernel in this process, which loops it runs or why not)."""
    if _policy() == "off":
        return False, "turned off by DEW_INT8_KERNEL=off"
    if jax.device_count() > 1:
        return False, (f"this process sees {jax.device_count()} devices, and sharded steps keep XLA's products "
                       "(GSPMD cannot partition a foreign call)")
    return _load()


def kernel_product(x_ND: jax.Array, q: jax.Array, scale_F: jax.Array, transposed: bool = False) -> jax.Array:
    """`(x @ q) * scale` as float32 `[N, F]` in Dew's kernel: `x` float32 `[N, D]`, `q` int8 `[D, F]`
    (or `[F, D]` when `transposed`, a tied head), `scale` float32 `[F]`. Under `vmap` every operand
    may carry the batch axis or not. Raises where `kernel_status()` is off."""
    on, why = kernel_status()
    if not on:
        raise RuntimeError(f"the int8 kernel is off: {why}")
    if x_ND.dtype != jnp.float32 or q.dtype != jnp.int8 or scale_F.dtype != jnp.float32:
        raise ValueError(f"the int8 kernel takes float32 x, int8 q and float32 scales, not {x_ND.dtype}, "
                         f"{q.dtype} and {scale_F.dtype}: cast them first")
    F = q.shape[-2] if transposed else q.shape[-1]
    out = jax.ShapeDtypeStruct((*x_ND.shape[:-1], F), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out, vmap_method="expand_dims")(x_ND, q, scale_F, transposed=transposed)


def xla_product(x_ND: jax.Array, q: jax.Array, scale_F: jax.Array, dtype, transposed: bool = False) -> jax.Array:
    """The XLA form of `int8_product`: one dot with the int8 operand converted to `dtype`."""
    dims = _MATMUL_T if transposed else _MATMUL
    y_NF = lax.dot_general(x_ND.astype(dtype), q.astype(dtype), dims, preferred_element_type=jnp.float32)
    return y_NF * scale_F


def kernel_takes(x_ND: jax.Array, q: jax.Array, dtype) -> bool:
    """Whether `int8_product` of these operands runs in the kernel in this process: int8 weights, a
    compute dtype float32 holds exactly, at most `KERNEL_MAX_ROWS` rows, and `kernel_status()` on."""
    return (q.dtype == jnp.int8 and jnp.dtype(dtype) in _KERNEL_DTYPES and x_ND.ndim == 2
            and x_ND.shape[0] <= KERNEL_MAX_ROWS and kernel_status()[0])


def int8_product(x_ND: jax.Array, q: jax.Array, scale_F: jax.Array, dtype, transposed: bool = False) -> jax.Array:
    """`(x @ q) * scale` as float32 `[N, F]`, `x` in the compute `dtype`, `q` int8 `[D, F]` (`[F, D]`
    when `transposed`): Dew's kernel where `kernel_status()` is on, else XLA's dot."""
    if kernel_takes(x_ND, q, dtype):
        # `dtype` first: the products are those of the compute dtype's x, as in the XLA form.
        x_ND = x_ND.astype(dtype).astype(jnp.float32)
        return kernel_product(x_ND, q, scale_F.astype(jnp.float32), transposed)
    return xla_product(x_ND, q, scale_F, dtype, transposed)
