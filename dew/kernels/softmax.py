"""Attention's masked softmax in one pass a row, forward and backward, a row's first maximum, and the whole
float32 attention pass, in Dew's own kernels (`native/softmax.cc`, the extension `dew._native_softmax`).

`masked_softmax(scores, mask, scale, out_dtype)` is `jax.nn.softmax(jnp.where(mask, scores * scale,
MASKED))` rounded to `out_dtype`, and its gradient is that expression's. XLA's CPU backend runs it as
five to seven passes over the scores, each through memory; the kernel takes each row once, while it is in
cache. Its results differ from XLA's by the exponential (a polynomial within 2 ulps, as XLA's own is) and
the order of each row's sums.

`first_max(x)` is each row's first maximum's column, as `min(where(x == max(x), column, width))` gives it
(`width` for a row holding a NaN): the loss head's argmax accuracy. XLA's CPU backend materializes that
select as an int32 array the size of the logits; the kernel reads each row once.

`attention(q, k, v, mask, scale, causal_blocks, block)` is `dew.nn.attention.attend`'s whole float32 pass
in one call a direction (scores, this softmax and the weighted values per block of query rows, each
product one single-threaded oneDNN gemm, the block's scores in cache between them), with keys and values
in the projections' `[B, T, K, D]` layout, so none of the heads' transposes either.

All three run wherever the kernel policy lets a native kernel into the step (`dew.kernels.policy`: `auto`
or `native` on the CPU backend, one device) and the extension built: one pass instead of several costs
less on any CPU, so no table decides them; the fused attention also needs oneDNN's library.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import numpy as np

from dew.kernels.loader import import_extension, onednn_functions
from dew.kernels.policy import calls_refused, note

MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: exp(MASKED - max) is 0, yet finite
_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


@functools.cache
def _load() -> tuple[bool, str]:
    native, why = import_extension("softmax")
    if native is None:
        return False, why
    for key, capsule in native.handlers().items():
        jax.ffi.register_ffi_target(f"dew_softmax_{key}", capsule, platform="cpu")
    return True, "Dew's kernel (dew._native_softmax)"


def status(policy: str | None = None) -> tuple[bool, str]:
    """(whether the softmax kernels may run under `policy` (default the one in force) in this process, why
    or why not)."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _load()


def usable(out_dtype, policy: str | None = None) -> bool:
    """Whether `masked_softmax` may run to `out_dtype` (float32 or bfloat16) under `policy` here."""
    taken = jnp.dtype(out_dtype) in (_F32, _BF16) and status(policy)[0]
    note(f"softmax/{jnp.dtype(out_dtype).name}", "dew" if taken else "xla")
    return taken


def reference(scores_BHRT: jax.Array, mask_BRT: jax.Array, scale: float, out_dtype) -> jax.Array:
    """The same softmax in XLA's operations: what the kernel computes, and what runs where it cannot."""
    x = jnp.where(mask_BRT[:, None], scores_BHRT * scale, MASKED)
    return jax.nn.softmax(x, axis=-1).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def masked_softmax(scores_BHRT: jax.Array, mask_BRT: jax.Array, scale: float, out_dtype) -> jax.Array:
    """Softmax over the last axis of float32 `scores * scale` `[B, H, R, T]`, where the boolean
    `mask` `[B, R, T]` (shared by the H heads) is true, rounded to `out_dtype`. Differentiated, the forward
    also keeps the float32 probabilities for the backward; a bfloat16 call nothing differentiates (a
    prefill) writes only the rounded ones."""
    if jnp.dtype(out_dtype) == _BF16:
        _check(scores_BHRT, mask_BRT)
        call = jax.ffi.ffi_call("dew_softmax_bf16_probs", jax.ShapeDtypeStruct(scores_BHRT.shape, _BF16),
                                vmap_method="sequential")
        return call(scores_BHRT, mask_BRT.astype(jnp.bool_), scale=np.float32(scale), masked=np.float32(MASKED))
    return _forward(scores_BHRT, mask_BRT, scale, out_dtype)[0]


def _check(scores_BHRT, mask_BRT):
    if scores_BHRT.dtype != _F32 or scores_BHRT.ndim != 4 or mask_BRT.shape != (
            scores_BHRT.shape[0], *scores_BHRT.shape[2:]):
        raise ValueError(f"masked_softmax takes float32 scores [B, H, R, T] and a mask [B, R, T]; got "
                         f"{scores_BHRT.dtype} {scores_BHRT.shape} and {mask_BRT.shape}")


def _forward(scores_BHRT, mask_BRT, scale, out_dtype):
    """(the probabilities in `out_dtype`, the probabilities in float32 for the backward)."""
    _check(scores_BHRT, mask_BRT)
    f32 = jax.ShapeDtypeStruct(scores_BHRT.shape, _F32)
    mask_BRT = mask_BRT.astype(jnp.bool_)
    if jnp.dtype(out_dtype) == _BF16:
        call = jax.ffi.ffi_call("dew_softmax_bf16", (f32, jax.ShapeDtypeStruct(scores_BHRT.shape, _BF16)),
                                vmap_method="sequential")
        probs32, probs = call(scores_BHRT, mask_BRT, scale=np.float32(scale), masked=np.float32(MASKED))
        return probs, probs32
    call = jax.ffi.ffi_call("dew_softmax_f32", f32, vmap_method="sequential")
    probs32 = call(scores_BHRT, mask_BRT, scale=np.float32(scale), masked=np.float32(MASKED))
    return probs32.astype(out_dtype), probs32


def _masked_softmax_fwd(scores_BHRT, mask_BRT, scale, out_dtype):
    probs, probs32 = _forward(scores_BHRT, mask_BRT, scale, out_dtype)
    return probs, (probs32, mask_BRT.astype(jnp.bool_))


def _masked_softmax_bwd(scale, out_dtype, residuals, g):
    probs32, mask_BRT = residuals
    target = "dew_softmax_grad_bf16" if g.dtype == _BF16 else "dew_softmax_grad_f32"
    g = g if g.dtype == _BF16 else g.astype(_F32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(probs32.shape, _F32), vmap_method="sequential")
    return call(probs32, g, mask_BRT, scale=np.float32(scale)), None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


def first_max_reference(x_NC: jax.Array) -> jax.Array:
    """Each row's first maximum's column, int32 `[N]`, in XLA's operations. A row holding a NaN has no
    one answer here: XLA's CPU reductions differ on whether a NaN is a row's maximum (its own
    reduce says so, and the select then matches nothing: `width`; YNNPACK's passes over it)."""
    width = x_NC.shape[-1]
    columns_C = jnp.arange(width, dtype=jnp.int32)
    return jnp.min(jnp.where(x_NC == jnp.max(x_NC, axis=-1, keepdims=True), columns_C, width), axis=-1)


def first_max(x_NC: jax.Array, policy: str | None = None) -> jax.Array:
    """`first_max_reference(x_NC)` for float32 `[N, C]` (C at least 1), by the kernel where `status(policy)`
    allows, else by XLA; the same integers either way (no arithmetic, only comparisons), but for a
    row holding a NaN, which the kernel answers with `C` (no column: a target there is never the
    argmax)."""
    if x_NC.ndim != 2 or x_NC.shape[1] == 0 or x_NC.dtype != _F32:
        raise ValueError(f"first_max takes float32 [N, C] with C >= 1; got {x_NC.dtype} {x_NC.shape}")
    taken = status(policy)[0]
    note("first_max", "dew" if taken else "xla")
    if not taken:
        return first_max_reference(x_NC)
    call = jax.ffi.ffi_call("dew_softmax_first_max", jax.ShapeDtypeStruct(x_NC.shape[:1], jnp.int32),
                            vmap_method="sequential")
    return call(x_NC)


@functools.cache
def _load_attention() -> tuple[bool, str]:
    loaded, why = _load()
    if not loaded:
        return False, why
    try:
        address = onednn_functions()
    except LookupError as error:
        return False, str(error)
    native, why = import_extension("softmax")
    native.set_gemm(address["dnnl_sgemm"], address["omp_set_num_threads"], address["omp_get_max_threads"])
    return True, "Dew's kernel (dew._native_softmax) with oneDNN's gemm"


def attention_status(policy: str | None = None) -> tuple[bool, str]:
    """(whether `attention` may run in Dew's kernel under `policy` here, why or why not): as `status()`,
    and oneDNN's library loaded, whose single-threaded gemm runs the kernel's products."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _load_attention()


def attention_usable(*arrays: jax.Array, policy: str | None = None) -> bool:
    """Whether `attention` may take these operands here: all float32, and `attention_status(policy)`."""
    taken = all(x.dtype == _F32 for x in arrays) and attention_status(policy)[0]
    note("attention/float32", "dew" if taken else "xla")
    return taken


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def attention(q_BSHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, mask_BST: jax.Array, scale: float,
              causal_blocks: bool, block: int) -> jax.Array:
    """`dew.nn.attention.attend(q, k, v, mask, causal_blocks=..., scale=scale, block=block)` for float32
    operands in one call a direction, keys and values `[B, T, K, D]` as the projections lay them out
    (not heads-major): the result `[B, S, H, Dv]`.

    Each block of `block` query rows of a head is scored against its keys (with `causal_blocks` only
    those up to its last row), its masked softmax taken and its values weighted while the block's
    scores are in cache, each product one single-threaded oneDNN gemm on one of XLA's threads; the
    backward does the same per key/value head. The same roundings as `attend`'s but for the products'
    order of summation."""
    return _attention(q_BSHD, k_BTKD, v_BTKD, mask_BST, scale, causal_blocks, block)[0]


def _attention(q_BSHD, k_BTKD, v_BTKD, mask_BST, scale, causal_blocks, block):
    """(the result, the probabilities the backward reads: `[B, H, P]`, each head's blocks of rows
    `[rows, keys scored]` one after another, about half of `S x T` for a causal pass)."""
    loaded, why = _load_attention()
    if not loaded:
        raise RuntimeError(f"Dew's attention kernel is unavailable: {why}; use dew.nn.attention.attend")
    B, S, H, D = q_BSHD.shape
    if not (q_BSHD.dtype == k_BTKD.dtype == v_BTKD.dtype == _F32) or k_BTKD.ndim != 4 or v_BTKD.ndim != 4:
        raise ValueError(f"attention takes float32 q [B, S, H, D], k [B, T, K, D] and v [B, T, K, Dv]; got "
                         f"{q_BSHD.dtype} {q_BSHD.shape}, {k_BTKD.dtype} {k_BTKD.shape}, {v_BTKD.dtype} {v_BTKD.shape}")
    T, K = k_BTKD.shape[1:3]
    if block < 1:
        raise ValueError(f"attention: block is {block}; it must be at least 1 query row")
    if H % K or mask_BST.shape != (B, S, T) or (causal_blocks and S > T):
        raise ValueError(f"attention: {H} query heads over {K} key/value heads, mask {mask_BST.shape} for "
                         f"queries {q_BSHD.shape} and keys {k_BTKD.shape}: the query heads must be a multiple "
                         f"of the key/value heads and the mask [B, S, T] = {(B, S, T)}"
                         + (" (causal blocks need at least as many keys as queries)" if causal_blocks else ""))
    blocks = [(start, min(start + block, S)) for start in range(0, S, block)]
    packed = sum((stop - start) * (stop if causal_blocks else T) for start, stop in blocks)
    shapes = (jax.ShapeDtypeStruct((B, S, H, v_BTKD.shape[-1]), _F32), jax.ShapeDtypeStruct((B, H, packed), _F32))
    call = jax.ffi.ffi_call("dew_softmax_attention_f32", shapes, vmap_method="sequential")
    return call(q_BSHD, k_BTKD, v_BTKD, mask_BST.astype(jnp.bool_), scale=np.float32(scale),
                masked=np.float32(MASKED), block=np.int64(block), causal_blocks=bool(causal_blocks))


def _attention_fwd(q_BSHD, k_BTKD, v_BTKD, mask_BST, scale, causal_blocks, block):
    out, probs = _attention(q_BSHD, k_BTKD, v_BTKD, mask_BST, scale, causal_blocks, block)
    return out, (q_BSHD, k_BTKD, v_BTKD, mask_BST.astype(jnp.bool_), probs)


def _attention_bwd(scale, causal_blocks, block, residuals, g):
    q, k, v, mask, probs = residuals
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, _F32) for x in (q, k, v))
    call = jax.ffi.ffi_call("dew_softmax_attention_grad_f32", shapes, vmap_method="sequential")
    dq, dk, dv = call(q, k, v, mask, probs, g.astype(_F32), scale=np.float32(scale), block=np.int64(block),
                      causal_blocks=bool(causal_blocks))
    return dq, dk, dv, None


attention.defvjp(_attention_fwd, _attention_bwd)
