"""Matrix products of the linears, of attention and of the loss head: XLA's `dot_general`, or oneDNN's gemm
where the kernel policy chooses it (`dew.kernels.policy`).

`product(a, b, transpose_a, transpose_b)` is the one entry of every such product: it emits either XLA's
own `dot_general` or a call through `jax.ffi` to oneDNN's row-major gemm (`dnnl_sgemm`,
`dnnl_gemm_bf16bf16f32`; the `onednn-cpu-gomp` wheel, loaded at run time by the extension
`dew._native_gemm` that `pip install` builds from `native/gemm.cc`). Both accumulate in float32. oneDNN's
bfloat16 gemm needs AVX512-core or AVX2-VNNI-2: it is asked once (`status(jnp.bfloat16)`), and on other
CPUs bfloat16 products stay XLA's. `dot` is `product` with the gradients a mixed-precision linear needs.

A product of a few rows (at most `policy.FEW_ROWS`, a decode step's linear: `[m, k] x [k, n]`, no
transposes, no batch) may instead run in Dew's own kernel (`few_rows_product`, `native/few_rows.cc`): it
streams the weight once for all rows, where XLA's CPU matmul of 8 rows reads it at half the memory's rate
and oneDNN's bfloat16 gemm of 2-32 rows repacks the weight at every call. Each of its outputs is one chain
of fused multiply-adds over k in order, in float32 (a bfloat16 product of two bfloat16s is exact in
float32; AVX512_BF16's `vdpbf16ps` gives the same chain; AMX's tiles, which take bfloat16 products of 2
rows or more where the CPU has them, add in their own order). In float32 the table decides where it runs;
in bfloat16 `policy.choose_bfloat16_few_rows` does.

A scanned decoder's layers hold their weights stacked `[L, k, n]`, and XLA's CPU backend copies a layer's
weight out of the stack before each product, every decode step. `stacked_product` hands the kernel the
whole stack and the layer's index instead (the few-rows kernel's and oneDNN's stacked handlers read the
layer in place): the same call on the same bytes, so the same numbers, for products of up to `FEW_ROWS`
rows. Larger bfloat16 ones (a prefill's) run in the kernel's AMX body where the CPU has AMX's tiles
(`policy.choose_bfloat16_prefill`): one chain of tile products over all of k per output, summed in the
hardware's order, not XLA's, so their numbers differ from the indexed layer's dot by roundings; the others
take `product` of the indexed layer. A gated feed-forward's gate and up products of a prefill take one call of
that body (`stacked_gated_product`), which applies the activation too, with the same bits as the two products
and XLA's activation after them.

On the CPU, under `auto` and `native`, a product that contracts the leading axis of `a` (a weight
gradient) lays `a^T` out as its own array first: XLA's CPU backend sends such a dot to Eigen, slower than
its own matmul on the transposed copy. Under `xla`, and on every other backend, the product is a plain
`dot_general` with nothing around it.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dew.kernels.loader import import_extension, onednn_functions, onednn_path, onednn_version
from dew.kernels.policy import (FEW_ROWS, calls_refused, choose_bfloat16_few_rows, choose_bfloat16_prefill,
                                choose_few_rows, choose_onednn, choose_stacked_few_rows, cpu_tuned, in_force, note,
                                product_key)

_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# (operands' dtype, result's dtype) -> the handler: bfloat16 results are rounded inside the call.
_TARGETS = {(_F32, _F32): "dew_gemm_f32", (_BF16, _F32): "dew_gemm_bf16", (_BF16, _BF16): "dew_gemm_bf16_to_bf16"}
_U16 = jnp.dtype(jnp.uint16)  # bfloat16 weights held as their bits (dew.nn.quantize.bfloat16_bits)


@functools.cache
def _load() -> tuple[bool, str]:
    """(whether oneDNN's products are registered with XLA, a sentence saying which library or why not)."""
    native_gemm, why = import_extension("gemm")
    if native_gemm is None:
        return False, why
    try:
        address = onednn_functions()
    except LookupError as error:
        return False, str(error)
    native_gemm.set_gemm(address["dnnl_sgemm"], address["dnnl_gemm_bf16bf16f32"], address["omp_set_num_threads"],
                         address["omp_get_max_threads"])
    for key, capsule in native_gemm.handlers().items():
        jax.ffi.register_ffi_target(f"dew_gemm_{key}", capsule, platform="cpu")
    return True, f"oneDNN {onednn_version()} ({onednn_path()})"


def status(dtype=_F32, policy: str | None = None) -> tuple[bool, str]:
    """(whether products of `dtype` operands may run in oneDNN under `policy` (default the one in force)
    in this process, why or why not)."""
    refused = calls_refused(policy)
    if refused:
        return False, refused
    available, why = _load()
    if available and jnp.dtype(dtype) == _BF16:
        return _bfloat16()
    return available, why


@functools.cache
def _bfloat16() -> tuple[bool, str]:
    """Whether oneDNN's bfloat16 gemm runs on this CPU: it answers `dnnl_unimplemented` without AVX512-core
    (or AVX2-VNNI-2). Asked once, with a 1 x 1 x 1 product."""
    gemm = ctypes.CDLL(str(onednn_path())).dnnl_gemm_bf16bf16f32
    gemm.restype = ctypes.c_int
    size, pointer, real = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    gemm.argtypes = [ctypes.c_char, ctypes.c_char, size, size, size, real, pointer, size, pointer, size, real,
                     pointer, size]
    one, two, out = np.array([0x3F80], np.uint16), np.array([0x4000], np.uint16), np.zeros(1, np.float32)
    code = gemm(b"N", b"N", 1, 1, 1, 1.0, one.ctypes.data, 1, two.ctypes.data, 1, 0.0, out.ctypes.data, 1)
    if code != 0 or out[0] != 2.0:
        return False, (f"oneDNN's bfloat16 gemm is unavailable on this CPU (status {code}: it needs AVX512-core "
                       "or AVX2-VNNI-2); bfloat16 products stay XLA's")
    return True, f"oneDNN {onednn_version()} (bfloat16 gemm)"


@functools.cache
def _few_rows() -> tuple[bool, str]:
    """(whether Dew's few-rows kernel is registered with XLA, a sentence saying which or why not)."""
    native, why = import_extension("few_rows")
    if native is None:
        return False, why
    jax.ffi.register_ffi_target("dew_few_rows", native.handler(), platform="cpu")
    jax.ffi.register_ffi_target("dew_few_rows_bf16", native.bfloat16_handler(), platform="cpu")
    jax.ffi.register_ffi_target("dew_few_rows_bf16_to_bf16", native.rounded_handler(), platform="cpu")
    jax.ffi.register_ffi_target("dew_few_rows_bf16_gated", native.gated_handler(), platform="cpu")
    bfloat16 = [name for name, on in (("vdpbf16ps", native.pairs()), ("AMX tiles", native.tiles())) if on]
    return True, f"Dew's kernel (dew._native_few_rows, {native.isa()}{''.join(', ' + b for b in bfloat16)})"


def few_rows_tiles() -> bool:
    """Whether the few-rows kernel multiplies bfloat16 products of 2 rows or more in AMX's tiles here (the CPU
    has them and Linux granted them to this process)."""
    native, _ = import_extension("few_rows")
    return native is not None and native.tiles()


def few_rows_status(policy: str | None = None) -> tuple[bool, str]:
    """(whether the few-rows kernel may run under `policy` (default the one in force) here, why or why not)."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _few_rows()


def few_rows_product(a: jax.Array, b: jax.Array, layer: jax.Array | None = None, out_dtype=_F32) -> jax.Array:
    """`a @ b` of `a` `[m, k]` and `b` `[k, n]` (with `layer`, an int32 scalar, `b[layer]` of a stack
    `[L, k, n]`, read in place), float32, in Dew's few-rows kernel: each output is `fma(a[i, k], b[k, j],
    sum)` over k in order from zero, in float32 (where `few_rows_status()` allows it). `a` is float32 with a
    float32 `b`, or bfloat16 with a bfloat16 `b` (or its uint16 bits, `dew.nn.quantize.bfloat16_bits`); a
    bfloat16 product asked for a bfloat16 `out_dtype` rounds its float32 sums once inside the call (as
    `.astype` would, without writing the float32 sums out), any other is returned float32."""
    loaded, why = _few_rows()
    if not loaded:
        raise RuntimeError(f"Dew's few-rows kernel is unavailable: {why}; use xla_product")
    stack = b if layer is not None else b[None]
    weights = _BF16 if stack.dtype == _U16 else stack.dtype
    if (a.ndim != 2 or stack.ndim != 3 or a.shape[1] != stack.shape[1] or a.dtype != weights
            or a.dtype not in (_F32, _BF16)):
        raise ValueError(f"few_rows_product takes a [m, k] and b [k, n] (with a layer, [L, k, n]), both float32 or "
                         f"both bfloat16 (b as itself or its uint16 bits); got a {a.dtype} {a.shape}, b {b.dtype} "
                         f"{b.shape}")
    target, returned = "dew_few_rows", _F32
    if a.dtype == _BF16:
        target, stack = "dew_few_rows_bf16", lax.bitcast_convert_type(stack, _U16) if stack.dtype == _BF16 else stack
        if jnp.dtype(out_dtype) == _BF16:
            target, returned = "dew_few_rows_bf16_to_bf16", _BF16
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((a.shape[0], stack.shape[2]), returned),
                            vmap_method="sequential")
    return call(a, stack, layer_index(layer))


def _takes_few_rows(m: int, k: int, n: int, dtype, policy: str, stacked: bool) -> bool:
    """Whether `[m, k] x [k, n]` of `dtype` operands (a lone weight, or with `stacked` a layer read in place)
    runs in the few-rows kernel under `policy`: the policy's choice, and the kernel allowed here."""
    if jnp.dtype(dtype) == _BF16 and m > FEW_ROWS:
        chosen = stacked and choose_bfloat16_prefill(m, k, n, policy, few_rows_tiles())
    elif jnp.dtype(dtype) == _BF16:
        chosen = choose_bfloat16_few_rows(m, k, n, policy, few_rows_tiles())
    else:
        chosen = (choose_stacked_few_rows if stacked else choose_few_rows)(m, k, n, policy)
    return chosen and few_rows_status(policy)[0]


def layer_index(layer: jax.Array | None) -> jax.Array:
    """The int32 scalar a kernel's layer operand takes: `layer`, or 0 for a lone weight (a stack of one)."""
    return jnp.zeros((), jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(())


def stacked_takes(a: jax.Array, stack: jax.Array, policy: str | None = None) -> bool:
    """Whether `stacked_product` reads a layer of `stack` in place for `a` under `policy` (default the one in
    force) here: `a` `[m, k]` of at most `FEW_ROWS` rows (a decode step's), `stack` `[L, k, n]` of `a`'s
    dtype (float32, or bfloat16 as itself or as its uint16 bits), and the few-rows kernel or oneDNN
    available; or a bfloat16 `a` of more rows (a prefill's) where `choose_bfloat16_prefill` sends it to the
    kernel's AMX body. Elsewhere the caller indexes the layer out (a copy XLA makes) and takes `product`."""
    weights = _BF16 if stack.dtype == _U16 else stack.dtype
    if (a.ndim != 2 or stack.ndim != 3 or a.dtype != weights or a.dtype not in (_F32, _BF16)
            or a.shape[1] != stack.shape[1] or min(*a.shape, stack.shape[2]) == 0):
        return False
    takes = _takes_few_rows(a.shape[0], a.shape[1], stack.shape[2], a.dtype, in_force(policy), stacked=True)
    return takes or (a.shape[0] <= FEW_ROWS and status(a.dtype, policy)[0])


def stacked_product(a: jax.Array, stack: jax.Array, layer: jax.Array, out_dtype=jnp.float32,
                    policy: str | None = None) -> jax.Array:
    """`a @ stack[layer]` accumulated in float32, returned as `out_dtype` (rounded once), reading the layer
    in place where `stacked_takes` says so: a scanned decoder's layers hold their weights stacked, and
    XLA's CPU backend copies a layer's weight out of the stack before each product, every decode step.
    The product is the few-rows kernel where the policy chooses it for a stacked layer
    (`choose_stacked_few_rows`, `choose_bfloat16_few_rows`, and past `FEW_ROWS` rows
    `choose_bfloat16_prefill`), else oneDNN's gemm, even where the table would
    keep XLA's dot (that dot comes after the copy): up to `FEW_ROWS` rows in bfloat16, and in float32 where
    the table chooses the kernel, the call `product` makes for the layer's weight alone, so the same numbers
    (past them, the AMX body's own order of the same sums). Elsewhere: `product` of the indexed layer."""
    policy = in_force(policy)
    if not stacked_takes(a, stack, policy):
        weight = stack[layer]
        if weight.dtype == _U16:
            weight = lax.bitcast_convert_type(weight, jnp.bfloat16)
        return product(a, weight.astype(a.dtype), out_dtype=out_dtype, policy=policy)
    (m, k), n = a.shape, stack.shape[2]
    key = product_key(1, m, k, n, a.dtype, False, False, out_dtype)
    if _takes_few_rows(m, k, n, a.dtype, policy, stacked=True):
        note(key, "dew")
        # A prefill's many rows round their sums inside the call rather than write float32 sums out for XLA to
        # read back; a decode step's few rows keep float32 sums, rounded inside XLA's next fusion.
        inside = out_dtype if m > FEW_ROWS else _F32
        return few_rows_product(a, stack, layer, inside).astype(out_dtype)
    note(key, "onednn")
    return onednn_stacked_product(a, stack, layer, out_dtype)


def gated_takes(a: jax.Array, gate_stack: jax.Array, up_stack: jax.Array, policy: str | None = None) -> bool:
    """Whether `stacked_gated_product` computes a gated feed-forward's `act(a @ gate) * (a @ up)` in one call
    under `policy` (default the one in force) here: a bfloat16 `a` of more than `FEW_ROWS` rows (a
    prefill's), both products read in place in the kernel's AMX body (`stacked_takes`,
    `policy.choose_bfloat16_prefill`) from stacks of one shape."""
    return (a.ndim == 2 and a.dtype == _BF16 and a.shape[0] > FEW_ROWS and gate_stack.shape == up_stack.shape
            and stacked_takes(a, gate_stack, policy) and stacked_takes(a, up_stack, policy))


@functools.cache
def activation_table(activation: Callable[[jax.Array], jax.Array]) -> np.ndarray:
    """`activation(float32(b))` rounded to bfloat16 for each of the 65,536 bfloat16s `b`, by their bits, as
    uint16 `[65538]` (two zeros past the end, which the kernel's 32-bit gather reads), computed by XLA on this
    CPU: the values XLA's fusion of the activation gives a rounded gate, whatever XLA's elementwise code is."""
    with jax.ensure_compile_time_eval():
        gates = lax.bitcast_convert_type(jnp.arange(65536, dtype=jnp.uint32).astype(jnp.uint16), jnp.bfloat16)
        values = activation(gates.astype(jnp.float32)).astype(jnp.bfloat16)
        bits = np.asarray(jax.device_get(lax.bitcast_convert_type(values, jnp.uint16)))
    return np.concatenate([bits, np.zeros(2, np.uint16)])


def stacked_gated_product(a: jax.Array, gate_stack: jax.Array, gate_layer: jax.Array, up_stack: jax.Array,
                          up_layer: jax.Array, activation: Callable[[jax.Array], jax.Array],
                          policy: str | None = None) -> jax.Array:
    """`activation(a @ gate_stack[gate_layer]) * (a @ up_stack[up_layer])` in bfloat16 `[m, n]`, each layer read
    in place, in one call of the kernel's AMX body where `gated_takes` says so: the same bits as the two
    `stacked_product`s rounded to bfloat16 and XLA's elementwise `activation` (float32 in, rounded to bfloat16)
    times up, rounded (`dew.nn.mlp.GatedMLP`), without writing the two products out and reading them back. The
    activation is looked up by the rounded gate's bits in `activation_table(activation)`."""
    policy = in_force(policy)
    if not gated_takes(a, gate_stack, up_stack, policy):
        raise ValueError(f"the gated product of a {a.dtype} {a.shape} and stacks {gate_stack.dtype} "
                         f"{gate_stack.shape}, {up_stack.dtype} {up_stack.shape} does not run in the kernel here "
                         f"(gated_takes): take two stacked_products and the activation after them")
    (m, k), n = a.shape, gate_stack.shape[2]
    note(product_key(1, m, k, n, a.dtype, False, False, a.dtype), "dew")
    bits = [lax.bitcast_convert_type(s, _U16) if s.dtype == _BF16 else s for s in (gate_stack, up_stack)]
    call = jax.ffi.ffi_call("dew_few_rows_bf16_gated", jax.ShapeDtypeStruct((m, n), _BF16), vmap_method="sequential")
    return call(a, bits[0], layer_index(gate_layer), bits[1], layer_index(up_layer),
                jnp.asarray(activation_table(activation)))


def onednn_stacked_product(a: jax.Array, stack: jax.Array, layer: jax.Array, out_dtype=_F32) -> jax.Array:
    """`a @ stack[layer]` in oneDNN's gemm reading the layer where it lies in `stack` (`[L, k, n]` of `a`'s
    dtype, bfloat16 as itself or its uint16 bits), whatever the rows (where `status()` allows it): the call
    `onednn_product` makes for the layer's weight alone."""
    returned = jnp.dtype(out_dtype) if (a.dtype, jnp.dtype(out_dtype)) in _TARGETS else _F32
    call = jax.ffi.ffi_call(_TARGETS[a.dtype, returned].replace("dew_gemm_", "dew_gemm_stacked_"),
                            jax.ShapeDtypeStruct((a.shape[0], stack.shape[2]), returned), vmap_method="sequential")
    return call(a, stack, layer_index(layer)).astype(out_dtype)


def xla_product(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool, out_dtype=_F32,
                cpu_layout: bool = False) -> jax.Array:
    """`op(a) @ op(b)` as XLA's `dot_general` accumulated in float32; with `cpu_layout`, a transposed `a`
    laid out as its own array first (XLA's CPU backend sends a dot contracting the leading axis of both
    operands to Eigen, and a plain one to its faster matmul; the barrier keeps XLA from folding the
    transpose back into the dot)."""
    contract_a = a.ndim - 2 if transpose_a else a.ndim - 1
    if transpose_a and cpu_layout:
        a, contract_a = lax.optimization_barrier(jnp.swapaxes(a, -1, -2)), a.ndim - 1
    contract_b = b.ndim - 1 if transpose_b else b.ndim - 2
    batch = tuple(range(a.ndim - 2))
    out = lax.dot_general(a, b, (((contract_a,), (contract_b,)), (batch, batch)), preferred_element_type=_F32)
    return out.astype(out_dtype)


def onednn_product(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool, out_dtype=_F32) -> jax.Array:
    """`op(a) @ op(b)` in oneDNN's gemm (where `status()` allows it)."""
    m = a.shape[-1] if transpose_a else a.shape[-2]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    returned = jnp.dtype(out_dtype) if (a.dtype, jnp.dtype(out_dtype)) in _TARGETS else _F32
    out = jax.ShapeDtypeStruct((*a.shape[:-2], m, n), returned)
    call = jax.ffi.ffi_call(_TARGETS[a.dtype, returned], out, vmap_method="broadcast_all")
    return call(a, b, transpose_a=transpose_a, transpose_b=transpose_b).astype(out_dtype)


def product(a: jax.Array, b: jax.Array, transpose_a: bool = False, transpose_b: bool = False,
            out_dtype=jnp.float32, policy: str | None = None) -> jax.Array:
    """`op(a) @ op(b)` accumulated in float32 and returned as `out_dtype` (rounded once), `op`
    transposing the last two axes where asked; `a` and `b` share a dtype and any leading (batch) axes.
    oneDNN runs it where `policy` (default the one in force) chooses it, else XLA."""
    if a.dtype != b.dtype:
        raise ValueError(f"product of {a.dtype} and {b.dtype}: cast the operands to one dtype first")
    k = a.shape[-2] if transpose_a else a.shape[-1]
    if k != (b.shape[-1] if transpose_b else b.shape[-2]):
        raise ValueError(f"product of {a.shape} and {b.shape} (transpose_a={transpose_a}, "
                         f"transpose_b={transpose_b}): the contracted axes differ")
    policy = in_force(policy)
    m = a.shape[-1] if transpose_a else a.shape[-2]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    batch = int(np.prod(a.shape[:-2], dtype=np.int64))
    key = product_key(batch, m, k, n, a.dtype, transpose_a, transpose_b, out_dtype)
    few_rows_dtype = a.dtype == _BF16 or (a.dtype == _F32 and jnp.dtype(out_dtype) == _F32)
    if (a.ndim == 2 and few_rows_dtype and not (transpose_a or transpose_b) and min(m, k, n) > 0
            and _takes_few_rows(m, k, n, a.dtype, policy, stacked=False)):
        note(key, "dew")
        return few_rows_product(a, b).astype(out_dtype)
    if ((a.dtype, _F32) in _TARGETS and min(batch, m, k, n) > 0 and status(a.dtype, policy)[0]
            and choose_onednn(batch, m, k, n, a.dtype, transpose_a, transpose_b, out_dtype, policy)):
        note(key, "onednn")
        return onednn_product(a, b, transpose_a, transpose_b, out_dtype)
    note(key, "xla")
    return xla_product(a, b, transpose_a, transpose_b, out_dtype, cpu_layout=cpu_tuned(policy))


def dot(a: jax.Array, b: jax.Array, transpose_b: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """`a @ op(b)` over the last two axes (leading axes batch), in the operands' dtype accumulated in
    float32, returned as `out_dtype` (float32 unless asked), with `op` transposing `b` where asked. Its
    gradients are the same kind of product, with the output gradient cast to the operands' dtype and
    each gradient rounded once to its operand's dtype, which autodiff of a mixed-precision
    `dot_general` does not give; every one goes through `product` under the policy in force here."""
    return _dot(a, b, transpose_b, jnp.dtype(out_dtype), in_force())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dot(a, b, transpose_b, out_dtype, policy):
    return product(a, b, transpose_b=transpose_b, out_dtype=out_dtype, policy=policy)


def _dot_fwd(a, b, transpose_b, out_dtype, policy):
    # the product itself, not `_dot` again: a remat policy (`checkpoint_dots`) sees the dot_general it saves
    return product(a, b, transpose_b=transpose_b, out_dtype=out_dtype, policy=policy), (a, b)


def _dot_bwd(transpose_b, out_dtype, policy, residuals, g):
    # The backward is traced after the forward's `using` has closed: the policy rides along as a static.
    a, b = residuals
    g = g.astype(a.dtype)
    if transpose_b:  # c = a b^T: da = g b, db = g^T a
        da = product(g, b, out_dtype=a.dtype, policy=policy)
        db = product(g, a, transpose_a=True, out_dtype=b.dtype, policy=policy)
    else:  # c = a b: da = g b^T, db = a^T g
        da = product(g, b, transpose_b=True, out_dtype=a.dtype, policy=policy)
        db = product(a, g, transpose_a=True, out_dtype=b.dtype, policy=policy)
    return da, db


_dot.defvjp(_dot_fwd, _dot_bwd)
