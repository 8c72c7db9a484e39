"""DeepSeek-V3's multi-token prediction: after the decoder, depth d (1-based) predicts the token d + 1
ahead of each position.

Depth d at position p reads the previous depth's state at p (the decoder's final-norm state for
d = 1) and the embedding of the token at p + d, normalises each (`hnorm`, `enorm`), projects their
concatenation, embedding first, back to the model width (`eh_proj`), runs one decoder block (`block`:
the last layer's mixer, and the mixture of experts when the model has one) at the rotary positions
of the tokens it read, and normalises the result (`shared_head/norm`), which is both the state the
next depth reads and what the shared output head scores. This is transformers' `MtpLayer` with its
post-norm, as DeepSeek's checkpoints store it (`model.layers.{num_hidden_layers + k}.*`).

Every depth keeps the sequence's length: the last d positions read past the end (a padding id) and
their targets are never counted (`dew.objectives.lm`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.layer import DecoderLayer, LayerContext, LayerKnobs, LayerSpec
from dew.nn.linear import Linear
from dew.nn.norms import RMSNorm
from dew.nn.rotary import rotary_angles


class _SharedHead(nn.Module):
    """The depth's final norm, under DeepSeek's name `shared_head.norm`."""

    eps: float
    style: str
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x_BSE):
        return RMSNorm(self.eps, self.style, dtype=self.dtype, param_dtype=self.param_dtype, name="norm")(x_BSE)


class MTPDepth(nn.Module):
    """One depth (see the module): `(state_BSE, embedded_BSE) -> state_BSE` in the compute dtype."""

    spec: LayerSpec
    index: int  # the layer number the depth's block is stored as (num_layers + depth - 1)
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, state_BSE, embedded_BSE, positions_BS, context: LayerContext):
        s = self.spec
        norm = lambda name: RMSNorm(s.norm_eps, s.norm_style, dtype=self.dtype, param_dtype=self.param_dtype,
                                    name=name)
        joined_BSF = jnp.concatenate([norm("enorm")(embedded_BSE), norm("hnorm")(state_BSE)], axis=-1)
        x_BSE = Linear(state_BSE.shape[-1], dtype=self.dtype, param_dtype=self.param_dtype, names=(None, "embed"),
                       name="eh_proj")(joined_BSF)
        width, theta, scaling = s.mixer.rope()
        cos_BSD, sin_BSD = rotary_angles(positions_BS, width, theta, scaling)
        context = context.replace(rotary={width: (cos_BSD[None], sin_BSD[None])}, report_indexer=False)
        knobs = LayerKnobs(window=None, rope=jnp.int32(0), index=jnp.int32(self.index), local=jnp.int32(0))
        (x_BSE, _, _), _ = DecoderLayer(s, self.dtype, self.param_dtype, name="block")((x_BSE, None, ()), knobs, context)
        return _SharedHead(s.norm_eps, s.norm_style, self.dtype, self.param_dtype, name="shared_head")(x_BSE)


def mtp_states(parent: nn.Module, spec: LayerSpec, depths: int, first_index: int, hidden_BSE, tokens_BS, positions_BS,
               context: LayerContext, embed, dtype, param_dtype) -> jax.Array:
    """Every depth's state, `[depths, B, S, E]`, from the decoder's final-norm states, run inside
    `parent`'s compact scope (the depths are named `mtp_0`, `mtp_1`, ...). `embed` maps token ids to
    the decoder's input embeddings."""
    B, S = tokens_BS.shape
    states, state_BSE = [], hidden_BSE
    for depth in range(1, depths + 1):
        ahead_BS = jnp.concatenate([tokens_BS[:, depth:], jnp.zeros((B, min(depth, S)), tokens_BS.dtype)],
                                   axis=1)[:, :S]
        module = MTPDepth(spec, first_index + depth - 1, dtype, param_dtype, parent=parent, name=f"mtp_{depth - 1}")
        state_BSE = module(state_BSE, embed(ahead_BS), positions_BS + depth, context)
        states.append(state_BSE)
    return jnp.stack(states)


__all__ = ["MTPDepth", "mtp_states"]
