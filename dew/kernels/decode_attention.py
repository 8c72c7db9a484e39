"""Decoding's attention in Dew's kernel (`native/decode_attention.cc`, the extension
`dew._native_decode_attention`): one new query per row against that row's cached keys and values,
reading only the slots the row may attend to.

`decode_attention(q, keys, values, layer, starts, ends, scale, softcap)` is, for each row `b` and query
head `h`, `softmax(cap(scale * q[b, h] . k))` over key slots `[starts[b], ends[b])` of layer `layer`
of a run's cache (`dew.nn.kv_cache.AttentionCache`, `[L, B, K, T, D]`, float32, bfloat16, or uint16 holding bfloat16 bits), times
those slots' values, in float32; a row with no slot gets zeros. It is what `dew.nn.attention.attend`
computes for one query under the decode mask (causal over the filled slots, with a sliding window
`starts = ends - window`), but for the order of the sums: XLA's form scores all `T` slots of the
cache's capacity and masks them, so a step's attention costs the whole capacity; the kernel reads
each key and value of the filled range once, the query heads that share it together.

It runs wherever the kernel policy lets a native kernel into the step (`dew.kernels.policy`: `auto` or
`native` on the CPU backend, one device) and the extension built, for head widths that are multiples
of 8; reading fewer bytes in one pass costs less on any CPU, so no table decides it. Decoding only: it
has no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dew.kernels.loader import import_extension
from dew.kernels.policy import calls_refused, note

# uint16: bfloat16 values held as their bits (how `dew.nn.kv_cache` stores a bfloat16 cache)
_DTYPES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.uint16): "uint16"}
LANES = 8  # the kernel's head widths are multiples of this


@functools.cache
def _load() -> tuple[bool, str]:
    native, why = import_extension("decode_attention")
    if native is None:
        return False, why
    for key, capsule in native.handlers().items():
        jax.ffi.register_ffi_target(f"dew_decode_attention_{key}", capsule, platform="cpu")
    return True, "Dew's kernel (dew._native_decode_attention)"


def status(policy: str | None = None) -> tuple[bool, str]:
    """(whether the decode attention kernel may run under `policy` (default the one in force) here, why
    or why not)."""
    refused = calls_refused(policy)
    return (False, refused) if refused else _load()


def usable(keys_LBKTD: jax.Array, values_LBKTD: jax.Array, policy: str | None = None) -> bool:
    """Whether `decode_attention` may read this cache under `policy` here: keys and values float32,
    bfloat16 or uint16 (bfloat16 bits) alike, head widths multiples of `LANES`, and `status(policy)` on."""
    dtype = jnp.dtype(keys_LBKTD.dtype)
    taken = (dtype in _DTYPES and values_LBKTD.dtype == dtype and keys_LBKTD.shape[-1] % LANES == 0
             and values_LBKTD.shape[-1] % LANES == 0 and status(policy)[0])
    note(f"decode_attention/{'bfloat16' if dtype == jnp.uint16 else dtype.name}", "dew" if taken else "xla")
    return taken


def decode_attention(q_BHD: jax.Array, keys_LBKTD: jax.Array, values_LBKTD: jax.Array, layer, starts_B: jax.Array,
                     ends_B: jax.Array, scale: float, softcap: float | None = None) -> jax.Array:
    """float32 `[B, H, Dv]`: each row's query `q` `[B, H, D]` (any float dtype; taken as float32) over
    key slots `[starts_B[b], ends_B[b])` (int32, clipped to the capacity) of layer `layer` (an int or
    int32 scalar, may be traced) of a run's cache, keys `[L, C, K, T, D]` and values `[L, C, K, T, Dv]`
    of one dtype (query row `b` reads cache row `b` of `C >= B`, so a step over the first rows of a larger
    cache reads it in place); query head `h` reads key/value head `h // (H // K)`. With `softcap`, logits are
    `softcap * tanh(scale * q . k / softcap)`. Raises where the kernel is unavailable."""
    loaded, why = _load()
    if not loaded:
        raise RuntimeError(f"Dew's decode attention kernel is unavailable: {why}; use dew.nn.attention.attend")
    B, H, D = q_BHD.shape
    L, C, K, T, Dv = values_LBKTD.shape
    dtype = jnp.dtype(keys_LBKTD.dtype)
    if (dtype not in _DTYPES or values_LBKTD.dtype != dtype or keys_LBKTD.ndim != 5
            or keys_LBKTD.shape != (L, C, K, T, D) or C < B or H % K or D % LANES or Dv % LANES):
        raise ValueError(f"decode_attention takes q [B, H, D], keys [L, C, K, T, D] and values [L, C, K, T, Dv] "
                         f"of one dtype (float32, bfloat16 or its bits as uint16), C >= B, H a multiple of K and D, Dv multiples of "
                         f"{LANES}; got "
                         f"q {q_BHD.shape}, keys {keys_LBKTD.dtype} {keys_LBKTD.shape}, values {values_LBKTD.dtype} "
                         f"{values_LBKTD.shape}")
    if starts_B.shape != (B,) or ends_B.shape != (B,):
        raise ValueError(f"decode_attention: starts {starts_B.shape} and ends {ends_B.shape} must be [B] = [{B}]")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"decode_attention: softcap is {softcap}; it must be above 0, or None for no cap")
    call = jax.ffi.ffi_call(f"dew_decode_attention_{_DTYPES[dtype]}", jax.ShapeDtypeStruct((B, H, Dv), jnp.float32),
                            vmap_method="sequential")
    return call(q_BHD.astype(jnp.float32), keys_LBKTD, values_LBKTD, jnp.asarray(layer, jnp.int32),
                starts_B.astype(jnp.int32), ends_B.astype(jnp.int32), scale=np.float32(scale),
                softcap=np.float32(softcap or 0.0))
