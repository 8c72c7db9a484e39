"""`CausalTransformer`: the one decoder every family configures (RMSNorm, rotary, GQA, gated MLP).

Its parameter tree uses the transformers decoder names (`embed_tokens`, `layers_N.self_attn.q_proj`,
`mlp.gate_proj`, `norm`, `lm_head`), so a checkpoint maps tensor to tensor. The families differ only
in the knobs of `DecoderConfig`: biases, norm rounding and placement, q/k norms, embedding scale,
activation, attention scale and softcaps, and which layers slide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.attention import Attention
from dew.nn.kv_cache import LayerCache
from dew.nn.mlp import ACTIVATIONS, GatedMLP
from dew.nn.norms import NORM_STYLES, RMSNorm
from dew.nn.rotary import RopeScaling, rotary_angles

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FULL, SLIDING = "full_attention", "sliding_attention"
NORM_PLACEMENTS = ("pre", "sandwich", "post")


def as_dtype(value) -> jnp.dtype:
    """Accept `jnp.bfloat16`, `np.dtype('bfloat16')` or the string `"bfloat16"`."""
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ValueError(f"dtype {value!r} is not one of {sorted(_DTYPES)}")
        return jnp.dtype(_DTYPES[value])
    return jnp.dtype(value)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The shape and numerics of a `CausalTransformer`.

    `head_dim` defaults to `emb_features // num_heads`, `num_kv_heads` to `num_heads` and
    `mlp_features` to `4 * emb_features`. `dtype` is the compute dtype (activations, matmul operands);
    `param_dtype` is how parameters are stored.

    The family knobs, each named after what it computes:
    - `qkv_bias`, `o_bias`, `mlp_bias`: biases on the query/key/value, output and MLP projections.
    - `norm_style`: the RMSNorm rounding, "llama", "olmo" or "gemma" (`(1 + scale)`; see `dew.nn.norms`).
    - `norm_placement`: "pre" (norm before attention and MLP; the MLP's norm is named
      `post_attention_layernorm`, as in Llama), "sandwich" (Gemma 2/3: also a norm after each
      sublayer, `pre_feedforward_layernorm` before the MLP) or "post" (OLMo 2: norms only after each
      sublayer, before the residual add).
    - `qk_norm_scope`: with `qk_norm`, normalise per head ("head") or the whole projection ("projection").
    - `scale_embeddings`: multiply the embeddings by `sqrt(emb_features)` rounded to `dtype` (Gemma).
    - `activation`: the MLP gate's "silu", "gelu_tanh" or "gelu".
    - `query_scale`: the attention scores' factor (default `head_dim ** -0.5`); `attn_softcap` caps
      the scores, `logit_softcap` the output logits, `c * tanh(x / c)`.
    - `rope_scaling`: how the rotary frequencies are stretched past the pretraining length (a
      `dew.nn.rotary.RopeScaling`, or its fields as a dict); the default scales nothing.
    - `layer_types`: one "full_attention" or "sliding_attention" per layer; only sliding layers
      use `sliding_window`, `local_rope_theta` (default `rope_theta`) and `local_rope_scaling`
      (default `rope_scaling`). Without it, every layer uses `sliding_window`.
    - `attention_dropout`: the dropout rate a checkpoint was trained with on the attention
      probabilities. It changes nothing at inference; Dew does not apply dropout, so training
      objectives refuse a model whose rate is above zero.
    """

    vocab_size: int
    emb_features: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    mlp_features: int | None = None
    head_dim: int | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    qk_norm: bool = False
    tie_embeddings: bool = False
    causal: bool = True
    sliding_window: int | None = None
    logit_softcap: float | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_style: str = "llama"
    norm_placement: str = "pre"
    qk_norm_scope: str = "head"
    scale_embeddings: bool = False
    activation: str = "silu"
    query_scale: float | None = None
    attn_softcap: float | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    rope_scaling: RopeScaling = RopeScaling()
    local_rope_scaling: RopeScaling | None = None
    attention_dropout: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("dtype", as_dtype(self.dtype))
        set_("param_dtype", as_dtype(self.param_dtype))
        for name in ("rope_scaling", "local_rope_scaling"):
            if isinstance(getattr(self, name), Mapping):  # a config read back from JSON
                set_(name, RopeScaling(**getattr(self, name)))
        if self.num_kv_heads is None:
            set_("num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.emb_features % self.num_heads:
                raise ValueError(
                    f"emb_features {self.emb_features} is not divisible by num_heads {self.num_heads}: "
                    "pass head_dim explicitly or pick a width that divides"
                )
            set_("head_dim", self.emb_features // self.num_heads)
        if self.mlp_features is None:
            set_("mlp_features", 4 * self.emb_features)
        positive = ("vocab_size", "emb_features", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "mlp_features", "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be at least 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}: "
                "every key/value head must serve the same number of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd; rotary positions rotate pairs of features")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout is {self.attention_dropout}; it is a rate in [0, 1)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window is {self.sliding_window}; use None for full attention or a width >= 1")
        choices = {"norm_style": NORM_STYLES, "norm_placement": NORM_PLACEMENTS, "qk_norm_scope": ("head", "projection"),
                   "activation": tuple(ACTIVATIONS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be one of {list(allowed)}")
        if self.layer_types is not None:
            set_("layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers but num_layers is {self.num_layers}")
            unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
            if unknown:
                raise ValueError(f"layer_types holds {unknown}; each layer is {FULL!r} or {SLIDING!r}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError(f"layer_types names {SLIDING!r} layers but sliding_window is None: give the width")
        else:
            for name in ("local_rope_theta", "local_rope_scaling"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to sliding layers: give layer_types too, or drop it")

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index`, None for full attention."""
        if self.layer_types is None or self.layer_types[index] == SLIDING:
            return self.sliding_window
        return None

    def layer_rope_theta(self, index: int) -> float:
        return self.layer_rope(index)[0]

    def layer_rope(self, index: int) -> tuple[float, RopeScaling]:
        """The rotary base and scaling of layer `index`; sliding layers take the local ones where given."""
        sliding = self.layer_types is not None and self.layer_types[index] == SLIDING
        theta = self.local_rope_theta if sliding and self.local_rope_theta is not None else self.rope_theta
        scaling = self.local_rope_scaling if sliding and self.local_rope_scaling is not None else self.rope_scaling
        return theta, scaling


class DecoderLayer(nn.Module):
    config: DecoderConfig
    index: int

    @nn.compact
    def __call__(self, x_BSE, rotary, slots_BS, segments_BS, cache: LayerCache | None):
        c = self.config
        norm = lambda name: RMSNorm(c.norm_eps, c.norm_style, dtype=c.dtype, param_dtype=c.param_dtype, name=name)
        attention = Attention(
            c.num_heads, c.num_kv_heads, c.head_dim, causal=c.causal, window=c.layer_window(self.index),
            qk_norm=c.qk_norm, qk_norm_scope=c.qk_norm_scope, norm_style=c.norm_style, norm_eps=c.norm_eps,
            qkv_bias=c.qkv_bias, o_bias=c.o_bias, scale=c.query_scale, softcap=c.attn_softcap,
            dtype=c.dtype, param_dtype=c.param_dtype, name="self_attn",
        )
        mlp = GatedMLP(c.mlp_features, c.activation, c.mlp_bias, dtype=c.dtype, param_dtype=c.param_dtype, name="mlp")
        attention_in = x_BSE if c.norm_placement == "post" else norm("input_layernorm")(x_BSE)
        attended, cache = attention(attention_in, rotary, slots_BS, segments_BS, cache)
        if c.norm_placement != "pre":
            attended = norm("post_attention_layernorm")(attended)
        x_BSE = x_BSE + attended
        mlp_norm = {"pre": "post_attention_layernorm", "sandwich": "pre_feedforward_layernorm"}.get(c.norm_placement)
        fed = mlp(x_BSE if mlp_norm is None else norm(mlp_norm)(x_BSE))
        if c.norm_placement != "pre":
            fed = norm("post_feedforward_layernorm")(fed)
        return x_BSE + fed, cache


class CausalTransformer(nn.Module):
    """A decoder-only transformer over int32 token ids `[B, S]`.

    `__call__` returns float32 logits `[B, S, vocab]`, or with `head=False` the final-norm hidden
    states `[B, S, emb]` in the compute dtype (the chunked loss applies the head itself, see
    `head_weight`). `segment_ids` (1-based documents, 0 for padding) keep packed documents apart and
    `positions` restart the rotary angles per document. With `cache` (one `LayerCache` per layer) the
    tokens are written at the cache cursor and the call returns `(output, cache)`.
    """

    config: DecoderConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: Sequence[LayerCache] | None = None,
        head: bool = True,
    ):
        c = self.config
        B, S = tokens.shape
        start = 0 if cache is None else cache[0].cursor
        slots_BS = jnp.broadcast_to(start + jnp.arange(S, dtype=jnp.int32), (B, S))
        positions = slots_BS if positions is None else positions
        segments_BS = jnp.ones((B, S), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

        embed = nn.Embed(c.vocab_size, c.emb_features, dtype=c.dtype, param_dtype=c.param_dtype,
                         embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
        x_BSE = embed(tokens).astype(c.dtype)
        if c.scale_embeddings:
            x_BSE = x_BSE * jnp.asarray(c.emb_features**0.5, c.dtype)
        ropes = dict.fromkeys(c.layer_rope(i) for i in range(c.num_layers))  # in layer order, each once
        rotary = {rope: rotary_angles(positions, c.head_dim, *rope) for rope in ropes}
        new_cache = []
        for i in range(c.num_layers):
            layer_cache = None if cache is None else cache[i]
            x_BSE, layer_cache = DecoderLayer(c, i, name=f"layers_{i}")(
                x_BSE, rotary[c.layer_rope(i)], slots_BS, segments_BS, layer_cache
            )
            new_cache.append(layer_cache)
        hidden_BSE = RMSNorm(c.norm_eps, c.norm_style, dtype=c.dtype, param_dtype=c.param_dtype, name="norm")(x_BSE)
        if c.tie_embeddings:
            weight, transposed = embed.embedding, True
        else:
            weight, transposed = _Kernel(c.vocab_size, c.param_dtype, name="lm_head")(c.emb_features), False
        if head:
            logits_NV = vocab_logits(hidden_BSE.reshape(B * S, -1), weight.astype(c.dtype), transposed)
            output = cap_logits(logits_NV, c.logit_softcap).reshape(B, S, c.vocab_size)
        else:
            output = hidden_BSE
        return output if cache is None else (output, new_cache)

    def init_cache(self, rows: int, capacity: int) -> list[LayerCache]:
        c = self.config
        return [LayerCache.empty(rows, capacity, c.num_kv_heads, c.head_dim, c.dtype) for _ in range(c.num_layers)]


class _Kernel(nn.Module):
    """Holds the untied output projection `kernel` `[emb, vocab]` under the name `lm_head`."""

    features: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, in_features: int) -> jax.Array:
        return self.param("kernel", nn.initializers.normal(0.02), (in_features, self.features), self.param_dtype)


def vocab_logits(hidden_NE: jax.Array, weight: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` from hidden states and the head (`[E, V]`, or `[V, E]` when tied)."""
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    return jax.lax.dot_general(hidden_NE, weight, (contract, ((), ())), preferred_element_type=jnp.float32)


def cap_logits(logits: jax.Array, softcap: float | None) -> jax.Array:
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def project(config: DecoderConfig, params, hidden_NE: jax.Array) -> jax.Array:
    """float32 logits `[N, vocab]` of final hidden states `[N, emb]`, softcapped when configured."""
    weight, transposed = head_weight(config, params)
    return cap_logits(vocab_logits(hidden_NE.astype(config.dtype), weight.astype(config.dtype), transposed),
                      config.logit_softcap)


def head_weight(config: DecoderConfig, params) -> tuple[jax.Array, bool]:
    """The output projection and its layout: (`[emb, vocab]`, False) or the tied `[vocab, emb]`, True."""
    if config.tie_embeddings:
        return params["embed_tokens"]["embedding"], True
    return params["lm_head"]["kernel"], False
