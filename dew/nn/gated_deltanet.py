"""Gated DeltaNet (the gated delta rule, as Qwen3-Next's and Qwen 3.5's "linear_attention" layers
compute it) as a decoder layer's mixer, with a fixed-size recurrent cache.

A layer projects its input (`in_proj`, one kernel whose outputs are, in order, the queries and keys of
`key_heads` heads of `key_head_dim` features, the values and the output gate `z` of `value_heads`
heads of `value_head_dim`, and per value head `b` and `a`); the queries, keys and values go through a
causal depthwise convolution of `conv_kernel` taps without bias (`conv1d`) and SiLU; queries and keys
are L2-normalized, queries scaled by `key_head_dim ** -0.5`, and value head h reads key head
`h // (value_heads / key_heads)`. With `beta = sigmoid(b)` and the log decay
`g = -exp(A_log) * softplus(a + dt_bias)`, the state `S` `[key_head_dim, value_head_dim]` of each
value head runs

    S_t = exp(g_t) S_{t-1};   S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T;   o_t = S_t^T q_t

(the delta rule: each token writes the part of its value the state does not already predict). Then
`scale * rms_normalized(o)` per head, times `silu(z)` (transformers' `Qwen3NextRMSNormGated`: norm
before gate, `norm` `[value_head_dim]` shared by the heads), and `out_proj`.

A whole sequence runs in chunks of `chunk_size` positions (`gated_delta_rule`): within a chunk the
delta rule's updates are one unit lower-triangular solve (the "UT transform"), and a scan over chunks
carries the state. One code path serves training, prefill and decode (a one-token call is a chunk of
one). Padding never enters the convolution window or the state (a padded position has `beta = 0` and
`g = 0`); a packed row's documents do not see each other (the state restarts at a document's first
token, as in `dew.nn.mamba2`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear, named
from dew.nn.recurrent import ConvKernel, NormScale, RecurrentCache, causal_conv, document_starts, initial_state

F32 = jnp.float32
L2_EPS = 1e-6  # the queries' and keys' L2 norm: x * rsqrt(sum(x^2) + eps), as transformers and fla compute it


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    """The shape of the Gated DeltaNet mixers of a decoder (`DecoderConfig.recurrent`), transformers'
    `linear_*` fields of `Qwen3NextConfig`: `key_heads` query/key heads of `key_head_dim` features,
    `value_heads` value heads of `value_head_dim` (a multiple of `key_heads`), `conv_kernel` taps and
    `chunk_size` positions per chunk of the scan (transformers' torch path uses 64; it changes only the
    order of sums)."""

    key_heads: int = 16
    value_heads: int = 32
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel: int = 4
    chunk_size: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"gated deltanet {field.name} is {getattr(self, field.name)}; it must be at least 1")
        if self.value_heads % self.key_heads:
            raise ValueError(f"gated deltanet value_heads {self.value_heads} is not a multiple of key_heads "
                             f"{self.key_heads}: every key head must serve the same number of value heads")

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values."""
        return 2 * self.key_dim + self.value_dim

    @property
    def projected(self) -> int:
        """`in_proj`'s outputs: queries, keys, values, the gate `z`, then `b` and `a` per value head."""
        return self.conv_dim + self.value_dim + 2 * self.value_heads

    @property
    def state_shape(self) -> tuple[int, int, int]:
        """A row's state: `[value_heads, key_head_dim, value_head_dim]`."""
        return self.value_heads, self.key_head_dim, self.value_head_dim

    def mixer(self, *, norm_eps: float, dtype, param_dtype, name: str) -> "GatedDeltaNetMixer":
        return GatedDeltaNetMixer(self, norm_eps, dtype, param_dtype, name=name)


def gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, starts_BS, state_BHKV, chunk: int):
    """The delta rule of one layer over a sequence in chunks of `chunk` positions (fewer when the
    sequence is shorter): `(o [B, S, H, V], final state [B, H, K, V])` in the dtype of `q` (float32 in
    the model; float64 for reference checks). Queries and keys are per value head, normalized and
    scaled; `g` is the log decay (0 keeps the state), `beta` the write strength (0 writes nothing),
    `starts_BS` marks the tokens whose state restarts, `state_BHKV` the state before the first position."""
    Bn, S, H, K = q_BSHK.shape
    V = v_BSHV.shape[-1]
    L = min(chunk, S)
    pad = (-S) % L
    c = (S + pad) // L
    dtype = q_BSHK.dtype

    def chunked(t):  # [B, S, H, ...] -> [B, c, H, L, ...]
        t = jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2)).reshape(Bn, c, L, *t.shape[2:])
        return jnp.moveaxis(t, 2, 3)

    q_BcHLK, k_BcHLK, v_BcHLV = chunked(q_BSHK), chunked(k_BSHK), chunked(v_BSHV)
    g_BcHL, beta_BcHL = chunked(g_BSH.astype(dtype)), chunked(beta_BSH.astype(dtype))
    # Restarts as counts: two positions of a chunk share a document when no start lies between them.
    starts_BcL = jnp.pad(starts_BS, [(0, 0), (0, pad)]).reshape(Bn, c, L).astype(jnp.int32)
    restarts_BcL = jnp.cumsum(starts_BcL, axis=2)
    cum_BcHL = jnp.cumsum(g_BcHL, axis=-1)

    # decay from position j to position i of a chunk, j <= i in one document: exp(g_{j+1} + ... + g_i)
    same_Bc1LL = (restarts_BcL[:, :, :, None] == restarts_BcL[:, :, None, :])[:, :, None]
    reach_Bc1LL = same_Bc1LL & jnp.tril(jnp.ones((L, L), bool))
    gap_BcHLL = cum_BcHL[..., :, None] - cum_BcHL[..., None, :]
    decay_BcHLL = jnp.where(reach_Bc1LL, jnp.exp(jnp.where(reach_Bc1LL, gap_BcHLL, 0.0)), 0.0)
    from_start_BcHL = jnp.exp(cum_BcHL) * (restarts_BcL == 0)[:, :, None]
    last_BcL = restarts_BcL[:, :, -1:]
    to_end_BcHL = jnp.exp(cum_BcHL[..., -1:] - cum_BcHL) * (restarts_BcL == last_BcL)[:, :, None]
    through_BcH = jnp.exp(cum_BcHL[..., -1]) * (last_BcL == 0)  # a chunk with a restart passes nothing on

    # The chunk's updates delta solve (I + A) delta = beta v - beta k (from_start * S_0)^T, A the strictly
    # lower beta_i (k_i . k_j) decay_ij: delta = u - w S_0.
    k_beta_BcHLK = k_BcHLK * beta_BcHL[..., None]
    below = jnp.tril(jnp.ones((L, L), dtype), -1)
    A_BcHLL = jnp.einsum("bchik,bchjk->bchij", k_beta_BcHLK, k_BcHLK) * decay_BcHLL * below
    solve = lambda rhs: jax.lax.linalg.triangular_solve(A_BcHLL, rhs, left_side=True, lower=True, unit_diagonal=True)
    u_BcHLV = solve(v_BcHLV * beta_BcHL[..., None])
    w_BcHLK = solve(k_beta_BcHLK * from_start_BcHL[..., None])
    scores_BcHLL = jnp.einsum("bchik,bchjk->bchij", q_BcHLK, k_BcHLK) * decay_BcHLL
    q_start_BcHLK = q_BcHLK * from_start_BcHL[..., None]
    k_end_BcHLK = k_BcHLK * to_end_BcHL[..., None]

    def carry(state_BHKV, inputs):
        u, w, scores, q_start, k_end, through_BH = inputs
        delta_BHLV = u - jnp.einsum("bhlk,bhkv->bhlv", w, state_BHKV)
        o_BHLV = jnp.einsum("bhlk,bhkv->bhlv", q_start, state_BHKV) + jnp.einsum("bhij,bhjv->bhiv", scores, delta_BHLV)
        state_BHKV = state_BHKV * through_BH[..., None, None] + jnp.einsum("bhlk,bhlv->bhkv", k_end, delta_BHLV)
        return state_BHKV, o_BHLV

    first = lambda t: jnp.moveaxis(t, 1, 0)
    final, o_cBHLV = jax.lax.scan(carry, state_BHKV.astype(dtype), tuple(map(first, (
        u_BcHLV, w_BcHLK, scores_BcHLL, q_start_BcHLK, k_end_BcHLK, through_BcH))))
    o_BSHV = jnp.moveaxis(o_cBHLV, 0, 1).swapaxes(2, 3).reshape(Bn, c * L, H, V)[:, :S]
    return o_BSHV, final


def l2_normalized(x, eps: float = L2_EPS):
    """`x * rsqrt(sum(x^2) + eps)` over the last axis, float32."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def _a_log_init(key, shape, dtype=F32):
    """transformers' initial `A_log`: the log of decay rates uniform in [0.01, 16]."""
    return jnp.log(jax.random.uniform(key, shape, F32, 0.01, 16.0)).astype(dtype)


class GatedDeltaNetMixer(nn.Module):
    """One layer's Gated DeltaNet mixer (see the module); `__call__` has attention's signature."""

    shape: GatedDeltaNet
    norm_eps: float = 1e-6
    dtype: jnp.dtype = F32
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, x_BSE, rotary, context, knobs, cache: RecurrentCache | None = None):
        s = self.shape
        Bn, S, E = x_BSE.shape
        Hk, Hv, Dk, Dv = s.key_heads, s.value_heads, s.key_head_dim, s.value_head_dim
        C, V = s.conv_dim, s.value_dim
        linear = lambda features, names, name: Linear(features, dtype=self.dtype, param_dtype=self.param_dtype,
                                                      names=names, name=name)
        param = lambda name, init, shape, names: self.param(name, named(init, names), shape, self.param_dtype)
        projected_BSF = linear(s.projected, ("embed", "mlp"), "in_proj")(x_BSE)
        qkv_BSC, z_BSV, b_BSH, a_BSH = jnp.split(projected_BSF, [C, C + V, C + V + Hv], axis=-1)

        segments_BS = context.segments_BS
        real_BS = segments_BS > 0
        conv_BKC, state_BHKV = initial_state(s, Bn, cache, context, knobs.local, self.dtype)
        kernel_KC, _ = ConvKernel(s.conv_kernel, C, False, self.param_dtype, name="conv1d")()
        conv_BSC, conv_BKC = causal_conv(qkv_BSC, real_BS, segments_BS, conv_BKC, kernel_KC, None)
        qkv_BSC = jax.nn.silu(conv_BSC).astype(self.dtype)
        q_BSF, k_BSF, v_BSV = jnp.split(qkv_BSC, [s.key_dim, 2 * s.key_dim], axis=-1)
        heads = lambda t_BSF, count: jnp.repeat(l2_normalized(t_BSF.reshape(Bn, S, Hk, Dk)), count, axis=2)
        q_BSHK = heads(q_BSF, Hv // Hk) * Dk ** -0.5
        k_BSHK = heads(k_BSF, Hv // Hk)

        A_log_H = param("A_log", _a_log_init, (Hv,), ("heads",))
        dt_bias_H = param("dt_bias", nn.initializers.ones_init(), (Hv,), ("heads",))
        g_BSH = -jnp.exp(A_log_H.astype(F32)) * jax.nn.softplus(a_BSH.astype(F32) + dt_bias_H.astype(F32))
        g_BSH = jnp.where(real_BS[..., None], g_BSH, 0.0)
        beta_BSH = jnp.where(real_BS[..., None], jax.nn.sigmoid(b_BSH.astype(F32)), 0.0)
        o_BSHV, state_BHKV = gated_delta_rule(q_BSHK, k_BSHK, v_BSV.reshape(Bn, S, Hv, Dv).astype(F32), g_BSH,
                                              beta_BSH, document_starts(real_BS, segments_BS), state_BHKV,
                                              s.chunk_size)

        # norm before gate, per head: scale * (o / rms(o)) rounded to the compute dtype, times silu(z)
        o_BSHV = o_BSHV.astype(self.dtype).astype(F32)
        normed_BSHV = o_BSHV * jax.lax.rsqrt(jnp.mean(jnp.square(o_BSHV), axis=-1, keepdims=True) + self.norm_eps)
        scale_V = NormScale(Dv, self.param_dtype, name="norm")()
        normed_BSHV = scale_V.astype(self.dtype) * normed_BSHV.astype(self.dtype)
        gated_BSHV = normed_BSHV.astype(F32) * jax.nn.silu(z_BSV.reshape(Bn, S, Hv, Dv).astype(F32))
        out_BSE = linear(E, ("mlp", "embed"), "out_proj")(gated_BSHV.reshape(Bn, S, V).astype(self.dtype))
        if cache is not None and not context.read_only_cache:
            cache = cache.written(knobs.local, conv_BKC, state_BHKV)
        return out_BSE, cache, None
