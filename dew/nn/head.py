"""The output head as an object: what turns final hidden states into capped float32 logits.

A model hands its head to objectives and to generation inside its output (`ModelOutput.head`), so
nothing outside the model reads parameter paths or knows whether the head is a tied embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def vocab_logits(hidden_NE: jax.Array, weight: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` from hidden states and the head (`[E, V]`, or `[V, E]` when tied)."""
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    return jax.lax.dot_general(hidden_NE, weight, (contract, ((), ())), preferred_element_type=jnp.float32)


def cap_logits(logits: jax.Array, softcap: float | None) -> jax.Array:
    """`softcap * tanh(logits / softcap)` (Gemma 2's final cap), or the logits unchanged."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


@struct.dataclass
class Head:
    """The output projection: `weight` in the compute dtype, `[E, V]`, or `[V, E]` when `transposed`
    (a tied embedding), and the logit `softcap`. Gradients flow into the parameter it was read from.

    With int8 weights (`dew.nn.quantize`) `weight` stays int8 and `scale` holds one float32 scale per
    vocabulary entry; `logits` converts inside its product. Such a head is for generation: objectives
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
            logits_NV = vocab_logits(hidden_NE, self.weight.astype(hidden.dtype), self.transposed) * self.scale
        return cap_logits(logits_NV, self.softcap).reshape(*lead, self.vocab_size)
