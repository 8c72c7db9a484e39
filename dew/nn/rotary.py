"""Rotary position embeddings in the rotate-half layout transformers' Llama uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary_angles(positions_BS: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables, float32 `[B, S, head_dim]`, for integer positions `[B, S]`."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq_F = 1.0 / (theta**exponents)
    freqs_BSF = positions_BS.astype(jnp.float32)[..., None] * inv_freq_F
    angles_BSD = jnp.concatenate([freqs_BSF, freqs_BSF], axis=-1)
    return jnp.cos(angles_BSD), jnp.sin(angles_BSD)


def apply_rotary(x_BSHD: jax.Array, cos_BSD: jax.Array, sin_BSD: jax.Array) -> jax.Array:
    """Rotate `x` by the tables in float32 and round back to `x`'s dtype."""
    half = x_BSHD.shape[-1] // 2
    x32 = x_BSHD.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    cos, sin = cos_BSD[:, :, None, :], sin_BSD[:, :, None, :]
    return (x32 * cos + rotated * sin).astype(x_BSHD.dtype)
