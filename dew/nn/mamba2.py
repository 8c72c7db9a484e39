"""Mamba2 (state space duality, SSD) as a decoder layer's mixer, with a fixed-size recurrent cache.

A layer projects its input into a gate `z` (`I = heads * head_dim` features), `xBC` (the scan's input
`x` `[I]` and the groups' `B` and `C` `[groups * state]` each) and one time step `dt` per head
(`in_proj`); `xBC` goes through a causal depthwise convolution of `conv_kernel` taps with a bias
(`conv1d`) and SiLU; per head h, with `A = -exp(A_log)` and `dt = softplus(dt + dt_bias)` clamped to
`time_step_limit`, the state `S` `[head_dim, state]` runs

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t,      y_t = S_t C_t + D * x_t

(the heads of a group share its `B` and `C`); then `y * silu(z)` is normalized per group of
`I / groups` features (transformers' `Mamba2RMSNormGated`, which is mamba_ssm's `RMSNormGated` with
`group_size = I / ngroups`, `norm_before_gate=False`), scaled by `norm`, and projected back
(`out_proj`). Names follow transformers' `Mamba2Mixer`.

A whole sequence runs in the chunked form (`ssd`): within each chunk of `chunk_size` positions the
recurrence is a masked product like attention's, and a scan over chunks carries the state between
them. One code path serves training, prefill and decode (a one-token call is one chunk of one).
Padding (segment 0) never enters a convolution window or the state: the convolution runs over each
row's real tokens in order, and a padded position has `dt = 0`, which leaves the state untouched.
A packed row's documents (segment ids) do not see each other: the convolution reads only taps of the
same document, and the state restarts at each document's first token.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear, named
from dew.nn.recurrent import ConvKernel, NormScale, RecurrentCache, causal_conv, document_starts, initial_state

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Mamba2:
    """The shape of the Mamba2 mixers of a decoder (`DecoderConfig.recurrent`), transformers'
    `Mamba2Config` names: `num_heads` heads of `head_dim` channels (`I = num_heads * head_dim`),
    `state_size` state features per channel, `n_groups` groups of heads sharing `B` and `C`,
    `conv_kernel` taps, `chunk_size` positions per chunk of the scan, biases on the projections
    (`use_bias`) and the convolution (`use_conv_bias`), and the clamp of each time step
    (`time_step_limit`, `(low, high)`; None for no upper bound)."""

    num_heads: int = 8
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float | None] = (0.0, None)

    def __post_init__(self):
        object.__setattr__(self, "time_step_limit", tuple(self.time_step_limit))
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"mamba2 {name} is {getattr(self, name)}; it must be at least 1")
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba2 num_heads {self.num_heads} is not a multiple of n_groups {self.n_groups}: "
                             "every group of B and C must serve the same number of heads")
        if len(self.time_step_limit) != 2:
            raise ValueError(f"mamba2 time_step_limit is {self.time_step_limit}; it is (low, high), high None for "
                             "no bound")

    @property
    def inner(self) -> int:
        """`I`: the features of the scan's input, gate and output."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: `x`, `B` and `C`."""
        return self.inner + 2 * self.n_groups * self.state_size

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A row's state: `[heads, head_dim, state]`."""
        return self.num_heads, self.head_dim, self.state_size

    def mixer(self, *, norm_eps: float, dtype, param_dtype, name: str) -> "Mamba2Mixer":
        return Mamba2Mixer(self, norm_eps, dtype, param_dtype, name=name)


def _segsum(a_BcHL: jax.Array) -> jax.Array:
    """`out[..., i, j] = a[j+1] + ... + a[i]` for `j <= i` (0 elsewhere), `[..., L, L]`: each sum taken
    over its own terms (a masked cumulative sum, as transformers' `segment_sum`), not as a difference
    of prefix sums, which loses the small sums to the large ones."""
    L = a_BcHL.shape[-1]
    strictly_below = jnp.tril(jnp.ones((L, L), bool), -1)
    terms = jnp.where(strictly_below, a_BcHL[..., :, None], 0.0)  # [..., i, j]: a_i where i > j
    return jnp.cumsum(terms, axis=-2)


def ssd(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, starts_BS, state_BHPN, chunk: int):
    """The scan of one layer over a sequence in chunks of `chunk` positions (fewer when the sequence
    is shorter): `(y [B, S, H, P], final state [B, H, P, N])`, without the `D` skip, in the dtype of
    `x` (float32 in the model; float64 for reference checks). `dt` is the discretized time step (0
    leaves the state as it is), `starts_BS` marks the tokens whose state restarts (a document's
    first), `state_BHPN` is the state before the first position. Heads `g * H/G ... (g+1) * H/G - 1`
    read group g's `B` and `C`."""
    Bn, S, H, P = x_BSHP.shape
    G, N = B_BSGN.shape[2:]
    R = H // G
    L = min(chunk, S)
    pad = (-S) % L
    c = (S + pad) // L
    chunked = lambda t: jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)).reshape(Bn, c, L, *t.shape[2:])
    x_BcLGRP = chunked(x_BSHP * dt_BSH[..., None]).reshape(Bn, c, L, G, R, P)
    a_BcHL = jnp.moveaxis(chunked(dt_BSH * A_H), 2, 3)
    B_BcLGN, C_BcLGN = chunked(B_BSGN), chunked(C_BSGN)
    # Restarts as counts: two positions of a chunk share a document when no start lies between them.
    restarts_BcL = jnp.cumsum(chunked(starts_BS.astype(jnp.int32)), axis=2)
    cum_BcHL = jnp.cumsum(a_BcHL, axis=-1)

    # within each chunk: y_i = sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j
    same_BcLL = restarts_BcL[:, :, :, None] == restarts_BcL[:, :, None, :]
    causal = jnp.tril(jnp.ones((L, L), bool))
    decay_BcHLL = jnp.where(causal & same_BcLL[:, :, None], jnp.exp(_segsum(a_BcHL)), 0.0)
    decay_BcGRLL = decay_BcHLL.reshape(Bn, c, G, R, L, L)
    scores_BcGLL = jnp.einsum("bclgn,bcsgn->bcgls", C_BcLGN, B_BcLGN)
    y_BcLGRP = jnp.einsum("bcgls,bcgrls,bcsgrp->bclgrp", scores_BcGLL, decay_BcGRLL, x_BcLGRP)

    # each chunk's own contribution to the state at its end
    last_BcL = restarts_BcL[:, :, -1:]
    to_end_BcHL = jnp.exp(cum_BcHL[..., -1:] - cum_BcHL) * (restarts_BcL == last_BcL)[:, :, None]
    to_end_BcLGR = jnp.moveaxis(to_end_BcHL, 2, 3).reshape(Bn, c, L, G, R)
    own_BcGRPN = jnp.einsum("bclgn,bclgr,bclgrp->bcgrpn", B_BcLGN, to_end_BcLGR, x_BcLGRP)
    through_BcH = jnp.exp(cum_BcHL[..., -1]) * (last_BcL == 0)  # a chunk with a restart passes nothing on

    def carry(state_BGRPN, chunk_inputs):
        through_BGR, own = chunk_inputs
        return state_BGRPN * through_BGR[..., None, None] + own, state_BGRPN

    final, entering_cBGRPN = jax.lax.scan(
        carry, state_BHPN.reshape(Bn, G, R, P, N).astype(x_BSHP.dtype),
        (jnp.moveaxis(through_BcH.reshape(Bn, c, G, R), 1, 0), jnp.moveaxis(own_BcGRPN, 1, 0)))

    # the state entering each chunk, decayed to each position (unless a restart came first)
    from_start_BcHL = jnp.exp(cum_BcHL) * (restarts_BcL == 0)[:, :, None]
    from_start_BcLGR = jnp.moveaxis(from_start_BcHL, 2, 3).reshape(Bn, c, L, G, R)
    y_BcLGRP = y_BcLGRP + jnp.einsum("bclgn,cbgrpn,bclgr->bclgrp", C_BcLGN, entering_cBGRPN, from_start_BcLGR)
    return y_BcLGRP.reshape(Bn, c * L, H, P)[:, :S], final.reshape(Bn, H, P, N)


def gated_rms_norm(y_BSI, z_BSI, weight_I, groups: int, eps: float):
    """`weight * rms_normalized(y * silu(z))`, normalized per group of `I / groups` features, float32."""
    gated = y_BSI.astype(F32) * jax.nn.silu(z_BSI.astype(F32))
    grouped = gated.reshape(*gated.shape[:-1], groups, -1)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(jnp.square(grouped), axis=-1, keepdims=True) + eps)
    return weight_I.astype(F32) * grouped.reshape(gated.shape)


def _dt_bias_init(low: float = 1e-3, high: float = 0.1, floor: float = 1e-4):
    """transformers' initial `dt_bias`: the inverse softplus of time steps log-uniform in [low, high]."""
    def init(key, shape, dtype=F32):
        dt = jnp.exp(jax.random.uniform(key, shape, F32) * (math.log(high) - math.log(low)) + math.log(low))
        dt = jnp.maximum(dt, floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
    return init


class Mamba2Mixer(nn.Module):
    """One layer's Mamba2 mixer (see the module); `__call__` has attention's signature."""

    shape: Mamba2
    norm_eps: float = 1e-5
    dtype: jnp.dtype = F32
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, x_BSE, rotary, context, knobs, cache: RecurrentCache | None = None):
        s = self.shape
        Bn, S, E = x_BSE.shape
        H, P, G, N, K = s.num_heads, s.head_dim, s.n_groups, s.state_size, s.conv_kernel
        I, C = s.inner, s.conv_dim
        linear = lambda features, names, name: Linear(features, use_bias=s.use_bias, dtype=self.dtype,
                                                      param_dtype=self.param_dtype, names=names, name=name)
        param = lambda name, init, shape, names: self.param(name, named(init, names), shape, self.param_dtype)
        projected_BSF = linear(I + C + H, ("embed", "mlp"), "in_proj")(x_BSE)
        z_BSI, xBC_BSC, dt_BSH = jnp.split(projected_BSF, [I, I + C], axis=-1)

        segments_BS = context.segments_BS
        real_BS = segments_BS > 0
        conv_BKC, state_BHPN = initial_state(s, Bn, cache, context, knobs.local, self.dtype)

        kernel_KC, bias_C = ConvKernel(K, C, s.use_conv_bias, self.param_dtype, name="conv1d")()
        conv_BSC, conv_BKC = causal_conv(xBC_BSC, real_BS, segments_BS, conv_BKC, kernel_KC, bias_C)
        xBC_BSC = jax.nn.silu(conv_BSC)
        x_BSI, B_BSN, C_BSN = jnp.split(xBC_BSC, [I, I + G * N], axis=-1)

        A_H = -jnp.exp(param("A_log", lambda key, shape, dtype: jnp.log(jnp.arange(1, H + 1, dtype=dtype)), (H,),
                             ("heads",)).astype(F32))
        dt_bias_H = param("dt_bias", _dt_bias_init(), (H,), ("heads",))
        D_H = param("D", nn.initializers.ones_init(), (H,), ("heads",))
        low, high = s.time_step_limit
        dt_BSH = jnp.clip(jax.nn.softplus(dt_BSH.astype(F32) + dt_bias_H.astype(F32)), low, high)
        dt_BSH = jnp.where(real_BS[..., None], dt_BSH, 0.0)
        x_BSHP = x_BSI.reshape(Bn, S, H, P)
        y_BSHP, state_BHPN = ssd(x_BSHP, dt_BSH, A_H, B_BSN.reshape(Bn, S, G, N), C_BSN.reshape(Bn, S, G, N),
                                 document_starts(real_BS, segments_BS), state_BHPN, s.chunk_size)
        y_BSHP = y_BSHP + x_BSHP * D_H.astype(F32)[:, None]
        weight_I = NormScale(I, self.param_dtype, name="norm")()
        normed_BSI = gated_rms_norm(y_BSHP.reshape(Bn, S, I), z_BSI, weight_I, G, self.norm_eps)
        out_BSE = linear(E, ("mlp", "embed"), "out_proj")(normed_BSI.astype(self.dtype))
        if cache is not None and not context.read_only_cache:
            cache = cache.written(knobs.local, conv_BKC, state_BHPN)
        return out_BSE, cache, None
