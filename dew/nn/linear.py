"""Linear layers as one 2-D matmul over `[B*S, D]`, with float32 accumulation for any operand dtype.

On XLA's CPU backend a 3-D einsum's weight gradient contracts two axes and gets a transposing copy of
the activation gradient in front of it; flattening to 2-D removes it (docs/performance.md). The custom
VJP keeps both backward products in the operands' dtype with float32 accumulation, which autodiff of a
mixed-precision `dot_general` does not give (`dew.kernels.matmul.dot`). The kernel policy in force
(the model's, `dew.kernels.policy`) decides which kernel runs each of the three products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from dew.kernels.blocks import blocks_product
from dew.kernels.int8 import int8_product
from dew.kernels.matmul import dot, stacked_product

# The names a linear's output carries for the remat policies (dew.nn.stack.REMAT_POLICIES): MLP_PRODUCT where
# its weight has an "mlp" axis (a feed-forward's), PRODUCT otherwise.
PRODUCT, MLP_PRODUCT = "product", "mlp_product"
QUANT_COLLECTION = "quant"  # int8 weights' float32 scales (see dew.nn.quantize), or a GGUF file's blocks
KERNEL_SCALE = "kernel_scale"
# A kernel kept in a GGUF file's quantized blocks, `[out, in / E, B]` bytes (dew.kernels.blocks), held
# in place of the float `kernel` (dew.interop.gguf_blocks).
KERNEL_BLOCKS = "kernel_blocks"
EMBED_BLOCKS = "embed_tokens_blocks"  # the token embedding's blocks `[vocab, width / E, B]` (a tied head's too)
# In a scanned run (dew.nn.stack) a layer's blocks sit whole, `[layers, out, in / E, B]`, in this
# collection, which the scan hands every layer unsliced, and `BLOCKS_LAYER` in the quant collection is the
# layer's index into them: the kernel reads its layer in place where a slice would copy it every step.
STACKED_BLOCKS = "quant_stacked"
BLOCKS_LAYER = "kernel_blocks_layer"
# For generation, a scanned run's float and int8 kernels likewise sit whole, `[layers, in, out]`, under `KERNEL` in the
# `STACKED_BLOCKS` collection (dew.nn.quantize.stacked_in_place), and their layers' indices `[layers]` under
# `KERNEL` in `STACKED_LAYER`, which the scan slices: a decode step's product reads its layer in place.
KERNEL = "kernel"
STACKED_LAYER = "stacked_layer"


def matmul(x_ND: jax.Array, w_DF: jax.Array) -> jax.Array:
    """`x @ w` in the operands' dtype, accumulated in float32, returned as float32 `[N, F]` (gradients
    likewise: `dew.kernels.matmul.dot`)."""
    return dot(x_ND, w_DF)


def stacked_kernel(module: nn.Module, name: str) -> tuple[jax.Array, jax.Array] | None:
    """(the stack `[layers, in, out]`, the layer's index) of `module`'s Linear `name` where a scanned run reads
    its float or int8 kernel in place (`STACKED_BLOCKS`), None elsewhere."""
    stack = module.variables.get(STACKED_BLOCKS, {}).get(name, {}).get(KERNEL)
    layer = module.variables.get(STACKED_LAYER, {}).get(name, {}).get(KERNEL)
    return None if stack is None or layer is None else (stack, layer)


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
        lead = x.shape[:-1]
        x_ND = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        if self.has_variable(STACKED_BLOCKS, KERNEL_BLOCKS):  # a scanned layer's blocks, read in place
            y_NF = blocks_product(x_ND, self.get_variable(STACKED_BLOCKS, KERNEL_BLOCKS), self.dtype,
                                  layer=self.get_variable(QUANT_COLLECTION, BLOCKS_LAYER))
        elif self.has_variable(QUANT_COLLECTION, KERNEL_BLOCKS):
            # A GGUF file's blocks, held in place of the float kernel, in Dew's blocks kernel: only their
            # 4.5-8.5 bits a weight stream from memory.
            y_NF = blocks_product(x_ND, self.get_variable(QUANT_COLLECTION, KERNEL_BLOCKS), self.dtype)
        elif self.has_variable(STACKED_BLOCKS, KERNEL):  # a scanned layer's kernel, read in place (a decode step's)
            stack, layer = self.get_variable(STACKED_BLOCKS, KERNEL), self.get_variable(STACKED_LAYER, KERNEL)
            if stack.dtype == jnp.int8:
                y_NF = int8_product(x_ND, stack, self.get_variable(QUANT_COLLECTION, KERNEL_SCALE), self.dtype,
                                    layer=layer)
            else:
                y_NF = stacked_product(x_ND, stack, layer, out_dtype=jnp.float32 if self.use_bias else self.dtype)
        else:
            kernel = self.param(KERNEL, named(self.kernel_init, self.names), (x.shape[-1], self.features),
                                self.param_dtype)
            if self.has_variable(QUANT_COLLECTION, KERNEL_SCALE):
                # int8 kernel, scales per output and group of inputs (dew.nn.quantize): in Dew's int8 kernel
                # only the int8 bytes stream from memory; each group's scale applies to its float32 sum.
                y_NF = int8_product(x_ND, kernel, self.get_variable(QUANT_COLLECTION, KERNEL_SCALE), self.dtype)
            else:
                if kernel.dtype == jnp.uint16:  # bfloat16 held as its bits (dew.nn.quantize.bfloat16_bits)
                    kernel = jax.lax.bitcast_convert_type(kernel, jnp.bfloat16)
                # Rounded to the compute dtype inside the product unless a float32 bias comes first.
                y_NF = dot(x_ND, kernel.astype(self.dtype), out_dtype=jnp.float32 if self.use_bias else self.dtype)
        if self.use_bias:
            bias = self.param("bias", named(nn.initializers.zeros_init(), self.names and self.names[1:]),
                              (self.features,), self.param_dtype)
            y_NF = y_NF + bias.astype(jnp.float32)
        kind = MLP_PRODUCT if "mlp" in (self.names or ()) else PRODUCT
        return checkpoint_name(y_NF.astype(self.dtype), kind).reshape(*lead, self.features)
