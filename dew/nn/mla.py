"""Multi-head latent attention (DeepSeek V2/V3): queries and keys split into a no-rotary and a rotary
part, keys and values read from one compressed latent per token, and a cache that holds only that
latent and the one shared rotary key.

`LatentAttention` is the decoder's knob (`DecoderConfig.latent`); each layer's mixer is then an
`MLASpec`, whose module `MLA` holds, in transformers' names, `q_a_proj`, `q_a_layernorm`, `q_b_proj`
(or a plain `q_proj` without `q_rank`), `kv_a_proj_with_mqa` (`x` to `kv_rank + rope_dim`: the
latent and the shared rotary key), `kv_a_layernorm`, `kv_b_proj` (the latent to each head's
no-rotary key and value, `[kv_rank, heads * (nope_dim + value_dim)]`) and `o_proj`.

Two ways to attend, equal up to rounding:
- expanded: `kv_b_proj` turns every cached latent into per-head keys and values, and attention runs
  as usual over `nope_dim + rope_dim` features (training and prefill: the queries outnumber the
  heads' share of the latent, so expanding once is the cheaper side);
- absorbed: each query's no-rotary part is carried into the latent space through the key half of
  `kv_b_proj`, attention runs as one shared key/value head over `kv_rank + rope_dim` features read
  straight from the cache, and the value half of `kv_b_proj` maps the attended latent to each head's
  value (decode: one query per row reads the whole cache, which is never expanded).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from dew.kernels import accelerator_attention as accelerator
from dew.nn.attention import accelerated_attention, attend, attention_mask, score_max
from dew.nn.linear import Linear, matmul, named
from dew.nn.norms import RMSNorm
from dew.nn.rotary import RopeScaling, apply_rotary

F32 = jnp.float32
ABSORB = ("decode", "always", "never")


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """The shape of latent attention, shared by every layer of a decoder (`DecoderConfig.latent`).

    - `kv_rank`: the latent's width (transformers' `kv_lora_rank`); `q_rank` the query's low-rank
      width (`q_lora_rank`; None: a plain `q_proj`).
    - `nope_dim`, `rope_dim`, `value_dim`: each head's no-rotary and rotary query/key features and
      its value features (`qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`); one rotary key of
      `rope_dim` features serves every head.
    - `interleaved`: the rotary features turn in adjacent pairs `(x0, x1), (x2, x3), ...` (DeepSeek's
      layout, transformers' `rope_interleave`); False: in halves, as Llama's do.
    - `norm_eps`: the epsilon of the query and latent norms (1e-6 in transformers, whatever the
      decoder's own).
    - `absorb`: when attention runs in the absorbed form (see the module): "decode" for single-token
      steps through the cache, "always", or "never"; every form computes the same attention.
    - `index_heads`, `index_head_dim`, `index_topk`: DeepSeek-V3.2's lightning indexer (`Indexer`):
      its heads (0: none) and their width; with `index_topk`, each query attends only to the keys
      the indexer ranks highest, that many (None: the indexer scores beside dense attention).
    """

    kv_rank: int = 512
    q_rank: int | None = 1536
    nope_dim: int = 128
    rope_dim: int = 64
    value_dim: int = 128
    interleaved: bool = True
    norm_eps: float = 1e-6
    absorb: str = "decode"
    index_heads: int = 0
    index_head_dim: int = 128
    index_topk: int | None = None

    def __post_init__(self):
        for name in ("kv_rank", "nope_dim", "rope_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"latent {name} is {getattr(self, name)}; it must be at least 1")
        if self.q_rank is not None and self.q_rank < 1:
            raise ValueError(f"latent q_rank is {self.q_rank}; use a width >= 1, or None for a plain q_proj")
        if self.rope_dim % 2:
            raise ValueError(f"latent rope_dim is {self.rope_dim}; rotary positions turn pairs of features, so it "
                             f"must be even (DeepSeek uses 64): use {self.rope_dim + 1} or {self.rope_dim - 1}")
        if self.absorb not in ABSORB:
            raise ValueError(f"latent absorb is {self.absorb!r}; it must be one of {list(ABSORB)}")
        if self.index_heads < 0:
            raise ValueError(f"latent index_heads is {self.index_heads}; use 0 for no indexer")
        if self.index_heads:
            if self.q_rank is None:
                raise ValueError("the lightning indexer reads the query's low-rank residual, and q_rank is None: "
                                 "give q_rank, or index_heads 0")
            if not self.rope_dim <= self.index_head_dim:
                raise ValueError(f"latent index_head_dim is {self.index_head_dim}; the indexer rotates its first "
                                 f"rope_dim ({self.rope_dim}) features, so it must be at least that")
        if self.index_topk is not None and (self.index_topk < 1 or not self.index_heads):
            raise ValueError(f"latent index_topk is {self.index_topk}: it keeps that many keys per query (>= 1), "
                             "ranked by the indexer, which needs index_heads >= 1")

    @property
    def cache_width(self) -> int:
        """Values the cache holds per token and layer: the latent and the shared rotary key."""
        return self.kv_rank + self.rope_dim


def yarn_query_scale(head_features: int, scaling: RopeScaling) -> float:
    """The attention scores' factor, `head_features ** -0.5`, times YaRN's magnitude squared when the
    rotary scaling names `mscale_all_dim` (DeepSeek's rule: the factor its rotary tables leave out)."""
    scale = head_features ** -0.5
    if scaling.kind == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
        magnitude = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale = scale * magnitude * magnitude
    return scale


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """A layer's latent attention: `num_heads` heads of `latent`'s shape, rotary angles from
    `rope_theta` and `rope_scaling`, biases on the down projections (`bias`: `q_a_proj`,
    `kv_a_proj_with_mqa`) and on `o_proj` (`o_bias`), as transformers' `attention_bias` sets both."""

    num_heads: int
    latent: LatentAttention
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    bias: bool = False
    o_bias: bool = False
    window: None = None  # latent attention never slides (read by the stack's per-layer knobs)

    @property
    def scale(self) -> float:
        return yarn_query_scale(self.latent.nope_dim + self.latent.rope_dim, self.rope_scaling)

    def rope(self) -> tuple[int, float, RopeScaling]:
        """The rotary table this mixer reads: (rotated features, base, scaling)."""
        return self.latent.rope_dim, self.rope_theta, self.rope_scaling

    def scan_key(self) -> "MLASpec":
        """This spec with the per-layer values erased: layers with equal keys scan together."""
        return dataclasses.replace(self, rope_theta=0.0, rope_scaling=RopeScaling())

    def empty_cache(self, layers: int, rows: int, capacity: int, dtype) -> "LatentCache":
        return LatentCache.empty(layers, rows, capacity, self.latent, dtype)

    def module(self, *, norm_style: str, norm_eps: float, dtype, param_dtype, name: str) -> "MLA":
        return MLA(self, dtype, param_dtype, name=name)


@struct.dataclass
class LatentCache:
    """A run of latent-attention layers' cache: the normed latents `[L, B, T, kv_rank]` and the rotated
    shared keys `[L, B, T, rope_dim]`, `kv_rank + rope_dim` values per token and layer; with an
    indexer, its float32 keys `[L, B, T, index_head_dim]` too."""

    latents: jax.Array
    rope_keys: jax.Array
    index_keys: jax.Array | None = None

    @classmethod
    def empty(cls, layers: int, rows: int, capacity: int, latent: LatentAttention, dtype) -> "LatentCache":
        index = None if not latent.index_heads else jnp.zeros((layers, rows, capacity, latent.index_head_dim), F32)
        return cls(latents=jnp.zeros((layers, rows, capacity, latent.kv_rank), dtype),
                   rope_keys=jnp.zeros((layers, rows, capacity, latent.rope_dim), dtype), index_keys=index)

    @property
    def capacity(self) -> int:
        return self.latents.shape[2]

    def write(self, layer, slots_BS: jax.Array, latent_BSC: jax.Array, rope_BSR: jax.Array,
              index_BSD: jax.Array | None = None) -> "LatentCache":
        """Store token `s` of row `b` at slot `slots_BS[b, s]` of layer `layer`; a slot at or past the
        capacity (padding) is dropped."""
        rows_B1 = jnp.arange(slots_BS.shape[0])[:, None]
        put = lambda into, new: into.at[layer, rows_B1, slots_BS].set(new.astype(into.dtype), mode="drop")
        index = None if self.index_keys is None else put(self.index_keys, index_BSD)
        return LatentCache(latents=put(self.latents, latent_BSC), rope_keys=put(self.rope_keys, rope_BSR),
                           index_keys=index)

    def put_rows(self, rows_R: jax.Array, new: "LatentCache") -> "LatentCache":
        """This cache with rows `rows_R` replaced by the rows of `new` (a cache of `R` rows and at most
        this capacity, filling the first slots); a row index past the last is dropped."""
        put = lambda big, rows: big.at[:, rows_R, :rows.shape[2]].set(rows.astype(big.dtype), mode="drop")
        index = None if self.index_keys is None else put(self.index_keys, new.index_keys)
        return LatentCache(latents=put(self.latents, new.latents), rope_keys=put(self.rope_keys, new.rope_keys),
                           index_keys=index)

    def read(self, layer) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Layer `layer`'s latents `[B, T, kv_rank]`, rotary keys `[B, T, rope_dim]` and indexer keys
        `[B, T, index_head_dim]` (None without an indexer)."""
        return self.latents[layer], self.rope_keys[layer], None if self.index_keys is None else self.index_keys[layer]


def rotate(x_BSHR: jax.Array, cos_BSR: jax.Array, sin_BSR: jax.Array, interleaved: bool) -> jax.Array:
    """Rotate the rotary features. Interleaved pairs are gathered first (evens, then odds), which is
    transformers' DeepSeek-V3 output layout; queries and keys share it, so their products are the
    pairs' products whatever the layout."""
    if interleaved:
        x_BSHR = jnp.concatenate([x_BSHR[..., 0::2], x_BSHR[..., 1::2]], axis=-1)
    return apply_rotary(x_BSHR, cos_BSR, sin_BSR)


@struct.dataclass
class IndexerRecord:
    """What a layer's lightning indexer reports for a whole sequence (the decoder's `aux["indexer"]`
    adds a leading layer axis): its float32 `scores` `[B, S, T]` (-inf where a query may not read the
    key), the keys each query attends to, `selected` `[B, S, T]` (every allowed key without
    `index_topk`), and `kl` `[B, S]`, each query's KL divergence from the dense attention distribution
    over the selected keys (heads summed, then normalised; queries and keys detached) to the indexer's
    softmax over them (`indexer_kl`)."""

    scores: jax.Array
    selected: jax.Array
    kl: jax.Array


# Added before each logarithm and to the head-summed mass, as DeepSeek's and MaxText's indexer losses do.
KL_EPS = 1e-8


def indexer_kl(attention_BHST: jax.Array, scores_BST: jax.Array, keep_BST: jax.Array) -> jax.Array:
    """float32 `[B, S]`: `sum_t p log((p + eps) / (q + eps))`, `p` the heads' attention probabilities
    over the kept keys summed and L1-normalised, `q` the softmax of the indexer's scores over them."""
    mass_BST = jnp.sum(attention_BHST.astype(F32), axis=1) * keep_BST
    target_BST = mass_BST / (jnp.sum(mass_BST, axis=-1, keepdims=True) + KL_EPS)
    predicted_BST = jax.nn.softmax(jnp.where(keep_BST, scores_BST, -jnp.inf), axis=-1)
    predicted_BST = jnp.where(keep_BST, predicted_BST, 0.0)
    return jnp.sum(target_BST * (jnp.log(target_BST + KL_EPS) - jnp.log(predicted_BST + KL_EPS)), axis=-1)


def dense_probabilities(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, keep_BST, scale: float, nope: int):
    """float32 `[B, H, S, T]`: each head's attention probabilities over the kept keys, computed from
    detached queries and keys (the target the indexer learns; nothing flows back through it)."""
    C = latent_BTC.shape[-1]
    H = q_nope_BSHN.shape[2]
    stop = jax.lax.stop_gradient
    w_key_CHN = stop(kv_b_CF).reshape(C, H, -1)[..., :nope].astype(F32)
    q_latent_BSHC = jnp.einsum("bshn,chn->bshc", stop(q_nope_BSHN).astype(F32), w_key_CHN)
    logits_BHST = (jnp.einsum("bshc,btc->bhst", q_latent_BSHC, stop(latent_BTC).astype(F32))
                   + jnp.einsum("bshr,btr->bhst", stop(q_rope_BSHR).astype(F32), stop(rope_BTR).astype(F32))) * scale
    logits_BHST = jnp.where(keep_BST[:, None], logits_BHST, -jnp.inf)
    return jnp.where(keep_BST[:, None], jax.nn.softmax(logits_BHST, axis=-1), 0.0)


class _Kernel(nn.Module):
    """One projection's `kernel` `[in, out]`, read whole (the absorbed form splits it by head)."""

    shape: tuple[int, int]
    names: tuple
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", named(nn.initializers.normal(0.02), self.names), self.shape, self.param_dtype)


class MLA(nn.Module):
    """Latent attention with transformers' parameter names (see the module)."""

    spec: MLASpec
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSE: jax.Array, rotary: tuple[jax.Array, jax.Array], context, knobs,
                 cache: LatentCache | None = None) -> tuple[jax.Array, LatentCache | None, dict | None]:
        """`context` is the stack's `LayerContext` and `knobs` this layer's `LayerKnobs`, as for
        `dew.nn.attention.Attention`. The third result is what the context asks for (None when
        nothing): with an indexer and `context.report_indexer`, its `IndexerRecord` as `indexer`;
        with `context.report_qk`, `qk_max` `[B, H]`, each head's largest logit over the pairs it
        reads (the selected keys, with `index_topk`)."""
        s, lat = self.spec, self.spec.latent
        B, S, E = x_BSE.shape
        H, N, R, V, C = s.num_heads, lat.nope_dim, lat.rope_dim, lat.value_dim, lat.kv_rank
        dense = lambda features, bias, names, name: Linear(features, use_bias=bias, dtype=self.dtype,
                                                           param_dtype=self.param_dtype, names=names, name=name)
        norm = lambda name: RMSNorm(lat.norm_eps, "llama", dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        q_resid_BSQ = None
        if lat.q_rank is None:
            q_BSF = dense(H * (N + R), False, ("embed", "heads"), "q_proj")(x_BSE)
        else:
            q_resid_BSQ = norm("q_a_layernorm")(dense(lat.q_rank, s.bias, ("embed", None), "q_a_proj")(x_BSE))
            q_BSF = dense(H * (N + R), False, (None, "heads"), "q_b_proj")(q_resid_BSQ)
        q_BSHD = q_BSF.reshape(B, S, H, N + R)
        q_nope_BSHN = q_BSHD[..., :N]
        q_rope_BSHR = rotate(q_BSHD[..., N:], *rotary, lat.interleaved)
        compressed_BSF = dense(C + R, s.bias, ("embed", None), "kv_a_proj_with_mqa")(x_BSE)
        latent_BSC = norm("kv_a_layernorm")(compressed_BSF[..., :C])
        rope_BSR = rotate(compressed_BSF[..., None, C:], *rotary, lat.interleaved)[:, :, 0]
        kv_b_CF = _Kernel((C, H * (N + V)), (None, "heads"), self.param_dtype, name="kv_b_proj")().astype(self.dtype)
        indexer = None if not lat.index_heads else Indexer(lat, self.param_dtype, name="indexer")
        index_q_BSHD = index_k_BSD = None
        if indexer is not None:
            index_q_BSHD, index_k_BSD, index_w_BSH = indexer.project(x_BSE, q_resid_BSQ, rotary)

        if cache is None:
            latent_BTC, rope_BTR, index_k_BTD = latent_BSC, rope_BSR, index_k_BSD
            k_slots, k_segments = context.slots_BS, context.segments_BS
        else:
            cache = cache.write(knobs.local, context.write_slots_BS, latent_BSC, rope_BSR, index_k_BSD)
            latent_BTC, rope_BTR, index_k_BTD = cache.read(knobs.local)
            k_segments = context.filled_BT
            k_slots = jnp.broadcast_to(jnp.arange(latent_BTC.shape[1], dtype=jnp.int32), k_segments.shape)
        mask_BST = attention_mask(context.slots_BS, k_slots, context.segments_BS, k_segments, causal=True, window=None)
        report = {}
        if indexer is not None:
            scores_BST = index_scores(index_q_BSHD, index_k_BTD, index_w_BSH, mask_BST)
            if lat.index_topk is not None:
                mask_BST = mask_BST & top_keys(scores_BST, lat.index_topk)
            if context.report_indexer:
                probs_BHST = dense_probabilities(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, mask_BST,
                                                 s.scale, N)
                report["indexer"] = IndexerRecord(scores=scores_BST, selected=mask_BST,
                                                  kl=indexer_kl(probs_BHST, scores_BST, mask_BST))
        if context.report_qk:  # whole sequences only: the decoder refuses it with a cache
            report["qk_max"] = latent_score_max(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF,
                                                mask_BST & (context.segments_BS > 0)[:, :, None], s.scale, N)
        absorbed = lat.absorb == "always" or (lat.absorb == "decode" and cache is not None and S == 1)
        kernel = "xla"
        if cache is None and not absorbed and (indexer is None or lat.index_topk is None):
            # a whole pass with the static causal mask may run in an accelerator's kernel, keys N + R wide
            kernel = accelerator.choose(accelerator.requested(), q_nope_BSHN.dtype, q_width=N + R, v_width=V,
                                        softcap=None, dynamic=False, segmented=context.segmented)
        if kernel != "xla":
            out_BSHV = expanded_attention(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, mask_BST, s.scale,
                                          N, kernel=kernel, knobs=knobs,
                                          segments_BS=context.segments_BS if context.segmented else None)
        elif absorbed:
            out_BSHV = absorbed_attention(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, mask_BST, s.scale,
                                          N)
        else:
            out_BSHV = expanded_attention(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, mask_BST, s.scale,
                                          N, causal_blocks=cache is None)
        out_BSE = dense(E, s.o_bias, ("heads", "embed"), "o_proj")(out_BSHV.reshape(B, S, H * V))
        return out_BSE, cache, report or None


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer, in transformers' names: `wq_b` (the query's low-rank residual
    to `index_heads * index_head_dim`), `wk` (the input to one key of `index_head_dim`) and its
    LayerNorm `k_norm` (weight and bias, eps 1e-6), and `weights_proj` (the input to one float32 weight
    per head). The first `rope_dim` features of queries and keys turn in halves, unlike the main
    attention's pairs. Its inputs are detached: nothing it computes trains the rest of the model."""

    latent: LatentAttention
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def project(self, x_BSE, q_resid_BSQ, rotary):
        """(float32 queries `[B, S, heads, D]`, keys `[B, S, D]`, per-head weights `[B, S, heads]`, the
        latter already times `heads ** -0.5`)."""
        lat = self.latent
        B, S, _ = x_BSE.shape
        Hi, D, R = lat.index_heads, lat.index_head_dim, lat.rope_dim
        x_BSE, q_resid_BSQ = jax.lax.stop_gradient(x_BSE).astype(F32), jax.lax.stop_gradient(q_resid_BSQ).astype(F32)
        dense = lambda features, names, name: Linear(features, dtype=F32, param_dtype=self.param_dtype, names=names,
                                                     name=name)
        q_BSHD = dense(Hi * D, (None, None), "wq_b")(q_resid_BSQ).reshape(B, S, Hi, D)
        k_BSD = nn.LayerNorm(1e-6, dtype=F32, param_dtype=self.param_dtype, name="k_norm")(
            dense(D, ("embed", None), "wk")(x_BSE))
        cos, sin = (jax.lax.stop_gradient(t) for t in rotary)
        q_BSHD = jnp.concatenate([apply_rotary(q_BSHD[..., :R], cos, sin), q_BSHD[..., R:]], axis=-1)
        k_BSD = jnp.concatenate([apply_rotary(k_BSD[:, :, None, :R], cos, sin)[:, :, 0], k_BSD[..., R:]], axis=-1)
        weights_BSH = Linear(Hi, dtype=F32, param_dtype=F32, names=("embed", None), name="weights_proj")(x_BSE)
        return q_BSHD, k_BSD, weights_BSH * Hi ** -0.5


def index_scores(q_BSHD, k_BTD, weights_BSH, mask_BST) -> jax.Array:
    """The indexer's float32 scores `[B, S, T]`: `sum_h w_h relu(q_h . k * D ** -0.5)`, -inf where the
    mask forbids the key."""
    D = q_BSHD.shape[-1]
    per_head_BSHT = jax.nn.relu(jnp.einsum("bshd,btd->bsht", q_BSHD, k_BTD.astype(F32), preferred_element_type=F32)
                                * D ** -0.5)
    scores_BST = jnp.einsum("bsh,bsht->bst", weights_BSH, per_head_BSHT, preferred_element_type=F32)
    return jnp.where(mask_BST, scores_BST, -jnp.inf)


def top_keys(scores_BST: jax.Array, topk: int) -> jax.Array:
    """Boolean `[B, S, T]`: the `topk` best-scored keys of each query (all of them when fewer)."""
    T = scores_BST.shape[-1]
    if topk >= T:
        return jnp.ones(scores_BST.shape, bool)
    _, best_BSK = jax.lax.top_k(scores_BST, topk)
    rows_B11 = jnp.arange(scores_BST.shape[0])[:, None, None]
    queries_1S1 = jnp.arange(scores_BST.shape[1])[None, :, None]
    return jnp.zeros(scores_BST.shape, bool).at[rows_B11, queries_1S1, best_BSK].set(True)


def latent_score_max(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, allowed_BST, scale: float,
                     nope: int) -> jax.Array:
    """float32 `[B, H]`: each row's and head's largest attention logit over the pairs `allowed_BST`
    marks (`dew.nn.attention.score_max`), scored in the absorbed form: the query's no-rotary part
    carried into the latent space meets the latent and the rotary key, one shared key head of
    `kv_rank + rope_dim` features."""
    C = latent_BTC.shape[-1]
    H = q_nope_BSHN.shape[2]
    w_key_CHN = jax.lax.stop_gradient(kv_b_CF).reshape(C, H, -1)[..., :nope].astype(F32)
    q_latent_BSHC = jnp.einsum("bshn,chn->bshc", jax.lax.stop_gradient(q_nope_BSHN).astype(F32), w_key_CHN)
    q_BSHD = jnp.concatenate([q_latent_BSHC, q_rope_BSHR.astype(F32)], axis=-1)
    keys_B1TD = jnp.concatenate([latent_BTC, rope_BTR], axis=-1)[:, None].astype(F32)
    return score_max(q_BSHD, keys_B1TD, allowed_BST, scale)


def expanded_attention(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, mask_BST, scale: float, nope: int,
                       causal_blocks: bool = False, kernel: str = "xla", knobs=None, segments_BS=None) -> jax.Array:
    """Attention over keys and values expanded from the latents: `[B, S, H, value_dim]`; with `kernel` an
    accelerator's ("splash", `dew.nn.attention.accelerated_attention`), a causal pass over its own keys under
    the static mask and `segments_BS` (`mask_BST` unread)."""
    B, T, C = latent_BTC.shape
    H = q_nope_BSHN.shape[2]
    kv_BTHF = matmul(latent_BTC.reshape(B * T, C), kv_b_CF).astype(q_nope_BSHN.dtype).reshape(B, T, H, -1)
    rope_BTHR = jnp.broadcast_to(rope_BTR[:, :, None, :], (B, T, H, rope_BTR.shape[-1])).astype(kv_BTHF.dtype)
    keys_BTHD = jnp.concatenate([kv_BTHF[..., :nope], rope_BTHR], axis=-1)
    q_BSHD = jnp.concatenate([q_nope_BSHN, q_rope_BSHR], axis=-1)
    if kernel != "xla":
        return accelerated_attention(kernel, q_BSHD, keys_BTHD, kv_BTHF[..., nope:], scale=scale, causal=True,
                                     knobs=knobs, segments_BS=segments_BS)
    keys_BHTD, values_BHTV = keys_BTHD.transpose(0, 2, 1, 3), kv_BTHF[..., nope:].transpose(0, 2, 1, 3)
    return attend(q_BSHD, keys_BHTD, values_BHTV, mask_BST, causal_blocks=causal_blocks, scale=scale)


def absorbed_attention(q_nope_BSHN, q_rope_BSHR, latent_BTC, rope_BTR, kv_b_CF, mask_BST, scale: float,
                       nope: int) -> jax.Array:
    """Attention in the latent space, one shared key/value head read from the cache as it is:
    `[B, S, H, value_dim]`. `q_nope . (W_k latent) = (W_k^T q_nope) . latent`, and the value
    projection commutes with the attention-weighted sum over keys."""
    C = latent_BTC.shape[-1]
    H = q_nope_BSHN.shape[2]
    kv_b_CHF = kv_b_CF.reshape(C, H, -1)
    w_key_CHN, w_value_CHV = kv_b_CHF[..., :nope], kv_b_CHF[..., nope:]
    q_latent_BSHC = jnp.einsum("bshn,chn->bshc", q_nope_BSHN, w_key_CHN,
                               preferred_element_type=F32).astype(q_nope_BSHN.dtype)
    q_BSHD = jnp.concatenate([q_latent_BSHC, q_rope_BSHR], axis=-1)
    keys_B1TD = jnp.concatenate([latent_BTC, rope_BTR], axis=-1)[:, None].astype(q_BSHD.dtype)
    attended_BSHC = attend(q_BSHD, keys_B1TD, latent_BTC[:, None].astype(q_BSHD.dtype), mask_BST, scale=scale)
    return jnp.einsum("bshc,chv->bshv", attended_BSHC, w_value_CHV,
                      preferred_element_type=F32).astype(q_nope_BSHN.dtype)


__all__ = ["ABSORB", "KL_EPS", "Indexer", "IndexerRecord", "LatentAttention", "LatentCache", "MLA", "MLASpec",
           "absorbed_attention", "dense_probabilities", "expanded_attention", "index_scores", "indexer_kl", "latent_score_max", "rotate",
           "top_keys", "yarn_query_scale"]
