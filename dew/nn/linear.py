"""Linear layers as one 2-D matmul over `[B*S, D]`, with float32 accumulation for any operand dtype.

On XLA's CPU backend a 3-D einsum's weight gradient contracts two axes and gets a transposing copy of
the activation gradient in front of it; flattening to 2-D removes it (+59-66% fp32 step speed). The
custom VJP keeps both backward products in the operands' dtype with float32 accumulation, which
autodiff of a mixed-precision `dot_general` does not give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax

from dew.nn.int8_matmul import int8_product

QUANT_COLLECTION = "quant"  # int8 weights' float32 scales (see dew.nn.quantize)
KERNEL_SCALE = "kernel_scale"
_MATMUL = (((1,), (0,)), ((), ()))  # [N, D] x [D, F]
_TRANSPOSED_B = (((1,), (1,)), ((), ()))  # [N, F] x [D, F]


@jax.custom_vjp
def matmul(x_ND: jax.Array, w_DF: jax.Array) -> jax.Array:
    """`x @ w` in the operands' dtype, accumulated in float32, returned as float32 `[N, F]`."""
    return lax.dot_general(x_ND, w_DF, _MATMUL, preferred_element_type=jnp.float32)


def _matmul_fwd(x_ND, w_DF):
    return matmul(x_ND, w_DF), (x_ND, w_DF)


def _matmul_bwd(residuals, g_NF):
    x_ND, w_DF = residuals
    g_NF = g_NF.astype(x_ND.dtype)
    dx_ND = lax.dot_general(g_NF, w_DF, _TRANSPOSED_B, preferred_element_type=jnp.float32)
    # x^T laid out as its own [D, N] array: XLA's CPU backend sends a dot that contracts the leading
    # axis of both operands to Eigen, and a plain [D, N] x [N, F] to YNNPACK, 9-13% faster for these
    # shapes on this CPU. The barrier keeps XLA from folding the transpose back into the dot.
    x_DN = lax.optimization_barrier(x_ND.T)
    dw_DF = lax.dot_general(x_DN, g_NF, _MATMUL, preferred_element_type=jnp.float32)
    return dx_ND.astype(x_ND.dtype), dw_DF.astype(w_DF.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def named(init: nn.initializers.Initializer, names: tuple[str, ...] | None):
    """`init` whose parameter carries logical axis `names` (see `dew.sharding.Rules`), or `init` as is."""
    return init if names is None else nn.with_logical_partitioning(init, names)


class Linear(nn.Module):
    """A bias-free (by default) linear map over the last axis; `kernel` is `[in, out]`.

    `names` are the kernel's logical axes, `(in, out)` (e.g. `("embed", "mlp")`); the bias takes the
    second."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernel_init: nn.initializers.Initializer = nn.initializers.normal(0.02)
    names: tuple[str, str] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", named(self.kernel_init, self.names), (x.shape[-1], self.features),
                            self.param_dtype)
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        if self.has_variable(QUANT_COLLECTION, KERNEL_SCALE):
            # int8 kernel, one scale per output: the conversion fuses into the product, so only the
            # int8 bytes stream from memory; the scale applies to the float32 result.
            y_NF = int8_product(x_ND, kernel, self.get_variable(QUANT_COLLECTION, KERNEL_SCALE), self.dtype)
        else:
            y_NF = matmul(x_ND, kernel.astype(self.dtype))
        if self.use_bias:
            bias = self.param("bias", named(nn.initializers.zeros_init(), self.names and self.names[1:]),
                              (self.features,), self.param_dtype)
            y_NF = y_NF + bias.astype(jnp.float32)
        return y_NF.astype(self.dtype).reshape(*lead, self.features)
