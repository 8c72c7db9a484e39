"""Products with an int8 weight and one float32 scale per output column: `(x @ q) * scale`.

The XLA form: the int8 operand is converted inside the fused product (float32 accumulation), and the
scale applies to the float32 result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_MATMUL = (((1,), (0,)), ((), ()))  # [N, D] x [D, F]


def int8_product(x_ND: jax.Array, q_DF: jax.Array, scale_F: jax.Array, dtype) -> jax.Array:
    """`(x @ q) * scale` as float32 `[N, F]`, `x` in the compute `dtype`, `q` int8 `[D, F]`."""
    y_NF = lax.dot_general(x_ND.astype(dtype), q_DF.astype(dtype), _MATMUL, preferred_element_type=jnp.float32)
    return y_NF * scale_F
