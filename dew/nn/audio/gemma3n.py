"""Gemma 3n's audio tower: log-mel frames `[B, T, F]` to `AudioEncoding` at a sixteenth of the frame rate.

transformers' `Gemma3nAudioEncoder` (`gemma3n/modeling_gemma3n.py`). Two subsampling convolutions
(`subsample_conv_projection/conv_{0,1}`): each a bias-free 2-D convolution over (time, mel), padded by
one bin on each side of the mel axis and by `kernel - 1` frames after the last (a frame reads itself and
the frames after it), a cumulative group norm (each frame normalized by the mean and variance of every
value up to it), and a ReLU; the (mel, channel) values of a frame flattened and projected to the width
(`input_proj_linear`). The mask follows: frame t after them is the input frame t * (product of the time
strides). Then conformer layers (`conformer/layers_0to{L-1}`, scanned): a half-step feed-forward
(`ffw_layer_start`), chunked local attention (`attention`), the padding frames zeroed, a light
convolution (`lconv1d`: GLU, a causal depthwise convolution, norm, SiLU), a second half-step feed-forward
(`ffw_layer_end`) and a norm. Every fourth (`conf_reduction_factor`) frame is kept, and padding frames
are zero.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.nn.audio.base import (AudioEncoding, LocalWindow, TowerPart, Weight, causal_depthwise_conv, check_features,
                               glu, local_attention, read_record, require_number, require_positive, sinusoids,
                               to_record)

MODEL_TYPE = "gemma3n_audio"


@dataclasses.dataclass(frozen=True)
class Gemma3nAudio:
    """The fields of transformers' `Gemma3nAudioConfig`, with its defaults. `vocab_size` and `vocab_offset`
    belong to the model's audio embedder (`embed_audio`), not to the tower; they are kept to be written back."""

    vocab_size: int = 128
    vocab_offset: int = 262_272
    input_feat_size: int = 128
    hidden_size: int = 1536
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    conf_attention_chunk_size: int = 12
    conf_attention_context_left: int = 13
    conf_attention_context_right: int = 0
    conf_attention_logit_cap: float = 50.0
    conf_num_attention_heads: int = 8
    conf_num_hidden_layers: int = 12
    conf_conv_kernel_size: int = 5
    conf_reduction_factor: int = 4
    conf_residual_weight: float = 0.5
    sscp_conv_channel_size: tuple[int, int] = (128, 32)
    sscp_conv_group_norm_eps: float = 1e-3
    sscp_conv_kernel_size: tuple[tuple[int, int], tuple[int, int]] = ((3, 3), (3, 3))
    sscp_conv_stride_size: tuple[tuple[int, int], tuple[int, int]] = ((2, 2), (2, 2))

    def __post_init__(self):
        require_positive(self, ("vocab_size", "input_feat_size", "hidden_size", "conf_attention_chunk_size",
                                "conf_attention_context_left", "conf_num_attention_heads", "conf_num_hidden_layers",
                                "conf_conv_kernel_size", "conf_reduction_factor"))
        if not isinstance(self.conf_attention_context_right, int) or self.conf_attention_context_right < 0:
            raise ValueError(f"conf_attention_context_right is {self.conf_attention_context_right!r}; it must be an "
                             "integer of at least 0")
        if self.hidden_size % self.conf_num_attention_heads or self.hidden_size % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be even and split into conf_num_attention_heads "
                             f"{self.conf_num_attention_heads} equal heads")
        for field in ("rms_norm_eps", "gradient_clipping", "conf_attention_logit_cap", "sscp_conv_group_norm_eps"):
            require_number(self, field, low=0)
        require_number(self, "conf_residual_weight")
        for field in ("sscp_conv_channel_size", "sscp_conv_kernel_size", "sscp_conv_stride_size"):
            value = getattr(self, field)
            pairs = field != "sscp_conv_channel_size"
            ok = isinstance(value, tuple) and len(value) == 2 and all(
                (isinstance(item, tuple) and len(item) == 2 and all(_positive(x) for x in item)) if pairs
                else _positive(item) for item in value)
            if not ok:
                shape = "two (time, mel) pairs of positive integers" if pairs else "two positive integers"
                raise ValueError(f"{field} is {value!r}; Gemma 3n's tower has two subsampling convolutions: give "
                                 f"{shape}")

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Gemma3nAudio":
        """The config an `audio_config` record describes (see `dew.nn.audio.base.read_record`)."""
        return read_record(cls, record, where, MODEL_TYPE, "Gemma3nAudioConfig",
                           ("sscp_conv_channel_size", "sscp_conv_kernel_size", "sscp_conv_stride_size"))

    def to_hf(self) -> dict[str, Any]:
        """The `audio_config` record of this tower, for a config.json."""
        return to_record(self, MODEL_TYPE)

    @property
    def mel_features(self) -> int:
        """The log-mel bins of a frame the tower reads (`F`)."""
        return self.input_feat_size

    @property
    def frame_stride(self) -> int:
        """Input frames per output frame: the time strides' product times the reduction factor."""
        return math.prod(stride for stride, _ in self.sscp_conv_stride_size) * self.conf_reduction_factor

    def encoded_frames(self, frames: int) -> int:
        """The frames the tower gives for `frames` input frames (each time convolution keeps `ceil(T / stride)`,
        then every `conf_reduction_factor`-th); of real frames first, the real ones it gives."""
        for stride, _ in self.sscp_conv_stride_size:
            frames = -(-frames // stride)
        return -(-frames // self.conf_reduction_factor)

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Gemma3nAudioEncoder":
        """The tower computing its projections in `dtype` (norms, attention and convolutions in float32) with
        parameters stored in `param_dtype`."""
        return Gemma3nAudioEncoder(self, dtype, param_dtype)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class _Part(TowerPart):
    config: Gemma3nAudio


class SubsampleConvolution(_Part):
    """One subsampling block: convolution, cumulative group norm, ReLU; `[B, T, F, Cin] -> [B, T', F', Cout]`."""

    index: int = 0

    @nn.compact
    def __call__(self, x_BTFC: jax.Array) -> jax.Array:
        c, i = self.config, self.index
        (kt, kf), stride = c.sscp_conv_kernel_size[i], c.sscp_conv_stride_size[i]
        channels_in = 1 if i == 0 else c.sscp_conv_channel_size[i - 1]
        channels = c.sscp_conv_channel_size[i]
        kernel = Weight((kt, kf, channels_in, channels), "kernel", self.param_dtype, name="conv")()
        # time: a frame reads itself and the kt-1 after it; mel: one bin of zeros a side
        y = jax.lax.conv_general_dilated(x_BTFC.astype(jnp.float32), kernel.astype(jnp.float32), stride,
                                         ((0, kt - 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         precision="highest")
        scale = Weight((channels,), "scale", self.param_dtype, name="norm")()
        return jax.nn.relu(_cumulative_group_norm(y, scale, c.sscp_conv_group_norm_eps))


def _cumulative_group_norm(y_BTFC: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Each frame normalized by statistics of every (mel, channel) value of the frames up to it: the running
    mean m_t, and the running sum over frames s <= t of frame s's squared deviations from m_s, divided by the
    values counted; times `scale` per channel. Later frames (padding) never reach earlier ones."""
    per_frame = y_BTFC.shape[2] * y_BTFC.shape[3]
    counts = per_frame * jnp.arange(1, y_BTFC.shape[1] + 1, dtype=jnp.float32)[None, :, None, None]
    mean = jnp.cumsum(jnp.sum(y_BTFC, axis=(2, 3), keepdims=True), axis=1) / counts
    deviations = jnp.sum(jnp.square(y_BTFC - mean), axis=(2, 3), keepdims=True)
    variance = jnp.cumsum(deviations, axis=1) / counts
    return (y_BTFC - mean) * jax.lax.rsqrt(variance + eps) * scale.astype(jnp.float32)


class SubsampleConvProjection(_Part):
    """Frames `[B, T, F]` through both subsampling blocks, each frame's (mel, channel) values flattened
    (channel fastest) and projected to `hidden_size`: `[B, T', hidden]`."""

    @nn.compact
    def __call__(self, x_BTF: jax.Array) -> jax.Array:
        c = self.config
        y = SubsampleConvolution(c, self.dtype, self.param_dtype, 0, name="conv_0")(x_BTF[..., None])
        y = SubsampleConvolution(c, self.dtype, self.param_dtype, 1, name="conv_1")(y)
        B, T = y.shape[:2]
        return self.linear(c.hidden_size, (None, "embed"), "input_proj_linear")(y.reshape(B, T, -1))


class FeedForward(_Part):
    """`x + residual_weight * norm(W2 silu(W1 norm(x)))`, the inner width four times the model's."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = self.norm(self.clip(x), "pre_layer_norm").astype(self.dtype)
        h = jax.nn.silu(self.linear(4 * c.hidden_size, ("embed", "mlp"), "ffw_layer_1")(h).astype(jnp.float32))
        h = self.clip(self.linear(c.hidden_size, ("mlp", "embed"), "ffw_layer_2")(h.astype(self.dtype)))
        return x + c.conf_residual_weight * self.norm(h, "post_layer_norm")


class Attention(_Part):
    """Gemma 3n's chunked local attention (`attn`): queries scaled by `softplus(per_dim_scale) / (ln 2 sqrt(H))`,
    a relative term from sinusoids of the offsets past..-future projected per head (`relative_position_embedding/
    pos_proj`), logits capped at `conf_attention_logit_cap`; a query reads the keys from `context_left - 1`
    frames before it to `context_right` after it. `[B, T, N, H]`."""

    @nn.compact
    def __call__(self, x, valid_BT):
        c = self.config
        N, D = c.conf_num_attention_heads, x.shape[-1]
        q, k, v = self.heads(x, N, lambda name: self.linear(D, ("embed", "heads"), name))
        past, future = c.conf_attention_context_left - 1, c.conf_attention_context_right
        table = sinusoids(np.arange(past, -future - 1, -1), D)
        position = RelativePosition(c, self.dtype, self.param_dtype, name="relative_position_embedding")(table)
        window = LocalWindow(c.conf_attention_chunk_size, past, future, -past, future)
        return local_attention(q, k, v, position.reshape(-1, N, D // N), valid_BT, window, c.conf_attention_logit_cap,
                               float(jnp.finfo(jnp.float32).min))


class RelativePosition(_Part):
    """The offsets' sinusoids projected to every head (`pos_proj`, no bias)."""

    @nn.compact
    def __call__(self, table):
        return self.linear(self.config.hidden_size, ("embed", "heads"), "pos_proj")(jnp.asarray(table, self.dtype))


class ConformerAttention(_Part):
    """`x + norm(post(attn(norm(x))))`, the attention's input and output clipped."""

    @nn.compact
    def __call__(self, x, valid_BT):
        c = self.config
        h = self.norm(self.clip(x), "pre_attn_norm").astype(self.dtype)
        h = Attention(c, self.dtype, self.param_dtype, name="attn")(h, valid_BT)
        h = self.linear(c.hidden_size, ("heads", "embed"), "post")(h.reshape(x.shape).astype(self.dtype))
        return x + self.norm(self.clip(h), "post_norm")


class LightConv(_Part):
    """`x + W_end silu(norm(clip(conv(glu(W_start norm(x))))))`, the convolution causal and per channel."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = self.norm(x, "pre_layer_norm", c.rms_norm_eps).astype(self.dtype)
        h = glu(self.linear(2 * c.hidden_size, ("embed", "mlp"), "linear_start")(h))
        kernel = Weight((c.conf_conv_kernel_size, 1, c.hidden_size), "kernel", self.param_dtype,
                        name="depthwise_conv1d")()
        h = self.clip(causal_depthwise_conv(h, kernel))
        h = jax.nn.silu(self.norm(h, "conv_norm", c.rms_norm_eps)).astype(self.dtype)
        return x + self.linear(c.hidden_size, ("mlp", "embed"), "linear_end")(h).astype(jnp.float32)


class ConformerLayer(_Part):
    """One conformer block; a scan step over (states, validity)."""

    @nn.compact
    def __call__(self, x, valid_BT):
        c, dtype, param_dtype = self.config, self.dtype, self.param_dtype
        x = FeedForward(c, dtype, param_dtype, name="ffw_layer_start")(x)
        x = ConformerAttention(c, dtype, param_dtype, name="attention")(x, valid_BT)
        x = LightConv(c, dtype, param_dtype, name="lconv1d")(jnp.where(valid_BT[..., None], x, 0.0))
        x = FeedForward(c, dtype, param_dtype, name="ffw_layer_end")(x)
        return self.norm(self.clip(x), "norm"), None


class Gemma3nAudioEncoder(_Part):
    """`input_features [B, T, input_feat_size]` and `input_features_mask [B, T]` (true at audio frames) to
    `AudioEncoding(features [B, T'', hidden], mask [B, T''])`, float32 features; see the module."""

    @nn.compact
    def __call__(self, input_features, input_features_mask) -> AudioEncoding:
        c = self.config
        check_features(input_features, input_features_mask, c.input_feat_size, "Gemma 3n")
        x = SubsampleConvProjection(c, self.dtype, self.param_dtype, name="subsample_conv_projection")(input_features)
        x = x.astype(jnp.float32)
        strides = math.prod(stride for stride, _ in c.sscp_conv_stride_size)
        frames = np.minimum(np.arange(x.shape[1]) * strides, input_features.shape[1] - 1)
        valid_BT = input_features_mask[:, frames]
        x, _ = _Conformer(c, self.dtype, self.param_dtype, name="conformer")(x, valid_BT)
        x, valid_BT = x[:, ::c.conf_reduction_factor], valid_BT[:, ::c.conf_reduction_factor]
        return AudioEncoding(jnp.where(valid_BT[..., None], x, 0.0), valid_BT)


class _Conformer(_Part):
    """The conformer layers as one `nn.scan` named `layers_0to{L-1}`."""

    @nn.compact
    def __call__(self, x, valid_BT):
        layers = self.config.conf_num_hidden_layers
        stack = nn.scan(ConformerLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers,
                        in_axes=nn.broadcast, metadata_params={nn.PARTITION_NAME: "layers"})
        return stack(self.config, self.dtype, self.param_dtype, name=f"layers_0to{layers - 1}")(x, valid_BT)


__all__ = ["MODEL_TYPE", "Gemma3nAudio", "Gemma3nAudioEncoder"]
