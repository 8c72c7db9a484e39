"""RMSNorm in the three roundings transformers' decoders use, computed in float32.

- `"llama"` (Llama, Mistral, Qwen): the normalised input is rounded to the compute dtype, then
  multiplied by `scale`; `scale` starts at one.
- `"olmo"` (OLMo 2): `scale * x_hat` in float32, rounded once.
- `"gemma"` (Gemma 1-3): `(1 + scale) * x_hat` in float32, rounded once; `scale` starts at zero.

In float32 the first two agree; in bf16 they round at different points, as the families do.
`normalize` is the norm without a scale (Gemma 4's values, router input and self-conditioning).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

NORM_STYLES = ("llama", "olmo", "gemma")


def _normalized32(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def normalize(x: jax.Array, eps: float) -> jax.Array:
    """`x / rms(x)` over the last axis in float32, rounded back to `x`'s dtype (transformers' RMSNorm
    `with_scale=False`)."""
    return _normalized32(x, eps).astype(x.dtype)


class RMSNorm(nn.Module):
    """`x / rms(x)` times the learned `scale` over the last axis, in the rounding of `style`."""

    eps: float = 1e-6
    style: str = "llama"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros_init() if self.style == "gemma" else nn.initializers.ones_init()
        scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (x.shape[-1],), self.param_dtype)
        normed = _normalized32(x, self.eps)
        if self.style == "llama":
            return (scale.astype(self.dtype) * normed.astype(self.dtype)).astype(self.dtype)
        weight = scale.astype(jnp.float32) + (1.0 if self.style == "gemma" else 0.0)
        return (weight * normed).astype(self.dtype)
