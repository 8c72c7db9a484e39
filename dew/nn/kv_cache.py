"""The KV cache: one length per row, and per run of layers the keys and values of every layer in it.

Each row holds its own tokens from slot 0 in order: `lengths[b]` slots of row `b` are filled, and
its next token goes to slot `lengths[b]`. A prompt's padding is never written, so padded slots take
no cache and rows of different lengths decode side by side. Arrays are heads-major,
`[layers, rows, kv_heads, capacity, head_dim]`, the layout attention reads, so a decode step reads a
layer's cache in place. A bfloat16 cache holds its values' uint16 bits: XLA's CPU backend widens a bfloat16
dynamic-update-slice to float32 over the whole operand (a copy of every layer's cache at each write), and
updates a uint16 one in place; `read` gives bfloat16 back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def stored(x: jax.Array, storage) -> jax.Array:
    """`x` in a cache array's `storage` dtype: bfloat16 bits as uint16 where the cache holds those."""
    if jnp.dtype(storage) == jnp.uint16:
        return x if x.dtype == jnp.uint16 else jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(storage)


def loaded(x: jax.Array) -> jax.Array:
    """A cache array's values in their own dtype (uint16 bits read as bfloat16)."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


@struct.dataclass
class AttentionCache:
    """Keys and values of a run of attention layers, `[L, B, K, T, D]` each (uint16 bits for bfloat16)."""

    keys: jax.Array
    values: jax.Array

    @classmethod
    def empty(cls, layers: int, rows: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "AttentionCache":
        shape = (layers, rows, kv_heads, capacity, head_dim)
        storage = jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else dtype
        return cls(keys=jnp.zeros(shape, storage), values=jnp.zeros(shape, storage))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def write(self, layer, slots_BS: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array) -> "AttentionCache":
        """Store token `s` of row `b` at slot `slots_BS[b, s]` of layer `layer`; a slot at or past the
        capacity (how padding is marked) is dropped."""
        rows_B1 = jnp.arange(slots_BS.shape[0])[:, None]
        put = lambda into, new_BSKD: into.at[layer, rows_B1, :, slots_BS, :].set(stored(new_BSKD, into.dtype),
                                                                                mode="drop")
        return AttentionCache(keys=put(self.keys, k_BSKD), values=put(self.values, v_BSKD))

    def read(self, layer, rows: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s keys and values, `[B, K, T, D]` each: of the first `rows` rows when given (a
        step over a server's first rows reads and `write`s a larger cache in place)."""
        return loaded(self.keys[layer, :rows]), loaded(self.values[layer, :rows])

    def take_rows(self, rows_R: jax.Array, width: int) -> "AttentionCache":
        """A cache of rows `rows_R` of this one, their first `width` slots (what `put_row_slices` puts back).
        Each row is a slice of its own, laid out as it is here (a gather would put the rows outermost, and
        lay them out again)."""
        def take(big):
            L, _, K, _, D = big.shape
            return jnp.concatenate([jax.lax.dynamic_slice(big, (0, rows_R[r], 0, 0, 0), (L, 1, K, width, D))
                                    for r in range(rows_R.shape[0])], axis=1)
        return AttentionCache(keys=take(self.keys), values=take(self.values))

    def put_row_slices(self, rows_R: jax.Array, new: "AttentionCache") -> "AttentionCache":
        """This cache with the first slots of rows `rows_R` replaced by the rows of `new` (each row in place,
        the last first: a row named twice keeps the earlier one's)."""
        def put(big, rows):
            for r in reversed(range(rows_R.shape[0])):
                big = jax.lax.dynamic_update_slice(big, stored(rows[:, r: r + 1], big.dtype), (0, rows_R[r], 0, 0, 0))
            return big
        return AttentionCache(keys=put(self.keys, new.keys), values=put(self.values, new.values))

    def put_rows(self, rows_R: jax.Array, new: "AttentionCache") -> "AttentionCache":
        """This cache with rows `rows_R` replaced by the rows of `new` (a cache of `R` rows and at most
        this capacity, filling the first slots); a row index past the last is dropped."""
        put = lambda big, rows: big.at[:, rows_R, :, :rows.shape[3]].set(stored(rows, big.dtype), mode="drop")
        return AttentionCache(keys=put(self.keys, new.keys), values=put(self.values, new.values))


@struct.dataclass
class Cache:
    """The whole model's cache: `runs` holds one mixer cache per run of layers (`AttentionCache` for
    attention, `dew.nn.mla.LatentCache` for latent attention: each mixer owns its layout and says its
    `capacity`), `lengths` the filled slots of each row, int32 `[B]`.

    `groups` (int32 `[B, T]`, or None for a model that takes no images) numbers the image behind each
    slot (-1 for text), ids unique within a row, so a later call's image tokens still read their own
    image's cached keys in both directions and nothing else's.

    `rotary_delta` (int32 `[B]`, or None for a model without three-axis rotary positions) is what each
    row's next rotary position exceeds its filled length by: images advance the three-axis positions
    by their grid's side, not their token count, so a decode step's rotary positions are its slots plus
    this (transformers' `rope_deltas`).

    `fresh` (static) promises that no row holds a token yet, as in a cache just made by `init_cache`:
    a prefill into it lets causal attention skip, for each block of queries, the key slots past the
    block (every row's token `i` lands in slot `i` or before). The cache a call returns is never fresh.
    """

    runs: tuple
    lengths: jax.Array
    fresh: bool = struct.field(pytree_node=False, default=False)
    groups: jax.Array | None = None
    rotary_delta: jax.Array | None = None

    @property
    def rows(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.runs[0].capacity

    def reset(self, rows_B: jax.Array) -> "Cache":
        """Empty the rows where `rows_B` is true (their slots are reused; nothing else changes)."""
        emptied = self.replace(lengths=jnp.where(rows_B, 0, self.lengths))
        if self.rotary_delta is None:
            return emptied
        return emptied.replace(rotary_delta=jnp.where(rows_B, 0, self.rotary_delta))
