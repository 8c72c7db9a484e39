"""DiffusionGemma's text model: a causal encoder over the prompt and a bidirectional denoiser over canvases,
one stack of Gemma-4-style layers serving both.

The encoder reads clean tokens (the prompt, then each committed canvas) and writes their keys and values
into a `PrefixCache`; the denoiser refines a canvas of `canvas_length` tokens attending to that cache and
to the whole canvas, its input embeddings mixed with a self-conditioning signal made from the previous
refinement's logits. Both share every parameter (transformers ties the encoder's to the decoder's), except
the per-layer output scalars, which the checkpoint stores once per side and Dew keeps in the `constants`
collection (frozen, as transformers keeps its buffers).

Each layer (transformers' `DiffusionGemmaDecoderTextLayer`): attention with RMS-normed queries and keys
(scaled by 1, not `head_dim ** -0.5`) and scale-free normed values; full-attention layers have their own
head width and key/value heads and use the key projection as the value (no `v_proj`); sliding layers
window the prompt. The feed-forward is a dense gated MLP beside a mixture of experts (router on the
un-normed residual, `per_expert_scale` on the chosen weights), each with its own norms, summed and normed
once more. Full layers rotate a `partial_rotary_factor` share of each head ("proportional": the rest keeps
frequency zero); sliding layers rotate all of it. Norms multiply by `scale` (Gemma 4's, not `1 + scale`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from dew.nn.head import cap_logits, vocab_logits
from dew.nn.linear import Linear
from dew.nn.mlp import ACTIVATIONS, GatedMLP
from dew.nn.moe import dispatch
from dew.nn.norms import RMSNorm
from dew.nn.rotary import apply_rotary

F32 = jnp.float32
FULL, SLIDING = "full_attention", "sliding_attention"
CONSTANTS = "constants"
ENCODER_SCALAR, DECODER_SCALAR = "encoder_layer_scalar", "decoder_layer_scalar"


@dataclasses.dataclass(frozen=True)
class Rotary:
    """One layer type's rotation: base `theta`, the rotated share `fraction` of each head and a frequency
    divisor `factor` (transformers' "proportional" rope; "default" is fraction 1, factor 1)."""

    theta: float
    fraction: float = 1.0
    factor: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """float32 `[head_dim // 2]`: `theta ** (-2i / head_dim)` for the rotated pairs, zero after them."""
        f32 = np.float32
        rotated = int(self.fraction * head_dim // 2)
        exponents = np.arange(0, 2 * rotated, 2).astype(f32) / f32(head_dim)
        inv_freq = f32(1) / (f32(self.theta) ** exponents)
        inv_freq = np.concatenate([inv_freq, np.zeros(head_dim // 2 - rotated, f32)])
        return (inv_freq / f32(self.factor)).astype(f32)


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text model's shape (see the module). `layer_types` holds FULL or SLIDING per layer;
    `head_dims` and `kv_heads` each layer's head width and key/value heads; `rotary` pairs each layer
    type with its `Rotary` (a tuple, so the config hashes). `canvas_length` is the denoiser's block; `max_seq_len` bounds prompt plus canvases."""

    vocab_size: int
    emb_features: int
    mlp_features: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    sliding_window: int
    rotary: tuple[tuple[str, Rotary], ...]
    experts: int
    top_k: int
    expert_features: int
    canvas_length: int
    max_seq_len: int
    norm_eps: float = 1e-6
    logit_softcap: float | None = 30.0
    activation: str = "gelu_tanh"
    trainable_scalars: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        layers = len(self.layer_types)
        for name in ("head_dims", "kv_heads"):
            if len(getattr(self, name)) != layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {layers} layers: give one per layer")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not built; layers are {FULL!r} or {SLIDING!r}")
        for kv in self.kv_heads:
            if self.num_heads % kv:
                raise ValueError(f"{kv} key/value heads do not divide the {self.num_heads} query heads")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {list(ACTIVATIONS)}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, experts] = [1, {self.experts}]")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


@struct.dataclass
class PrefixCache:
    """The clean tokens' keys and values, per layer `[B, T, kv_heads, head_dim]` (widths differ by layer
    type), with `valid_BT` marking filled slots, `positions_BT` their positions and `length_B` each row's
    count of cached tokens (the next position). Slots fill left to right; a row's padding sits before
    its first token and is never valid."""

    keys: tuple
    values: tuple
    valid_BT: jax.Array
    positions_BT: jax.Array
    length_B: jax.Array

    @classmethod
    def empty(cls, config: DiffusionGemmaConfig, rows: int, capacity: int) -> "PrefixCache":
        dtype = config.dtype
        shapes = [(rows, capacity, kv, hd) for kv, hd in zip(config.kv_heads, config.head_dims)]
        return cls(keys=tuple(jnp.zeros(s, dtype) for s in shapes), values=tuple(jnp.zeros(s, dtype) for s in shapes),
                   valid_BT=jnp.zeros((rows, capacity), bool), positions_BT=jnp.zeros((rows, capacity), jnp.int32),
                   length_B=jnp.zeros((rows,), jnp.int32))


def _scale_free_norm(x: jax.Array, eps: float) -> jax.Array:
    """`x / rms(x)` in float32, rounded back to `x`'s dtype (transformers' `with_scale=False` norm)."""
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _attend(q_BSHD, k_BTKD, v_BTKD, allowed_BST) -> jax.Array:
    """Softmax attention with scores scaled by 1, grouped key/value heads, float32 softmax; `[B, S, H*D]`."""
    B, S, H, D = q_BSHD.shape
    K = k_BTKD.shape[2]
    q_BSKGD = q_BSHD.reshape(B, S, K, H // K, D)
    scores = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BTKD, preferred_element_type=F32)
    scores = jnp.where(allowed_BST[:, None, None], scores, jnp.finfo(F32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v_BTKD.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", weights, v_BTKD, preferred_element_type=F32)
    return out.astype(q_BSHD.dtype).reshape(B, S, H * D)


class _Attention(nn.Module):
    config: DiffusionGemmaConfig
    index: int

    def setup(self):
        c, i = self.config, self.index
        self.head_dim, self.kv = c.head_dims[i], c.kv_heads[i]
        linear = lambda features, name: Linear(features, dtype=c.dtype, param_dtype=c.param_dtype, name=name)
        self.q_proj = linear(c.num_heads * self.head_dim, "q_proj")
        self.k_proj = linear(self.kv * self.head_dim, "k_proj")
        # full layers use their keys as values (transformers' attention_k_eq_v)
        self.v_proj = linear(self.kv * self.head_dim, "v_proj") if c.layer_types[i] == SLIDING else None
        self.o_proj = linear(c.emb_features, "o_proj")
        norm = lambda name: RMSNorm(c.norm_eps, "olmo", dtype=c.dtype, param_dtype=c.param_dtype, name=name)
        self.q_norm, self.k_norm = norm("q_norm"), norm("k_norm")

    def project(self, x_BSE, cos_BSD, sin_BSD):
        """Rotated, normed queries `[B, S, H, D]`, keys and values `[B, S, K, D]`."""
        B, S, _ = x_BSE.shape
        D, K = self.head_dim, self.kv
        q = self.q_norm(self.q_proj(x_BSE).reshape(B, S, -1, D))
        keys = self.k_proj(x_BSE).reshape(B, S, K, D)
        values = keys if self.v_proj is None else self.v_proj(x_BSE).reshape(B, S, K, D)
        k = self.k_norm(keys)
        v = _scale_free_norm(values, self.config.norm_eps)
        return apply_rotary(q, cos_BSD, sin_BSD), apply_rotary(k, cos_BSD, sin_BSD), v

    def __call__(self, q_BSHD, k_BTKD, v_BTKD, allowed_BST):
        return self.o_proj(_attend(q_BSHD, k_BTKD, v_BTKD, allowed_BST))


class _Router(nn.Module):
    """Gemma 4's router: a scale-free norm of the residual times `scale / sqrt(width)`, float32 softmax
    over `proj`, the top-k renormalised to sum one, times each chosen expert's `per_expert_scale`."""

    config: DiffusionGemmaConfig

    @nn.compact
    def __call__(self, x_ND):
        c = self.config
        D = x_ND.shape[-1]
        scale = self.param("scale", nn.initializers.ones_init(), (D,), c.param_dtype)
        per_expert = self.param("per_expert_scale", nn.initializers.ones_init(), (c.experts,), c.param_dtype)
        routed = _scale_free_norm(x_ND, c.norm_eps) * scale.astype(c.dtype) * jnp.asarray(D ** -0.5, c.dtype)
        logits_NE = Linear(c.experts, dtype=c.dtype, param_dtype=c.param_dtype, name="proj")(routed)
        probs_NE = jax.nn.softmax(logits_NE.astype(F32), axis=-1)
        weights_NK, experts_NK = jax.lax.top_k(probs_NE, c.top_k)
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
        return experts_NK, weights_NK * per_expert.astype(F32)[experts_NK]


class _Experts(nn.Module):
    """The experts' kernels `gate_proj`, `up_proj` `[E, D, F]` and `down_proj` `[E, F, D]`, dispatched
    through `dew.nn.moe.dispatch` (transformers stores gate and up fused as `gate_up_proj`)."""

    config: DiffusionGemmaConfig

    @nn.compact
    def __call__(self, x_ND, experts_NK, weights_NK):
        c = self.config
        E, D, F = c.experts, x_ND.shape[-1], c.expert_features
        kernel = lambda name, shape: self.param(name, nn.initializers.normal(0.02), shape, c.param_dtype)
        gate, up, down = kernel("gate_proj", (E, D, F)), kernel("up_proj", (E, D, F)), kernel("down_proj", (E, F, D))
        y_ND = dispatch(x_ND.astype(c.dtype), experts_NK, weights_NK, gate.astype(c.dtype), up.astype(c.dtype),
                        down.astype(c.dtype), c.activation)
        return y_ND.astype(c.dtype)


class _Layer(nn.Module):
    config: DiffusionGemmaConfig
    index: int

    def setup(self):
        c = self.config
        self.self_attn = _Attention(c, self.index)
        self.mlp = GatedMLP(c.mlp_features, c.activation, dtype=c.dtype, param_dtype=c.param_dtype)
        self.router = _Router(c)
        self.experts = _Experts(c)
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                 "pre_feedforward_layernorm_2")
        self.norms = {name: RMSNorm(c.norm_eps, "olmo", dtype=c.dtype, param_dtype=c.param_dtype, name=name)
                      for name in names}
        if c.trainable_scalars:
            self.encoder_scalar = self.param(ENCODER_SCALAR, nn.initializers.ones_init(), (1,), c.param_dtype)
            self.decoder_scalar = self.param(DECODER_SCALAR, nn.initializers.ones_init(), (1,), c.param_dtype)
        else:
            ones = lambda: jnp.ones((1,), c.param_dtype)
            self.encoder_scalar = self.variable(CONSTANTS, ENCODER_SCALAR, ones).value
            self.decoder_scalar = self.variable(CONSTANTS, DECODER_SCALAR, ones).value

    def __call__(self, x_BSE, attend, side: str):
        """One layer; `attend(self_attn, normed_BSE)` runs the attention the side's cache rules ask for."""
        n = self.norms
        residual = x_BSE
        x_BSE = residual + n["post_attention_layernorm"](attend(self.self_attn, n["input_layernorm"](x_BSE)))
        residual = x_BSE
        dense = n["post_feedforward_layernorm_1"](self.mlp(n["pre_feedforward_layernorm"](x_BSE)))
        B, S, E = x_BSE.shape
        flat_NE = x_BSE.reshape(B * S, E)
        experts_NK, weights_NK = self.router(flat_NE)
        sparse = self.experts(n["pre_feedforward_layernorm_2"](flat_NE), experts_NK, weights_NK)
        sparse = n["post_feedforward_layernorm_2"](sparse.reshape(B, S, E))
        x_BSE = residual + n["post_feedforward_layernorm"](dense + sparse)
        scalar = self.encoder_scalar if side == "encoder" else self.decoder_scalar
        return x_BSE * scalar.astype(x_BSE.dtype)


class _SelfConditioning(nn.Module):
    config: DiffusionGemmaConfig

    @nn.compact
    def __call__(self, embedded_BCE, soft_BCE):
        c = self.config
        normed = RMSNorm(c.norm_eps, "olmo", dtype=c.dtype, param_dtype=c.param_dtype, name="pre_norm")(soft_BCE)
        signal = GatedMLP(c.mlp_features, c.activation, dtype=c.dtype, param_dtype=c.param_dtype,
                          name="mlp")(normed)
        return _scale_free_norm(embedded_BCE + signal, c.norm_eps)


class DiffusionGemma(nn.Module):
    """The text model (see the module): `encode` writes clean tokens into a `PrefixCache`, `denoise`
    returns a canvas's float32 logits, `logits` caps the head's output."""

    config: DiffusionGemmaConfig

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.emb_features, param_dtype=c.param_dtype,
                                     embedding_init=nn.initializers.normal(1.0))
        self.layers = [_Layer(c, i, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.norm_eps, "olmo", dtype=c.dtype, param_dtype=c.param_dtype)
        self.self_conditioning = _SelfConditioning(c)

    def _embed(self, tokens):
        c = self.config
        table = self.embed_tokens.embedding
        return (jnp.take(table, tokens, axis=0) * jnp.asarray(c.emb_features ** 0.5, table.dtype)).astype(c.dtype)

    def _rotation(self, positions_BS):
        """cos and sin per layer type, float32 `[B, S, head_dim]`."""
        c = self.config
        tables = {}
        for layer_type in sorted(set(c.layer_types)):
            head_dim = c.head_dims[c.layer_types.index(layer_type)]
            inv_freq = jnp.asarray(dict(c.rotary)[layer_type].inverse_frequencies(head_dim))
            freqs = positions_BS.astype(F32)[..., None] * inv_freq
            angles = jnp.concatenate([freqs, freqs], axis=-1)
            tables[layer_type] = (jnp.cos(angles), jnp.sin(angles))
        return tables

    def encode(self, tokens_BS, valid_BS, cache: PrefixCache, start) -> tuple[jax.Array, PrefixCache]:
        """Encode clean tokens `[B, S]` (`valid_BS` False for padding) written at cache slots `start ..
        start + S`; their positions continue each row's count. Returns the final-normed hidden states
        `[B, S, E]` and the cache holding them."""
        c = self.config
        positions_BS = cache.length_B[:, None] + jnp.cumsum(valid_BS, axis=1, dtype=jnp.int32) - 1
        positions_BS = jnp.maximum(positions_BS, 0)
        update = lambda buffer, chunk: jax.lax.dynamic_update_slice_in_dim(buffer, chunk.astype(buffer.dtype),
                                                                            start, axis=1)
        valid_BT = update(cache.valid_BT, valid_BS)
        positions_BT = update(cache.positions_BT, positions_BS)
        causal_BST = ((positions_BT[:, None, :] <= positions_BS[:, :, None]) & valid_BT[:, None, :]
                      & valid_BS[:, :, None])
        window_BST = causal_BST & (positions_BS[:, :, None] - positions_BT[:, None, :] < c.sliding_window)
        tables = self._rotation(positions_BS)
        keys, values = list(cache.keys), list(cache.values)
        x_BSE = self._embed(tokens_BS)
        for i, layer in enumerate(self.layers):
            kind = c.layer_types[i]

            def attend(attention, normed_BSE, i=i, kind=kind):
                q, k, v = attention.project(normed_BSE, *tables[kind])
                keys[i], values[i] = update(keys[i], k), update(values[i], v)
                return attention(q, keys[i], values[i], window_BST if kind == SLIDING else causal_BST)

            x_BSE = layer(x_BSE, attend, "encoder")
        cache = PrefixCache(tuple(keys), tuple(values), valid_BT, positions_BT,
                            cache.length_B + jnp.sum(valid_BS, axis=1, dtype=jnp.int32))
        return self.norm(x_BSE), cache

    def denoise(self, canvas_BC, cache: PrefixCache, self_conditioning_BCV=None, conditioned_B=None) -> jax.Array:
        """float32 logits `[B, C, V]` for a canvas after the cached tokens: every canvas position sees the
        whole canvas and the cache (sliding layers its last `sliding_window - 1` tokens). The logits of the
        previous refinement (`self_conditioning_BCV`; None at the first) condition the input, rows where
        `conditioned_B` is False getting none."""
        c = self.config
        B, C = canvas_BC.shape
        embedded = self._embed(canvas_BC)
        table = self.embed_tokens.embedding
        if self_conditioning_BCV is None:
            soft = jnp.zeros_like(embedded)
        else:
            probs = jax.nn.softmax(self_conditioning_BCV.astype(F32), axis=-1).astype(table.dtype)
            soft = jnp.einsum("bcv,ve->bce", probs, table, preferred_element_type=F32)
            soft = (soft.astype(table.dtype) * jnp.asarray(c.emb_features ** 0.5, table.dtype)).astype(c.dtype)
            if conditioned_B is not None:
                soft = soft * conditioned_B.astype(soft.dtype)[:, None, None]
        x_BCE = self.self_conditioning(embedded, soft)
        positions_BC = cache.length_B[:, None] + jnp.arange(C, dtype=jnp.int32)
        tables = self._rotation(positions_BC)
        cached_BT = cache.valid_BT
        recent_BT = cached_BT & (cache.positions_BT > cache.length_B[:, None] - c.sliding_window)
        canvas_BC = jnp.ones((B, C), bool)
        allowed = {FULL: jnp.concatenate([cached_BT, canvas_BC], axis=1)[:, None, :],
                   SLIDING: jnp.concatenate([recent_BT, canvas_BC], axis=1)[:, None, :]}
        for i, layer in enumerate(self.layers):
            kind = c.layer_types[i]

            def attend(attention, normed_BCE, i=i, kind=kind):
                q, k, v = attention.project(normed_BCE, *tables[kind])
                keys = jnp.concatenate([cache.keys[i], k.astype(cache.keys[i].dtype)], axis=1)
                values = jnp.concatenate([cache.values[i], v.astype(cache.values[i].dtype)], axis=1)
                return attention(q, keys, values, jnp.broadcast_to(allowed[kind], (B, C, keys.shape[1])))

            x_BCE = layer(x_BCE, attend, "decoder")
        return self.logits(self.norm(x_BCE))

    def logits(self, hidden_BSE) -> jax.Array:
        """Capped float32 logits of final-normed hidden states (the head is the tied embedding)."""
        c = self.config
        lead = hidden_BSE.shape[:-1]
        table = self.embed_tokens.embedding.astype(c.dtype)
        logits_NV = vocab_logits(hidden_BSE.reshape(-1, c.emb_features), table, transposed=True)
        return cap_logits(logits_NV, c.logit_softcap).reshape(*lead, c.vocab_size)

    def __call__(self, tokens_BS, canvas_BC):
        """Initialise every parameter: encode `tokens_BS` into a fresh cache, denoise `canvas_BC` after it."""
        B, S = tokens_BS.shape
        cache = PrefixCache.empty(self.config, B, S)
        hidden, cache = self.encode(tokens_BS, jnp.ones((B, S), bool), cache, 0)
        return self.logits(hidden), self.denoise(canvas_BC, cache, jnp.zeros(canvas_BC.shape + (self.config.vocab_size,)))


def scalars_as(variables, trainable: bool) -> dict:
    """`variables` with the per-layer scalars moved into `params` (`trainable`) or into `constants`; any other
    collection is kept as it is."""
    variables = {name: dict(tree) for name, tree in variables.items()}
    source, target = (CONSTANTS, "params") if trainable else ("params", CONSTANTS)
    moved = variables.setdefault(target, {})
    for scope, leaves in list(variables.get(source, {}).items()):
        scalars = {name: leaves[name] for name in (ENCODER_SCALAR, DECODER_SCALAR) if name in leaves}
        if not scalars:
            continue
        rest = {name: leaf for name, leaf in leaves.items() if name not in scalars}
        if rest:
            variables[source][scope] = rest
        else:
            del variables[source][scope]
        moved[scope] = {**moved.get(scope, {}), **scalars}
    if not variables.get(CONSTANTS):
        variables.pop(CONSTANTS, None)
    return variables


__all__ = ["CONSTANTS", "scalars_as", "DiffusionGemma", "DiffusionGemmaConfig", "PrefixCache", "Rotary"]
