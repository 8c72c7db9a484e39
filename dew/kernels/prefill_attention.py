"""A prefill's attention in one call of Dew's kernel (`native/prefill_attention.cc`, the extension
`dew._native_prefill_attention`):
queries over a run's cache read in place, scores, masked softmax and weighted values per block of query rows.

`prefill_attention(q, keys, values, layer, mask, scale)` is `dew.nn.attention.attend(q, keys[layer, :B],
values[layer, :B], mask, scale=scale, heads_major=True)` for queries `[B, H, S, D]` over layer `layer` of a
cache `[L, C, K, T, D]`: each block of 16 query rows of a key/value head (the query heads sharing it together)
is scored only against the keys between the block's first and last allowed ones, so a prefill at an offset
reads the filled slots, not the cache's capacity, and a fresh one the keys up to each block's end. Its
roundings are `attend`'s (scores and softmax in float32, probabilities rounded to the cache's dtype, values
weighted in float32, the result rounded once to the queries' dtype) but for the order of the sums and the
softmax's normalizer (its reciprocal multiplies, where `attend` divides); a query the mask lets read no key
gets zeros (`attend` averages the keys it scores: a padding query, which nothing reads).

It runs wherever the kernel policy lets a native kernel into the step (`dew.kernels.policy`: `auto` or
`native` on the CPU backend, one device), the extension built and the CPU has AVX-512, for float32 queries
over a float32 cache and bfloat16 queries over a bfloat16 one, head widths multiples of `LANES`; one pass that reads fewer keys costs less on any such CPU, so no table decides it.
Elsewhere `attend` runs. The kernel has no backward: `dew.nn.attention` differentiates its call as `attend`'s
(a cached pass trained through, as block diffusion's encoder is).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dew.kernels.loader import import_extension
from dew.kernels.policy import calls_refused, note

LANES = 16  # the kernel's head widths are multiples of this
_F32, _BF16, _U16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)
# queries' dtype -> the cache dtypes it reads (a bfloat16 cache holds its bits as uint16: dew.nn.kv_cache)
_PAIRS = {_F32: (_F32,), _BF16: (_BF16, _U16)}


@functools.cache
def _load() -> tuple[bool, str]:
    native, why = import_extension("prefill_attention")
    if native is None:
        return False, why
    for key, capsule in native.handlers().items():
        jax.ffi.register_ffi_target(f"dew_prefill_attention_{key}", capsule, platform="cpu")
    return True, "Dew's kernel (dew._native_prefill_attention)"


@functools.cache
def _cpu() -> tuple[bool, str]:
    loaded, why = _load()
    if not loaded:
        return False, why
    if not import_extension("prefill_attention")[0].supported():
        return False, "this CPU lacks AVX-512 (F, BW, VL and DQ), which the prefill attention kernel needs"
    return True, "Dew's kernel (dew._native_prefill_attention)"


def status(policy: str | None = None) -> tuple[bool, str]:
    """(whether the prefill attention kernel may run under `policy` (default the one in force) here, why or why
    not)."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _cpu()


def usable(q_BHSD: jax.Array, keys_LCKTD: jax.Array, values_LCKTD: jax.Array, policy: str | None = None) -> bool:
    """Whether `prefill_attention` may take these operands under `policy` here: float32 queries over a
    float32 cache or bfloat16 ones over a bfloat16 (or uint16 bits) one, head widths multiples of `LANES`."""
    dtype = jnp.dtype(q_BHSD.dtype)
    taken = (keys_LCKTD.dtype in _PAIRS.get(dtype, ()) and values_LCKTD.dtype == keys_LCKTD.dtype
             and q_BHSD.shape[-1] % LANES == 0 and values_LCKTD.shape[-1] % LANES == 0 and status(policy)[0])
    note(f"prefill_attention/{dtype.name}", "dew" if taken else "xla")
    return taken


def prefill_attention(q_BHSD: jax.Array, keys_LCKTD: jax.Array, values_LCKTD: jax.Array, layer, mask_BST: jax.Array,
                      scale: float) -> jax.Array:
    """`[B, S, H, Dv]` in the queries' dtype: queries `[B, H, S, D]` over key slots `t` of layer `layer` (an int
    or int32 scalar, may be traced) of a cache, keys `[L, C, K, T, D]`, values `[L, C, K, T, Dv]` (query row `b`
    reads cache row `b` of `C >= B`), where the boolean `mask_BST` `[B, S, T]` allows; query head `h` reads
    key/value head `h // (H // K)`. Raises where the kernel is unavailable or the operands do not fit."""
    loaded, why = status()
    if not loaded:
        raise RuntimeError(f"Dew's prefill attention kernel is unavailable: {why}; use dew.nn.attention.attend")
    B, H, S, D = q_BHSD.shape
    L, C, K, T, Dv = values_LCKTD.shape
    dtype = jnp.dtype(q_BHSD.dtype)
    if (keys_LCKTD.dtype not in _PAIRS.get(dtype, ()) or values_LCKTD.dtype != keys_LCKTD.dtype
            or keys_LCKTD.shape != (L, C, K, T, D) or C < B or H % K or D % LANES or Dv % LANES):
        raise ValueError(f"prefill_attention takes q [B, H, S, D] and keys [L, C, K, T, D], values [L, C, K, T, Dv] "
                         f"of its dtype (float32, or bfloat16 whose cache may hold its bits as uint16), C >= B, H a "
                         f"multiple of K and D, Dv multiples of {LANES}; got q {q_BHSD.dtype} {q_BHSD.shape}, keys "
                         f"{keys_LCKTD.dtype} {keys_LCKTD.shape}, values {values_LCKTD.dtype} {values_LCKTD.shape}")
    if mask_BST.shape != (B, S, T):
        raise ValueError(f"prefill_attention: the mask is {mask_BST.shape}; it must be [B, S, T] = {(B, S, T)}")
    if dtype == _BF16:
        keys_LCKTD, values_LCKTD = (x if x.dtype == _U16 else jax.lax.bitcast_convert_type(x, jnp.uint16)
                                    for x in (keys_LCKTD, values_LCKTD))
    call = jax.ffi.ffi_call(f"dew_prefill_attention_{'bf16' if dtype == _BF16 else 'f32'}",
                            jax.ShapeDtypeStruct((B, S, H, Dv), dtype), vmap_method="sequential")
    return call(q_BHSD, keys_LCKTD, values_LCKTD, jnp.asarray(layer, jnp.int32), mask_BST.astype(jnp.bool_),
                scale=np.float32(scale))
