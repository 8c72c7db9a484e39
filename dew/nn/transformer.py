"""`CausalTransformer`: the one decoder every family configures (RMSNorm, rotary, GQA, SwiGLU).

Its parameter tree uses the transformers decoder names (`embed_tokens`, `layers_N.self_attn.q_proj`,
`mlp.gate_proj`, `norm`, `lm_head`), so a checkpoint maps tensor to tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.attention import Attention
from dew.nn.kv_cache import LayerCache
from dew.nn.mlp import GatedMLP
from dew.nn.norms import RMSNorm
from dew.nn.rotary import rotary_angles

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("dtype", as_dtype(self.dtype))
        set_("param_dtype", as_dtype(self.param_dtype))
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
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window is {self.sliding_window}; use None for full attention or a width >= 1")


class DecoderLayer(nn.Module):
    config: DecoderConfig

    @nn.compact
    def __call__(self, x_BSE, rotary, slots_BS, segments_BS, cache: LayerCache | None):
        c = self.config
        norm = lambda name: RMSNorm(c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name=name)
        attention = Attention(
            c.num_heads, c.num_kv_heads, c.head_dim, causal=c.causal, window=c.sliding_window,
            qk_norm=c.qk_norm, norm_eps=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name="self_attn",
        )
        attended, cache = attention(norm("input_layernorm")(x_BSE), rotary, slots_BS, segments_BS, cache)
        x_BSE = x_BSE + attended
        mlp = GatedMLP(c.mlp_features, dtype=c.dtype, param_dtype=c.param_dtype, name="mlp")
        return x_BSE + mlp(norm("post_attention_layernorm")(x_BSE)), cache


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
        rotary = rotary_angles(positions, c.head_dim, c.rope_theta)
        new_cache = []
        for i in range(c.num_layers):
            layer_cache = None if cache is None else cache[i]
            x_BSE, layer_cache = DecoderLayer(c, name=f"layers_{i}")(x_BSE, rotary, slots_BS, segments_BS, layer_cache)
            new_cache.append(layer_cache)
        hidden_BSE = RMSNorm(c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name="norm")(x_BSE)
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
