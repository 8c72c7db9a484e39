"""The output head as an object: what turns final hidden states into capped float32 logits.

A model hands its head to objectives and to generation inside its output (`ModelOutput.head`), so
nothing outside the model reads parameter paths or knows whether the head is a tied embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dew.nn.int8_matmul import dequantize, int8_product, kernel_takes


def vocab_logits(hidden_NE: jax.Array, weight: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` from hidden states and the head (`[E, V]`, or `[V, E]` when tied)."""
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    return jax.lax.dot_general(hidden_NE, weight, (contract, ((), ())), preferred_element_type=jnp.float32)


# Vocabulary rows per piece of an int8 head: the piece's float copy (at most 4,096 x width x 4 bytes,
# 9 MiB at width 576) stays in cache between its conversion and its product. Converted whole, XLA's CPU
# backend writes the float head to memory and reads it back: 9x slower than float weights on SmolLM2.
_INT8_HEAD_ROWS = 4096


def _int8_vocab_logits(hidden_NE: jax.Array, q: jax.Array, scale: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` of an int8 head (`[E, V]` with scales `[G, V]`, or `[V, E]` and `[V, G]`
    when `transposed`), converted to float32 and multiplied piece by piece along the vocabulary (the
    fewest equal pieces of at most `_INT8_HEAD_ROWS`; one piece when the vocabulary does not split
    evenly into small ones), or whole in Dew's int8 kernel where it runs (`dew.nn.int8_matmul`)."""
    if kernel_takes(hidden_NE, q, hidden_NE.dtype):
        # Dew's kernel widens the int8 rows in registers: no float copy, so no pieces either.
        return int8_product(hidden_NE, q, scale, hidden_NE.dtype, transposed)
    V = q.shape[0] if transposed else q.shape[1]
    pieces = next((p for p in range(-(-V // _INT8_HEAD_ROWS), V + 1) if V % p == 0 and V // p >= 256), 1)
    rows = V // pieces
    axis = 0 if transposed else 1

    # The kernel's operands: hidden states rounded to the compute dtype, weights q * scale in float32.
    hidden_NE = hidden_NE.astype(jnp.float32)

    def piece(i):
        part = jax.lax.dynamic_slice_in_dim(q, i * rows, rows, axis)
        part_scale = jax.lax.dynamic_slice_in_dim(scale, i * rows, rows, axis)
        return vocab_logits(hidden_NE, dequantize(part, part_scale, axis=1 - axis), transposed)

    logits_PNR = jax.lax.map(piece, jnp.arange(pieces))
    return jnp.moveaxis(logits_PNR, 0, 1).reshape(hidden_NE.shape[0], V)


def cap_logits(logits: jax.Array, softcap: float | None) -> jax.Array:
    """`softcap * tanh(logits / softcap)` (Gemma 2's final cap), or the logits unchanged."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


@struct.dataclass
class Head:
    """The output projection: `weight` in the compute dtype, `[E, V]`, or `[V, E]` when `transposed`
    (a tied embedding), and the logit `softcap`. Gradients flow into the parameter it was read from.

    With int8 weights (`dew.nn.quantize`) `weight` stays int8 and `scale` holds its float32 scales per
    vocabulary entry and group of the width (`[V, G]`, or `[G, V]` untied); `logits` converts inside its
    product. Such a head is for generation: objectives
    that read `weight` directly refuse int8 variables before they get here."""

    weight: jax.Array
    transposed: bool = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False, default=None)
    scale: jax.Array | None = None

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0] if self.transposed else self.weight.shape[1]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Capped float32 logits `[..., V]` of hidden states `[..., E]` (`head_logits` in the reference)."""
        lead = hidden.shape[:-1]
        hidden_NE = hidden.reshape(-1, hidden.shape[-1])
        if self.scale is None:
            logits_NV = vocab_logits(hidden_NE.astype(self.weight.dtype), self.weight, self.transposed)
        else:
            logits_NV = _int8_vocab_logits(hidden_NE, self.weight, self.scale, self.transposed)
        return cap_logits(logits_NV, self.softcap).reshape(*lead, self.vocab_size)
