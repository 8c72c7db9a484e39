"""What the recurrent mixers (`dew.nn.mamba2`, `dew.nn.gated_deltanet`) share: the layer spec that wraps a
mixer's shape, the fixed-size cache of a run of such layers, and the causal depthwise convolution in
front of each scan, which reads only a row's real tokens and only those of the token's own document.

A mixer's shape (`DecoderConfig.recurrent`) says its convolution (`conv_kernel` taps over `conv_dim`
channels), the shape of its per-row state (`state_shape`) and builds its module (`mixer`); the spec
and the cache need nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from dew.nn.linear import named
from dew.nn.rotary import RopeScaling

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RecurrentSpec:
    """A layer's recurrent mixer (the layer-spec seam, as `AttentionSpec`): its `shape` (`dew.nn.mamba2.Mamba2`
    or `dew.nn.gated_deltanet.GatedDeltaNet`); nothing differs between layers."""

    shape: Any
    window: None = None  # a recurrent mixer never slides (read by the stack's per-layer knobs)

    def rope(self) -> tuple[int, float, RopeScaling]:
        """No rotary table: a width of 0."""
        return 0, 0.0, RopeScaling()

    def scan_key(self) -> "RecurrentSpec":
        return self

    def empty_cache(self, layers: int, rows: int, capacity: int, dtype) -> "RecurrentCache":
        return RecurrentCache.empty(layers, rows, capacity, self.shape, dtype)

    def module(self, *, norm_style: str, norm_eps: float, dtype, param_dtype, name: str) -> nn.Module:
        return self.shape.mixer(norm_eps=norm_eps, dtype=dtype, param_dtype=param_dtype, name=name)


@struct.dataclass
class RecurrentCache:
    """A run of recurrent layers' state, fixed in size whatever the sequence: each row's last
    `conv_kernel - 1` convolution inputs, `conv` `[L, B, K - 1, conv_dim]` in the compute dtype, and
    the scan's state, `state` float32 `[L, B, *shape.state_shape]`. `capacity` is the token slots the
    model's cache was made for (what `Cache.capacity` reports); the state does not grow with them.
    A row whose `Cache.lengths` is 0 holds nothing: its state is read as zeros (`Cache.reset`)."""

    conv: jax.Array
    state: jax.Array
    capacity: int = struct.field(pytree_node=False)

    @classmethod
    def empty(cls, layers: int, rows: int, capacity: int, shape, dtype) -> "RecurrentCache":
        return cls(conv=jnp.zeros((layers, rows, shape.conv_kernel - 1, shape.conv_dim), dtype),
                   state=jnp.zeros((layers, rows, *shape.state_shape), F32), capacity=capacity)

    def put_rows(self, rows_R: jax.Array, new: "RecurrentCache") -> "RecurrentCache":
        """This cache with rows `rows_R` replaced by the rows of `new` (a row index past the last is dropped)."""
        put = lambda big, rows: big.at[:, rows_R].set(rows.astype(big.dtype), mode="drop")
        return self.replace(conv=put(self.conv, new.conv), state=put(self.state, new.state))

    def start(self, context, layer, dtype) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s convolution inputs (in `dtype`) and state before this call's tokens: a row that
        held no token before the call (a reset one) starts from zeros."""
        real_BS = context.segments_BS > 0
        held_B = jnp.sum(context.filled_BT, axis=1) - jnp.sum(real_BS, axis=1)
        conv = jnp.where(held_B[:, None, None] > 0, self.conv[layer], 0).astype(dtype)
        held = held_B.reshape(-1, *(1,) * (self.state.ndim - 2))
        return conv, jnp.where(held > 0, self.state[layer], 0.0)

    def written(self, layer, conv_BKC, state) -> "RecurrentCache":
        """This cache with layer `layer`'s convolution inputs and state replaced."""
        return self.replace(conv=self.conv.at[layer].set(conv_BKC.astype(self.conv.dtype)),
                            state=self.state.at[layer].set(state.astype(self.state.dtype)))


def initial_state(shape, rows: int, cache: RecurrentCache | None, context, layer, dtype):
    """The convolution inputs `[B, K - 1, conv_dim]` and float32 state a layer starts this call from:
    zeros without a cache (or with one that holds nothing yet), else what the cache holds."""
    conv = jnp.zeros((rows, shape.conv_kernel - 1, shape.conv_dim), dtype)
    state = jnp.zeros((rows, *shape.state_shape), F32)
    if cache is not None and not context.fresh_cache:
        conv, state = cache.start(context, layer, dtype)
    return conv, state


def causal_conv(xBC_BSC, real_BS, segments_BS, state_BKC, kernel_KC, bias_C):
    """The depthwise causal convolution over each row's real tokens in order, continuing from
    `state_BKC` (the last `K - 1` real inputs before this call): `(outputs [B, S, C]` float32 (padding's
    are zeros), `the new state [B, K - 1, C])`. A tap reads only inputs of its token's own document (the
    state counts as the first real token's); padding is skipped, wherever it sits."""
    Bn, S, C = xBC_BSC.shape
    K = kernel_KC.shape[0]
    rows_B1 = jnp.arange(Bn)[:, None]
    # Each real token's place among its row's inputs: after the state, in order; padding goes nowhere.
    rank_BS = jnp.cumsum(real_BS, axis=1) - 1
    place_BS = jnp.where(real_BS, K - 1 + rank_BS, S + K - 1)
    inputs_BTC = jnp.concatenate([state_BKC.astype(xBC_BSC.dtype), jnp.zeros_like(xBC_BSC)], axis=1)
    inputs_BTC = inputs_BTC.at[rows_B1, place_BS].set(xBC_BSC, mode="drop")
    first_B = jnp.take_along_axis(segments_BS, jnp.argmax(real_BS, axis=1)[:, None], axis=1)
    documents_BT = jnp.concatenate([jnp.broadcast_to(first_B, (Bn, K - 1)), jnp.zeros_like(segments_BS)], axis=1)
    documents_BT = documents_BT.at[rows_B1, place_BS].set(segments_BS, mode="drop")
    own_BS = documents_BT[:, K - 1:]
    out_BSC = jnp.zeros((Bn, S, C), F32) if bias_C is None else jnp.broadcast_to(bias_C.astype(F32), (Bn, S, C))
    for k in range(K):
        same_BS = documents_BT[:, k:k + S] == own_BS
        out_BSC = out_BSC + jnp.where(same_BS[..., None], inputs_BTC[:, k:k + S].astype(F32), 0.0) * kernel_KC[k]
    out_BSC = jnp.take_along_axis(out_BSC, jnp.maximum(rank_BS, 0)[..., None], axis=1)
    out_BSC = jnp.where(real_BS[..., None], out_BSC, 0.0)
    count_B1 = jnp.sum(real_BS, axis=1, keepdims=True)
    state_BKC = jnp.take_along_axis(inputs_BTC, (count_B1 + jnp.arange(K - 1))[..., None], axis=1)
    return out_BSC, state_BKC


def document_starts(real_BS, segments_BS):
    """The real tokens whose segment differs from the row's previous real token's (the first real
    token of a call continues what the cache holds)."""
    S = real_BS.shape[1]
    last_real_BS = jax.lax.cummax(jnp.where(real_BS, jnp.arange(S), -1), axis=1)
    before_BS = jnp.concatenate([jnp.full_like(last_real_BS[:, :1], -1), last_real_BS[:, :-1]], axis=1)
    first_B1 = jnp.take_along_axis(segments_BS, jnp.argmax(real_BS, axis=1)[:, None], axis=1)
    previous_BS = jnp.where(before_BS >= 0, jnp.take_along_axis(segments_BS, jnp.maximum(before_BS, 0), axis=1),
                            first_B1)
    return real_BS & (segments_BS != previous_BS)


class ConvKernel(nn.Module):
    """The depthwise convolution's `kernel` `[C, 1, K]` (torch's layout, as checkpoints keep it) and `bias`
    `[C]` (or None); returns the kernel as `[K, C]`."""

    taps: int
    channels: int
    use_bias: bool
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        bound = 1.0 / math.sqrt(self.taps)  # torch's default for a depthwise convolution (fan-in K)
        uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
        kernel = self.param("kernel", named(uniform, ("mlp", None, None)), (self.channels, 1, self.taps),
                            self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", named(nn.initializers.zeros_init(), ("mlp",)), (self.channels,),
                              self.param_dtype)
        return kernel[:, 0, :].T, bias


class NormScale(nn.Module):
    """A gated norm's `scale` `[features]` (transformers' `norm.weight`), initially one."""

    features: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        return self.param("scale", named(nn.initializers.ones_init(), ("norm",)), (self.features,), self.param_dtype)
