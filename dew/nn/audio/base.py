"""What Gemma 3n's and Gemma 4's audio towers share: the encoding they return, the reading of their
`audio_config` records, and the conformer's pieces (a Gemma RMSNorm, a depthwise causal convolution, a
sinusoid table, and chunked local self-attention with a relative position term).

Both towers are Universal Speech Model conformers: log-mel frames `[B, T, F]` through two strided 2-D
convolutions (4x fewer frames), then conformer layers whose attention lets a frame read a fixed window of
frames around it, computed block by block: the frames in chunks of `chunk` queries, each chunk reading a
context of `chunk + past + future` keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.nn.linear import Linear, named

# Keys an `audio_config` record may hold that change nothing a tower computes: transformers' bookkeeping
# (4.x and 5.x), the weights' dtype (the loader chooses Dew's) and initialisers.
INERT = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "dtype",
    "torch_dtype", "use_bfloat16", "initializer_range", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "attn_implementation", "_attn_implementation_autoset", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tie_word_embeddings", "base_config_key",
})


class AudioEncoding(NamedTuple):
    """An audio tower's output: `features [B, frames, width]` at the tower's frame rate, zero at padding, and
    `mask [B, frames]`, true where a frame encodes audio (the input mask subsampled to that rate)."""

    features: jax.Array
    mask: jax.Array


def read_record(cls, record: Mapping[str, Any], where: str, model_type: str, reference: str,
                lists: tuple[str, ...] = ()):
    """The frozen config `cls` that an `audio_config` record (a dict, as config.json holds it) describes,
    transformers' defaults standing for absent fields. Another `model_type`, or a field that is neither
    one of `cls`'s nor inert, is refused by name (`where` names the record, `reference` transformers'
    class); the `lists` fields are read as tuples (of tuples)."""
    found = record.get("model_type", model_type)
    if found != model_type:
        raise ValueError(f"{where} has model_type {found!r}; this audio tower is transformers' {model_type!r}")
    fields = {field.name for field in dataclasses.fields(cls)}
    for name, value in record.items():
        if name not in fields and name not in INERT:
            raise ValueError(f"{where} field {name!r} = {value!r} is not a field of transformers' {reference} that "
                             "Dew computes: remove it if the tower was trained without it")
    values = {name: record[name] for name in fields if name in record}
    for name in lists:
        if name in values:
            values[name] = _tuples(values[name])
    try:
        return cls(**values)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _tuples(value):
    return tuple(_tuples(item) for item in value) if isinstance(value, (list, tuple)) else value


def to_record(config, model_type: str) -> dict[str, Any]:
    """A config's `audio_config` record, tuples written as lists (as config.json holds them)."""
    lists = lambda value: [lists(item) for item in value] if isinstance(value, tuple) else value
    return {"model_type": model_type, **{name: lists(value) for name, value in dataclasses.asdict(config).items()}}


def require_positive(config, fields: tuple[str, ...], what: str = "positive integer") -> None:
    """Refuse a config whose `fields` are not each a positive integer (a bool is not one), naming the field."""
    for field in fields:
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} is {value!r}; it must be a {what}")


def require_number(config, field: str, low: float | None = None) -> None:
    """Refuse a field that is not a number (above `low` when given), naming it."""
    value = getattr(config, field)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (low is not None and not value > low):
        raise ValueError(f"{field} is {value!r}; it must be a number" + ("" if low is None else f" above {low}"))


def check_features(input_features, input_features_mask, features: int | None, tower: str) -> None:
    """Refuse inputs other than float `[B, T, features]` frames with a boolean `[B, T]` mask, naming the shapes."""
    shape = tuple(input_features.shape)
    if len(shape) != 3 or (features is not None and shape[2] != features):
        wanted = "F" if features is None else features
        raise ValueError(f"input_features have shape {shape}; the {tower} audio tower reads [B, T, {wanted}] log-mel "
                         "frames, as its feature extractor (dew.data.audio.AudioProcessor) writes them")
    if tuple(input_features_mask.shape) != shape[:2] or input_features_mask.dtype != jnp.bool_:
        raise ValueError(f"input_features_mask is {input_features_mask.dtype} {tuple(input_features_mask.shape)}; the "
                         f"{tower} audio tower reads a boolean mask {shape[:2]}, true at the frames that hold audio")


class Weight(nn.Module):
    """One parameter `leaf` of `shape` in its own scope (a convolution's `kernel`, a norm's `scale`), as
    transformers names it `<scope>.weight`: a scale starts at one, anything else at lecun-normal values."""

    shape: tuple[int, ...]
    leaf: str
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        init = nn.initializers.ones_init() if self.leaf == "scale" else nn.initializers.lecun_normal()
        return self.param(self.leaf, named(init, (None,) * len(self.shape)), self.shape, self.param_dtype)


class TowerPart(nn.Module):
    """A module of an audio tower: its config, the dtype its projections compute in and the dtype of its
    parameters; norms, attention and convolutions compute in float32."""

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def linear(self, features: int, names: tuple[str | None, str | None], name: str, bias: bool = False) -> Linear:
        return Linear(features, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype, names=names, name=name)

    def norm(self, x: jax.Array, name: str, eps: float = 1e-6) -> jax.Array:
        """transformers' RMSNorm of these towers (`eps` its default unless the caller passes the config's)."""
        return rms_norm(x, Weight((x.shape[-1],), "scale", self.param_dtype, name=name)(), eps)

    def heads(self, x: jax.Array, heads: int, project) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values `[B, T, heads, H]` in float32 of `x` through the projections `project(name)`
        (`q_proj`, `k_proj`, `v_proj`), the queries scaled by `softplus(per_dim_scale) / (ln 2 sqrt(H))` (one at
        the learned scale's start, zero)."""
        B, T, D = x.shape
        H = D // heads
        q, k, v = (project(name)(x).astype(jnp.float32).reshape(B, T, heads, H)
                   for name in ("q_proj", "k_proj", "v_proj"))
        per_dim_scale = self.param("per_dim_scale", named(nn.initializers.zeros_init(), (None,)), (H,),
                                   self.param_dtype)
        return q * (H**-0.5 / np.log(2)) * jax.nn.softplus(per_dim_scale.astype(jnp.float32)), k, v

    def clip(self, x: jax.Array) -> jax.Array:
        """`x` clipped to the config's `gradient_clipping` (in the forward pass too, as the reference does)."""
        bound = self.config.gradient_clipping
        return jnp.clip(x, -bound, bound)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """`x / rms(x) * scale` over the last axis in float32 (Gemma 3n's and 4's audio norms: the scale starts at
    one and multiplies as it is)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps) * scale.astype(jnp.float32)


def causal_depthwise_conv(x_BTD: jax.Array, kernel_K1D: jax.Array) -> jax.Array:
    """Each channel convolved over time with its own `K` taps, frame t reading frames t-K+1..t (zeros before
    the start): `y[t] = sum_k kernel[k] * x[t - K + 1 + k]`, float32."""
    K, T = kernel_K1D.shape[0], x_BTD.shape[1]
    padded = jnp.pad(x_BTD.astype(jnp.float32), ((0, 0), (K - 1, 0), (0, 0)))
    kernel = kernel_K1D[:, 0].astype(jnp.float32)
    return sum(padded[:, k:k + T] * kernel[k] for k in range(K))


def glu(x: jax.Array) -> jax.Array:
    """The first half of the last axis gated by the sigmoid of the second half."""
    a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return a * jax.nn.sigmoid(b)


def sinusoids(positions: np.ndarray, width: int) -> np.ndarray:
    """`[sin(p * w_i), cos(p * w_i)]` for each position p, over `width // 2` timescales geometric from 1 to
    10^4 (w_i = 10^(-4 i / (width/2 - 1))), float32 `[len(positions), width]`. The rates and angles are
    rounded to float32 as the reference rounds them; the sines are taken in float64 and rounded once."""
    count = width // 2
    rates = np.exp((np.arange(count) * -(np.log(1.0e4) / max(count - 1, 1))).astype(np.float32))
    angles = (np.asarray(positions, np.float32)[:, None] * rates[None]).astype(np.float64)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class LocalWindow:
    """Chunked local attention's geometry: queries in chunks of `chunk` frames, each chunk reading the keys
    from `past` frames before it to `future` frames after it (a context of `chunk + past + future`), of which
    a query reads those at an offset `key - query` in `[lowest, highest]`. The relative position term
    `position[f]` belongs to the offset `f - past` for f in `[0, len(position))` and is zero beyond."""

    chunk: int
    past: int
    future: int
    lowest: int
    highest: int

    @property
    def context(self) -> int:
        return self.chunk + self.past + self.future


def local_attention(q_BTNH, k_BTNH, v_BTNH, position_FNH, valid_BT, window: LocalWindow, softcap: float,
                    fill: float) -> jax.Array:
    """Chunked local self-attention (see `LocalWindow`): `softmax(cap(q.k + q.position))` over the keys a
    query reads that hold audio (`valid_BT`), every other logit replaced by `fill`; float32 `[B, T, N, H]`.
    `cap(x) = softcap * tanh(x / softcap)`. Queries come scaled; a query that reads no key averages its
    chunk's context uniformly, as the reference does (its frame is padding)."""
    B, T, N, H = q_BTNH.shape
    W, P, C = window.chunk, window.past, window.context
    U = -(-T // W)  # chunks
    f32 = lambda x: x.astype(jnp.float32)
    q_BUWNH = jnp.pad(f32(q_BTNH), ((0, 0), (0, U * W - T), (0, 0), (0, 0))).reshape(B, U, W, N, H)
    # key slot c of chunk u is frame u*W - P + c; frames outside [0, T) are zeros that no query reads
    slots_UC = np.arange(U)[:, None] * W + np.arange(C)[None, :]
    edges = ((0, 0), (P, window.future + W - 1))
    k_BUCNH = jnp.pad(f32(k_BTNH), edges + ((0, 0), (0, 0)))[:, slots_UC]
    v_BUCNH = jnp.pad(f32(v_BTNH), edges + ((0, 0), (0, 0)))[:, slots_UC]
    valid_BUC = jnp.pad(valid_BT, edges)[:, slots_UC]
    content_BNUWC = jnp.einsum("buwnh,bucnh->bnuwc", q_BUWNH, k_BUCNH, precision="highest")
    # the relative term of query w and key slot c is position[c - w] (offset c - w - P), zero outside the table
    F = position_FNH.shape[0]
    offset_WC = np.arange(C)[None, :] - np.arange(W)[:, None]
    relative_BNUWF = jnp.einsum("buwnh,fnh->bnuwf", q_BUWNH, f32(position_FNH), precision="highest")
    relative_BNUWC = relative_BNUWF[..., np.arange(W)[:, None], np.clip(offset_WC, 0, F - 1)]
    relative_BNUWC = jnp.where(jnp.asarray((offset_WC >= 0) & (offset_WC < F)), relative_BNUWC, 0.0)
    logits = content_BNUWC + relative_BNUWC
    logits = softcap * jnp.tanh(logits / softcap)
    reads_WC = (offset_WC - P >= window.lowest) & (offset_WC - P <= window.highest)
    allowed = jnp.asarray(reads_WC)[None, None, None] & valid_BUC[:, None, :, None, :]
    probabilities = jax.nn.softmax(jnp.where(allowed, logits, fill), axis=-1)
    out_BUWNH = jnp.einsum("bnuwc,bucnh->buwnh", probabilities, v_BUCNH, precision="highest")
    return out_BUWNH.reshape(B, U * W, N, H)[:, :T]


__all__ = ["AudioEncoding", "LocalWindow", "TowerPart", "Weight", "causal_depthwise_conv", "check_features", "glu",
           "local_attention", "read_record", "rms_norm", "sinusoids", "to_record"]
