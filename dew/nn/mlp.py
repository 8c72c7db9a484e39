"""The gated feed-forward block: `down(act(gate(x)) * up(x))`, SwiGLU with `silu`, GeGLU with gelu."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear

ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # transformers' gelu_pytorch_tanh
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # the exact erf form
}


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """A dense gated MLP of `features` hidden units, its gate's `activation` and optional biases."""

    features: int
    activation: str = "silu"
    bias: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation is {self.activation!r}; it must be one of {list(ACTIVATIONS)}")

    def module(self, *, dtype, param_dtype, name: str) -> "GatedMLP":
        return GatedMLP(self.features, self.activation, self.bias, dtype=dtype, param_dtype=param_dtype, name=name)


class GatedMLP(nn.Module):
    features: int
    activation: str = "silu"
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, names, name: Linear(features, use_bias=self.use_bias, dtype=self.dtype,
                                                     param_dtype=self.param_dtype, names=names, name=name)
        gate = dense(self.features, ("embed", "mlp"), "gate_proj")(x)
        up = dense(self.features, ("embed", "mlp"), "up_proj")(x)
        # The activation in float32, rounded once, as torch's bfloat16 kernels compute it (and half the
        # elementwise passes of a bfloat16 chain, which XLA's CPU backend runs slowly).
        act = ACTIVATIONS[self.activation](gate.astype(jnp.float32)).astype(gate.dtype)
        return dense(x.shape[-1], ("mlp", "embed"), "down_proj")(act * up)
