"""RMSNorm, computed in float32 and returned in the compute dtype (where transformers rounds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn


class RMSNorm(nn.Module):
    """`x / rms(x) * scale` over the last axis; `scale` starts at one."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        # transformers' Llama rounds the normalised input to the input dtype before the weight.
        return (scale.astype(self.dtype) * normed.astype(self.dtype)).astype(self.dtype)
