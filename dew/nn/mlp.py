"""The gated feed-forward block: `down(act(gate(x)) * up(x))`, SwiGLU with `silu`, GeGLU with gelu.

With `sparsity` s > 0 (Gemma 3n's activation sparsity) the gate keeps only what exceeds a cutoff before the
activation: `relu(gate - (mean + std * z))` over each token's gate features, `z` the standard normal's
s-quantile, so about a fraction s of a normally spread gate is zeroed."""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import gated_takes, stacked_gated_product
from dew.nn.linear import Linear, stacked_kernel

ACTIVATIONS = {
    "silu": nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # transformers' gelu_pytorch_tanh
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # the exact erf form
}


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """A dense gated MLP of `features` hidden units, its gate's `activation`, optional biases and the gate's
    `sparsity` (see the module; 0 keeps every activation)."""

    features: int
    activation: str = "silu"
    bias: bool = False
    sparsity: float = 0.0

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation is {self.activation!r}; it must be one of {list(ACTIVATIONS)}")
        if not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"sparsity is {self.sparsity}; it is the fraction of gate activations zeroed, in [0, 1)")

    def module(self, *, dtype, param_dtype, name: str) -> "GatedMLP":
        return GatedMLP(self.features, self.activation, self.bias, self.sparsity, dtype=dtype, param_dtype=param_dtype,
                        name=name)


class GatedMLP(nn.Module):
    features: int
    activation: str = "silu"
    use_bias: bool = False
    sparsity: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, names, name: Linear(features, use_bias=self.use_bias, dtype=self.dtype,
                                                     param_dtype=self.param_dtype, names=names, name=name)
        fused = self._fused_gate(x)
        if fused is not None:
            return dense(x.shape[-1], ("mlp", "embed"), "down_proj")(fused)
        gate = dense(self.features, ("embed", "mlp"), "gate_proj")(x)
        if self.sparsity:
            gate = _gaussian_top(gate, self.sparsity)
        up = dense(self.features, ("embed", "mlp"), "up_proj")(x)
        # The activation in float32, rounded once, as torch's bfloat16 kernels compute it (and half the
        # elementwise passes of a bfloat16 chain, which XLA's CPU backend runs slowly).
        act = ACTIVATIONS[self.activation](gate.astype(jnp.float32)).astype(gate.dtype)
        return dense(x.shape[-1], ("mlp", "embed"), "down_proj")(act * up)

    def _fused_gate(self, x: jax.Array) -> jax.Array | None:
        """`act(gate(x)) * up(x)` in one kernel call where a scanned prefill reads both layers in place in the
        kernel's AMX body (`dew.kernels.matmul.gated_takes`): the same bits as the two products and the
        activation after them, without writing the products out. None elsewhere."""
        gate, up = stacked_kernel(self, "gate_proj"), stacked_kernel(self, "up_proj")
        if gate is None or up is None or self.use_bias or self.sparsity:
            return None
        x_ND = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        if not gated_takes(x_ND, gate[0], up[0]):
            return None
        return stacked_gated_product(x_ND, *gate, *up, ACTIVATIONS[self.activation]).reshape(*x.shape[:-1],
                                                                                             self.features)


def _gaussian_top(gate, sparsity: float):
    """`relu(gate - (mean + std * z))` over the last axis in float32 (the population std; `z` the standard normal's
    `sparsity`-quantile, rounded to float32), rounded back to the gate's dtype."""
    z = jnp.float32(statistics.NormalDist().inv_cdf(sparsity))
    gate32 = gate.astype(jnp.float32)
    cutoff = jnp.mean(gate32, axis=-1, keepdims=True) + jnp.std(gate32, axis=-1, keepdims=True) * z
    return jax.nn.relu(gate32 - cutoff).astype(gate.dtype)
