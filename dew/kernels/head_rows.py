"""The logits of a few rows against the output head in Dew's kernel (`native/head_rows.cc`, the extension
`dew._native_head_rows`): float32 `[M, V]` of hidden states `[M, E]` and the head, `[V, E]` (a tied
embedding, `transposed`) or `[E, V]`, float32 with float32 or bfloat16 with bfloat16 (or its uint16 bits).

A decode step's head is the largest weight it reads (SmolLM2's tied embedding, 49,152 x 576), against a
handful of rows: the kernel streams it once for all rows, with FMAs across XLA's intra-op threads (AVX-512,
AVX2 or portable loops chosen at run time; AVX512_BF16's `vdpbf16ps` for a bfloat16 `[V, E]` head where
it is the faster), or for a bfloat16 `[V, E]` head on a CPU with AMX, in AMX's tiles on the calling thread.
Every logit is summed in a fixed order that `native/head_rows.cc` states; XLA's dot and oneDNN's gemm sum
in theirs, so the logits differ from theirs by the roundings of a sum of E terms.

It runs for at most `MAX_ROWS` rows wherever the kernel policy lets a native kernel into the step
(`dew.kernels.policy`: `auto`, `exact` or `native` on the CPU backend, one device) and the extension
built, for the heads where it measured faster than what ran before: a tied (`[V, E]`) float32 head where
the kernel's loops are AVX-512's (XLA's dot before, and still with AVX2's loops, where the dot is the
faster: `wide_takes`), and a tied bfloat16 one where AMX takes it (`amx_takes`; oneDNN's gemm before, which stays
for other bfloat16 heads: it was faster than the kernel's FMAs at 8 rows and more). An untied float32
head stays XLA's: the kernel's `[E, V]` body was slower than XLA's dot at 32 rows. Its gradient is XLA's
products (a few rows are decoding; the kernel is for the forward pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dew.kernels.loader import import_extension
from dew.kernels.policy import calls_refused, note

MAX_ROWS = 32  # the most rows the kernel takes: a decode step's batch
AMX_STEP = 32  # AMX's bfloat16 tiles take heads whose width is a multiple of this
_F32, _BF16, _U16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)


@functools.cache
def _load() -> tuple[bool, str]:
    """(whether the kernel is registered with XLA, which loops it runs or why it is not)."""
    native, why = import_extension("head_rows")
    if native is None:
        return False, why
    for key, capsule in native.handlers().items():
        jax.ffi.register_ffi_target(f"dew_head_rows_{key}", capsule, platform="cpu")
    return True, f"Dew's kernel (dew._native_head_rows, {native.isa()} loops)"


def status(policy: str | None = None) -> tuple[bool, str]:
    """(whether the head kernel may run under `policy` (default the one in force) here, why or why not)."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _load()


def _weights_dtype(weight: jax.Array):
    """The dtype `weight` holds: bfloat16 for its uint16 bits."""
    return _BF16 if weight.dtype == _U16 else jnp.dtype(weight.dtype)


def amx_takes(weight: jax.Array, transposed: bool) -> bool:
    """Whether a bfloat16 head runs in the kernel's AMX tiles here: `[V, E]` with E a multiple of
    `AMX_STEP`, on a CPU with AMX whose bodies the kernel runs (its `isa()` is `amx`)."""
    E = weight.shape[-1]
    if not (transposed and E % AMX_STEP == 0 and _load()[0]):
        return False
    from dew import _native_head_rows

    return _native_head_rows.isa() == "amx"


def wide_takes() -> bool:
    """Whether a float32 head runs in the kernel here: where its loops are AVX-512's (`isa()` avx512,
    avx512_bf16 or amx). With AVX2's 8-lane loops (an AVX2 EPYC) XLA's dot was the faster at every row
    count from 1 to 32 (docs/performance.md, "The AVX2 few-rows body"), so the head stays XLA's there."""
    if not _load()[0]:
        return False
    from dew import _native_head_rows

    return _native_head_rows.isa() not in ("avx2", "portable")


def takes(hidden_NE: jax.Array, weight: jax.Array, transposed: bool, policy: str | None = None) -> bool:
    """Whether `head_logits` of these operands runs in the kernel under `policy` (default the one in force)
    here: hidden states `[N, E]` of at most `MAX_ROWS` rows, a tied (`transposed`) head of their dtype
    (float32 where `wide_takes`, or bfloat16 as itself or its bits where `amx_takes` it) and `status(policy)`
    on. Noted in `dew.kernels.policy.recording()`."""
    dtype = _weights_dtype(weight)
    E = weight.shape[1] if transposed else weight.shape[0]
    taken = (hidden_NE.ndim == 2 and weight.ndim == 2 and hidden_NE.shape[0] <= MAX_ROWS and dtype in (_F32, _BF16)
             and jnp.dtype(hidden_NE.dtype) == dtype and hidden_NE.shape[1] == E and transposed and status(policy)[0]
             and (wide_takes() if dtype == _F32 else amx_takes(weight, transposed)))
    V = weight.shape[0] if transposed else weight.shape[-1]
    note(f"head_rows/{hidden_NE.shape[0]}x{hidden_NE.shape[-1]}x{V}/{dtype.name}", "dew" if taken else "xla")
    return taken


def head_logits(hidden_NE: jax.Array, weight: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` of hidden states `[N, E]` (float32, or bfloat16) against the head `weight` of
    the same dtype (bfloat16 as itself or its uint16 bits), `[V, E]` when `transposed` else `[E, V]`, in
    Dew's kernel; differentiable, its gradient XLA's products. Raises where the kernel is unavailable."""
    loaded, why = _load()
    if not loaded:
        raise RuntimeError(f"Dew's head kernel is unavailable: {why}; use dew.nn.head.vocab_logits under kernels='xla'")
    dtype = _weights_dtype(weight)
    E = weight.shape[1] if transposed else weight.shape[0] if weight.ndim == 2 else -1
    if hidden_NE.ndim != 2 or weight.ndim != 2 or dtype not in (_F32, _BF16) or jnp.dtype(hidden_NE.dtype) != dtype \
            or hidden_NE.shape[1] != E:
        raise ValueError(f"head_logits takes hidden states [N, E] and a head [V, E] (transposed) or [E, V] of one "
                         f"dtype, float32 or bfloat16 (or its uint16 bits); got {hidden_NE.dtype} {hidden_NE.shape} "
                         f"and {weight.dtype} {weight.shape} with transposed={transposed}")
    if weight.dtype == _U16:  # integers carry no gradient: the product of the bits alone
        return _call(hidden_NE, weight, transposed)
    return _logits(hidden_NE, weight, transposed)


def _call(hidden_NE, weight, transposed):
    V = weight.shape[0] if transposed else weight.shape[1]
    out = jax.ShapeDtypeStruct((hidden_NE.shape[0], V), jnp.float32)
    # Each dtype its own handler: a bitcast of the head inside the step would be a copy of it.
    target = {_F32: "f32", _BF16: "bf16", _U16: "bits"}[jnp.dtype(weight.dtype)]
    return jax.ffi.ffi_call(f"dew_head_rows_{target}", out, vmap_method="sequential")(hidden_NE, weight,
                                                                                     transposed=transposed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logits(hidden_NE, weight, transposed):
    return _call(hidden_NE, weight, transposed)


def _logits_fwd(hidden_NE, weight, transposed):
    return _call(hidden_NE, weight, transposed), (hidden_NE, weight)


def _logits_bwd(transposed, residuals, g_NV):
    hidden_NE, weight = residuals
    f32 = functools.partial(lax.dot_general, preferred_element_type=jnp.float32)
    g_NV = g_NV.astype(hidden_NE.dtype)
    # logits = hidden . weight^T (transposed) or hidden . weight: each gradient a product of g with the other.
    d_hidden = f32(g_NV, weight, (((1,), (0 if transposed else 1,)), ((), ())))
    d_weight = f32(g_NV, hidden_NE, (((0,), (0,)), ((), ()))) if transposed else \
        f32(hidden_NE, g_NV, (((0,), (0,)), ((), ())))
    return d_hidden.astype(hidden_NE.dtype), d_weight.astype(weight.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)
