"""A dense KV cache: `[rows, kv_heads, capacity, head_dim]` per layer and one write cursor.

Heads-major, the layout attention reads, so a decode step reads the cache in place: with the
`[rows, capacity, ...]` layout XLA copied every layer's whole cache into this order at every step.

Rows are left-padded to a common prompt width, so every row writes its next token at the same slot;
`segments` marks which slots hold a real token (1) and which hold padding or nothing yet (0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class LayerCache:
    keys: jax.Array  # [B, K, T, D]
    values: jax.Array  # [B, K, T, D]
    segments: jax.Array  # [B, T] int32, 0 = empty or padding
    cursor: jax.Array  # int32 scalar: the slot the next token is written to

    @classmethod
    def empty(cls, rows: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "LayerCache":
        shape = (rows, kv_heads, capacity, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            segments=jnp.zeros((rows, capacity), jnp.int32),
            cursor=jnp.zeros((), jnp.int32),
        )

    def write(self, k_BSKD: jax.Array, v_BSKD: jax.Array, segments_BS: jax.Array) -> "LayerCache":
        """Store `S` new slots at the cursor and move it past them."""
        at = (0, 0, self.cursor, 0)
        heads_major = lambda x_BSKD, into: x_BSKD.transpose(0, 2, 1, 3).astype(into.dtype)
        return LayerCache(
            keys=lax.dynamic_update_slice(self.keys, heads_major(k_BSKD, self.keys), at),
            values=lax.dynamic_update_slice(self.values, heads_major(v_BSKD, self.values), at),
            segments=lax.dynamic_update_slice(self.segments, segments_BS.astype(jnp.int32), (0, self.cursor)),
            cursor=self.cursor + k_BSKD.shape[1],
        )
