"""Products with an int8 weight and float32 scales per output column and group of inputs: `x @ (q * scale)`.

The scales of a `[D, F]` weight are `[G, F]` (of a `[F, D]` one, `[F, G]`): scale `g` covers the
inputs `[g * group, (g + 1) * group)`, `group = ceil(D / G)`, the last group possibly shorter
(`group_size`). One group (`G = 1`) is one scale per output column.

Decoding reads every weight once per token, so its speed is the speed of streaming the int8 bytes.
XLA's CPU backend converts the int8 operand into a float copy before its dot, moving more bytes than
the weight holds; Dew's kernel (`native/int8.cc`, the extension `dew._native_int8` that `pip install`
builds, called through `jax.ffi`) widens the int8 values in registers instead, across XLA's intra-op
threads, with AVX-512, AVX2 or portable loops chosen by what the CPU reports at run time, and multiplies
each group's partial sum by its scale. XLA's form (`xla_product`) converts the weight to float32 times
its scales once per call and runs the float32 product the linears run (`dew.kernels.matmul.dot`), so
a long prefill costs what float32 weights cost plus one pass over the int8 bytes. Both accumulate in
float32; they differ by the order of the roundings.

The kernel takes products of up to `KERNEL_MAX_ROWS` rows of x (decoding; a long prefill is arithmetic-
bound, where XLA's blocked float32 product with one converted copy of q is faster) wherever the kernel
policy lets a native kernel into the step (`dew.kernels.policy`) and the extension built.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dew.kernels.loader import import_extension
from dew.kernels.matmul import dot, layer_index
from dew.kernels.policy import calls_refused, note

_TARGET = "dew_int8_product"
_STACKED_TARGET = "dew_int8_stacked_product"  # q [L, D, F] and the layer's index
# The compute dtypes whose values float32 holds exactly, so the kernel's float32 operand is the XLA
# form's operand.
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Rows of x up to which the kernel runs: it reads q once for every few rows (docs/performance.md has the
# crossing point on SmolLM2's shapes).
KERNEL_MAX_ROWS = 32


def group_size(inputs: int, groups: int) -> int:
    """The inputs each of `groups` scales covers along an axis of `inputs`: `ceil(inputs / groups)`."""
    return -(-inputs // groups)


def _checked_group(q: jax.Array, scale: jax.Array, axis: int) -> int:
    """The group size of `scale` for `q` (input axis `axis`), or a clear error where they do not fit."""
    inputs, groups = q.shape[axis], scale.shape[axis] if scale.ndim == q.ndim else 0
    group = group_size(inputs, groups) if groups else 0
    if not group or group_size(inputs, group) != groups:
        raise ValueError(f"scales of shape {scale.shape} do not fit an int8 weight of shape {q.shape} (its input "
                         f"axis {axis} of {inputs} must split into the scales' groups of ceil({inputs} / groups), "
                         "none empty): the scales were made for another weight")
    return group


def dequantize(q: jax.Array, scale: jax.Array, axis: int) -> jax.Array:
    """float32 `q * scale`, `q` int8 with its input axis at `axis`, `scale` `q`'s shape with that axis
    holding the G groups (`scale.shape[axis] == G`): each scale repeated over its group's inputs."""
    group, groups = _checked_group(q, scale, axis), scale.shape[axis]
    axis %= q.ndim
    inputs = q.shape[axis]
    # [.., G * group, ..] -> [.., G, group, ..] times the scales broadcast over `group`: one elementwise
    # fusion (a repeated copy of the scales would be as large as the float weight). A shorter last group
    # is padded with zeros and cut off again.
    padded = lax.pad(q, jnp.int8(0), [(0, groups * group - inputs if a == axis else 0, 0) for a in range(q.ndim)])
    split = (*q.shape[:axis], groups, group, *q.shape[axis + 1:])
    w = padded.reshape(split).astype(jnp.float32) * jnp.expand_dims(scale.astype(jnp.float32), axis + 1)
    return lax.slice_in_dim(w.reshape(padded.shape), 0, inputs, axis=axis)


@functools.cache
def _load() -> tuple[bool, str]:
    """(whether the kernel is registered with XLA, which bodies it runs or why it is not)."""
    _native_int8, why = import_extension("int8")
    if _native_int8 is None:
        return False, why
    jax.ffi.register_ffi_target(_TARGET, _native_int8.handler(), platform="cpu")
    jax.ffi.register_ffi_target(_STACKED_TARGET, _native_int8.stacked_handler(), platform="cpu")
    return True, f"dew._native_int8 with {_native_int8.isa()} loops"


def kernel_status(policy: str | None = None) -> tuple[bool, str]:
    """(whether int8 products run in Dew's kernel under `policy` (default the one in force) in this
    process, which loops it runs or why not)."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _load()


def kernel_product(x_ND: jax.Array, q: jax.Array, scale: jax.Array, transposed: bool = False) -> jax.Array:
    """`x @ (q * scale)` as float32 `[N, F]` in Dew's kernel: `x` float32 `[N, D]`, `q` int8 `[D, F]` with
    `scale` float32 `[G, F]` (or `[F, D]` and `[F, G]` when `transposed`, a tied head). Under `vmap`
    every operand may carry the batch axis or not. Raises where `kernel_status()` is off."""
    on, why = kernel_status()
    if not on:
        raise RuntimeError(f"the int8 kernel is off: {why}")
    if x_ND.dtype != jnp.float32 or q.dtype != jnp.int8 or scale.dtype != jnp.float32:
        raise ValueError(f"the int8 kernel takes float32 x, int8 q and float32 scales, not {x_ND.dtype}, "
                         f"{q.dtype} and {scale.dtype}: cast them first")
    _checked_group(q, scale, axis=-1 if transposed else -2)
    F = q.shape[-2] if transposed else q.shape[-1]
    out = jax.ShapeDtypeStruct((*x_ND.shape[:-1], F), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out, vmap_method="expand_dims")(x_ND, q, scale, transposed=transposed)


def xla_product(x_ND: jax.Array, q: jax.Array, scale: jax.Array, dtype, transposed: bool = False) -> jax.Array:
    """The other form of `int8_product`: `q * scale` in float32 once, then the linears' float32 product
    of `x` rounded to `dtype` (the kernel's operands; int8 times a float32 scale is not exact in bfloat16)."""
    w = dequantize(q, scale, axis=-1 if transposed else -2)
    return dot(x_ND.astype(dtype).astype(jnp.float32), w, transpose_b=transposed)


def kernel_takes(x_ND: jax.Array, q: jax.Array, dtype, policy: str | None = None) -> bool:
    """Whether `int8_product` of these operands runs in the kernel under `policy` here: int8 weights, a
    compute dtype float32 holds exactly, at most `KERNEL_MAX_ROWS` rows, and `kernel_status()` on."""
    taken = (q.dtype == jnp.int8 and jnp.dtype(dtype) in _KERNEL_DTYPES and x_ND.ndim == 2
             and x_ND.shape[0] <= KERNEL_MAX_ROWS and kernel_status(policy)[0])
    note(f"int8/{x_ND.shape[0]}x{q.shape[0]}x{q.shape[1]}", "dew" if taken else "xla")
    return taken


def int8_product(x_ND: jax.Array, q: jax.Array, scale: jax.Array, dtype, transposed: bool = False,
                 layer: jax.Array | None = None) -> jax.Array:
    """`x @ (q * scale)` as float32 `[N, F]`, `x` in the compute `dtype`, `q` int8 `[D, F]` and `scale`
    `[G, F]` (`[F, D]` and `[F, G]` when `transposed`), or with `layer` (an int32 scalar) `q[layer]` of a
    stack `[L, D, F]`, read in place by the kernel (a scanned decoder's weights, which slicing would copy
    every step): Dew's kernel where `kernel_takes` says so, else `xla_product`."""
    one = q if layer is None else jax.ShapeDtypeStruct(q.shape[1:], q.dtype)
    if kernel_takes(x_ND, one, dtype):
        # `dtype` first: the products are those of the compute dtype's x, as in the XLA form.
        x_ND = x_ND.astype(dtype).astype(jnp.float32)
        if layer is not None and not transposed:
            _checked_group(one, scale, axis=-2)
            out = jax.ShapeDtypeStruct((x_ND.shape[0], q.shape[-1]), jnp.float32)
            call = jax.ffi.ffi_call(_STACKED_TARGET, out, vmap_method="sequential")
            return call(x_ND, q, scale.astype(jnp.float32), layer_index(layer))
        return kernel_product(x_ND, q if layer is None else q[layer], scale.astype(jnp.float32), transposed)
    return xla_product(x_ND, q if layer is None else q[layer], scale, dtype, transposed)
