"""The gated (SwiGLU) feed-forward block: `down(silu(gate(x)) * up(x))`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear


class GatedMLP(nn.Module):
    features: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, name: Linear(features, dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        gate = dense(self.features, "gate_proj")(x)
        up = dense(self.features, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(nn.silu(gate) * up)
