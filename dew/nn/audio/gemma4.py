"""Gemma 4's audio tower: log-mel frames `[B, T, F]` to `AudioEncoding` at a quarter of the frame rate.

transformers' `Gemma4AudioModel` (`gemma4/modeling_gemma4.py`). Two subsampling blocks
(`subsample_conv_projection/layer{0,1}`): the padding frames zeroed, a bias-free 3x3 convolution of
stride 2 over (time, mel) padded by one on every side, a LayerNorm over channels (scale only) and a ReLU,
the mask keeping every second frame; each frame's (mel, channel) values flattened and projected to the
width (`input_proj_linear`). Then conformer layers (`layers_0to{L-1}`, scanned): a half-step
feed-forward (`feed_forward1`), chunked local attention between two norms (`self_attn`), a light
convolution (`lconv1d`), a second half-step feed-forward (`feed_forward2`) and a norm; and a biased
projection to `output_proj_dims` (`output_proj`). Padding frames are zero.

With `use_clipped_linears` every projection inside the layers clips its input and its output to bounds
the checkpoint holds (`input_min`, `input_max`, `output_min`, `output_max`): they are frozen values, kept
in the `constants` collection beside the parameters, never trained.
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
from dew.nn.linear import named
from dew.nn.mlp import ACTIVATIONS

MODEL_TYPE = "gemma4_audio"
CONSTANTS = "constants"  # the collection of frozen values: the clipping bounds
# transformers' activation names (`hidden_act`) and the Dew activation (dew.nn.mlp) each one is.
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclasses.dataclass(frozen=True)
class Gemma4Audio:
    """The fields of transformers' `Gemma4AudioConfig`, with its defaults."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    def __post_init__(self):
        require_positive(self, ("hidden_size", "num_hidden_layers", "num_attention_heads", "conv_kernel_size",
                                "attention_chunk_size", "output_proj_dims"))
        if not isinstance(self.attention_context_left, int) or self.attention_context_left < 2:
            raise ValueError(f"attention_context_left is {self.attention_context_left!r}; Gemma 4's frames read the "
                             "attention_context_left - 1 frames up to and including themselves: give at least 2")
        if not isinstance(self.attention_context_right, int) or self.attention_context_right < 0:
            raise ValueError(f"attention_context_right is {self.attention_context_right!r}; it must be an integer of "
                             "at least 0")
        if self.hidden_size % self.num_attention_heads or self.hidden_size % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must be even and split into num_attention_heads "
                             f"{self.num_attention_heads} equal heads")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act is {self.hidden_act!r}; Dew computes Gemma 4's audio tower with "
                             f"{sorted(HIDDEN_ACTS)} (transformers' names)")
        for field in ("rms_norm_eps", "gradient_clipping", "attention_logit_cap"):
            require_number(self, field, low=0)
        require_number(self, "residual_weight")
        require_number(self, "attention_invalid_logits_value")
        if not isinstance(self.use_clipped_linears, bool):
            raise ValueError(f"use_clipped_linears is {self.use_clipped_linears!r}; it must be true or false")
        channels = self.subsampling_conv_channels
        if not (isinstance(channels, tuple) and len(channels) == 2 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 4 for x in channels)):
            raise ValueError(f"subsampling_conv_channels is {channels!r}; Gemma 4's tower has two subsampling "
                             "convolutions: give two integers of at least 4")

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Gemma4Audio":
        """The config an `audio_config` record describes (see `dew.nn.audio.base.read_record`)."""
        return read_record(cls, record, where, MODEL_TYPE, "Gemma4AudioConfig", ("subsampling_conv_channels",))

    def to_hf(self) -> dict[str, Any]:
        """The `audio_config` record of this tower, for a config.json."""
        return to_record(self, MODEL_TYPE)

    @property
    def mel_features(self) -> int:
        """The log-mel bins of a frame the input projection fits: it reads `subsampling_conv_channels[0] // 4`
        bins after the two stride-2 convolutions (the published tower: 128 channels, 128 bins); any F with
        `ceil(F / 4)` that many fits, this is the largest."""
        return 4 * (self.subsampling_conv_channels[0] // 4)

    @property
    def frame_stride(self) -> int:
        """Input frames per output frame."""
        return 4

    def encoded_frames(self, frames: int) -> int:
        """The frames the tower gives for `frames` input frames (each stride-2 convolution, padded by one a side,
        keeps `ceil(T / 2)`); of real frames first, the real ones it gives."""
        for _ in range(2):
            frames = -(-frames // 2)
        return frames

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Gemma4AudioEncoder":
        """The tower computing its projections in `dtype` (norms, attention and convolutions in float32) with
        parameters stored in `param_dtype`; the clipping bounds are float32 constants."""
        return Gemma4AudioEncoder(self, dtype, param_dtype)


class _Part(TowerPart):
    config: Gemma4Audio

    def clippable(self, features: int, names, name: str) -> "ClippableLinear":
        return ClippableLinear(self.config, self.dtype, self.param_dtype, features, names, name=name)

    def activation(self, x):
        return ACTIVATIONS[HIDDEN_ACTS[self.config.hidden_act]](x.astype(jnp.float32))


class ClippableLinear(TowerPart):
    """A bias-free projection (`linear`) whose input and output are clipped to the constants `input_min`,
    `input_max`, `output_min`, `output_max` where the config clips (they start unbounded: a checkpoint sets them)."""

    features: int = 0
    names: tuple = (None, None)

    @nn.compact
    def __call__(self, x):
        clipped = self.config.use_clipped_linears
        bounds = {name: self.variable(CONSTANTS, name, lambda value: jnp.asarray(value, jnp.float32),
                                      -jnp.inf if name.endswith("min") else jnp.inf).value
                  for name in (_BOUNDS if clipped else ())}
        if clipped:
            x = jnp.clip(x.astype(jnp.float32), bounds["input_min"], bounds["input_max"])
        y = self.linear(self.features, self.names, "linear")(x.astype(self.dtype)).astype(jnp.float32)
        return jnp.clip(y, bounds["output_min"], bounds["output_max"]) if clipped else y


class SubsampleLayer(_Part):
    """The padding frames zeroed, then a 3x3 stride-2 convolution (one of padding a side), a LayerNorm over
    channels and a ReLU: `[B, T, F, Cin], [B, T] -> [B, ceil(T/2), ceil(F/2), C]` and the mask's even frames."""

    channels: int = 0

    @nn.compact
    def __call__(self, x_BTFC, valid_BT):
        x_BTFC = jnp.where(valid_BT[:, :, None, None], x_BTFC.astype(jnp.float32), 0.0)
        kernel = Weight((3, 3, x_BTFC.shape[-1], self.channels), "kernel", self.param_dtype, name="conv")()
        y = jax.lax.conv_general_dilated(x_BTFC, kernel.astype(jnp.float32), (2, 2), ((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest")
        y = nn.LayerNorm(self.config.rms_norm_eps, dtype=jnp.float32, param_dtype=self.param_dtype, use_bias=False,
                         use_fast_variance=False, scale_init=named(nn.initializers.ones_init(), (None,)),
                         name="norm")(y)
        return jax.nn.relu(y), valid_BT[:, ::2]


class SubsampleConvProjection(_Part):
    """Frames `[B, T, F]` and their mask through both blocks, each frame's (mel, channel) values flattened
    (channel fastest) and projected to `hidden_size`: `[B, T', hidden]` and the mask `[B, T']`."""

    @nn.compact
    def __call__(self, x_BTF, valid_BT):
        c = self.config
        first, second = c.subsampling_conv_channels
        y, valid_BT = SubsampleLayer(c, self.dtype, self.param_dtype, first, name="layer0")(x_BTF[..., None], valid_BT)
        y, valid_BT = SubsampleLayer(c, self.dtype, self.param_dtype, second, name="layer1")(y, valid_BT)
        B, T, F, C = y.shape
        if F != first // 4:
            raise ValueError(f"input_features have {x_BTF.shape[2]} mel bins, {F} after the two stride-2 convolutions; "
                             f"this Gemma 4 tower's input projection reads {first // 4} (subsampling_conv_channels[0] "
                             f"// 4): give frames of {c.mel_features} bins, as its feature extractor writes them")
        return self.linear(c.hidden_size, (None, "embed"), "input_proj_linear")(y.reshape(B, T, F * C)), valid_BT


class FeedForward(_Part):
    """`x + residual_weight * norm(clip(W2 act(W1 norm(clip(x)))))`, the inner width four times the model's."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = self.norm(self.clip(x), "pre_layer_norm")
        h = self.activation(self.clippable(4 * c.hidden_size, ("embed", "mlp"), "ffw_layer_1")(h))
        h = self.clip(self.clippable(c.hidden_size, ("mlp", "embed"), "ffw_layer_2")(h))
        return x + c.residual_weight * self.norm(h, "post_layer_norm")


class Attention(_Part):
    """Gemma 4's chunked local attention (`self_attn`): queries scaled by `softplus(per_dim_scale) / (ln 2
    sqrt(H))`, keys by `log2(1 + e)`, a relative term from sinusoids of the positions `context // 2 .. 0`
    projected per head (`relative_k_proj`) and read at each slot's offset as the reference's shift reads it,
    logits capped at `attention_logit_cap`; a query reads the keys from `context_left - 2` frames before it
    to `context_right - 1` after it, every other logit set to `attention_invalid_logits_value`; the heads
    joined through `post`. `[B, T, hidden]` float32."""

    @nn.compact
    def __call__(self, x, valid_BT):
        c = self.config
        B, T, D = x.shape
        N = c.num_attention_heads
        q, k, v = self.heads(x, N, lambda name: self.clippable(D, ("embed", "heads"), name))
        k = k * (math.log(1 + math.e) / math.log(2))
        past, future = c.attention_context_left - 1, c.attention_context_right
        window = LocalWindow(c.attention_chunk_size, past, future, -(past - 1), max(future - 1, 0))
        table = sinusoids(np.arange(window.context // 2, -1, -1), D)
        position = self.linear(D, ("embed", "heads"), "relative_k_proj")(jnp.asarray(table, self.dtype))
        out = local_attention(q, k, v, position.reshape(-1, N, D // N), valid_BT, window, c.attention_logit_cap,
                              c.attention_invalid_logits_value)
        return self.clippable(D, ("heads", "embed"), "post")(out.reshape(B, T, D))


class LightConv(_Part):
    """`x + W_end act(norm(clip(conv(glu(W_start norm(x))))))`, the convolution causal and per channel."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        h = glu(self.clippable(2 * c.hidden_size, ("embed", "mlp"), "linear_start")(
            self.norm(x, "pre_layer_norm", c.rms_norm_eps)))
        kernel = Weight((c.conv_kernel_size, 1, c.hidden_size), "kernel", self.param_dtype, name="depthwise_conv1d")()
        h = self.activation(self.norm(self.clip(causal_depthwise_conv(h, kernel)), "conv_norm", c.rms_norm_eps))
        return x + self.clippable(c.hidden_size, ("mlp", "embed"), "linear_end")(h)


class ConformerLayer(_Part):
    """One conformer block; a scan step over (states, validity)."""

    @nn.compact
    def __call__(self, x, valid_BT):
        c, dtype, param_dtype = self.config, self.dtype, self.param_dtype
        x = FeedForward(c, dtype, param_dtype, name="feed_forward1")(x)
        h = Attention(c, dtype, param_dtype, name="self_attn")(self.norm(self.clip(x), "norm_pre_attn"), valid_BT)
        x = x + self.norm(self.clip(h), "norm_post_attn")
        x = LightConv(c, dtype, param_dtype, name="lconv1d")(x)
        x = FeedForward(c, dtype, param_dtype, name="feed_forward2")(x)
        return self.norm(self.clip(x), "norm_out"), None


class Gemma4AudioEncoder(_Part):
    """`input_features [B, T, F]` and `input_features_mask [B, T]` (true at audio frames) to
    `AudioEncoding(features [B, ceil(T/4), output_proj_dims], mask)`, float32 features; see the module."""

    @nn.compact
    def __call__(self, input_features, input_features_mask) -> AudioEncoding:
        c = self.config
        check_features(input_features, input_features_mask, None, "Gemma 4")
        x, valid_BT = SubsampleConvProjection(c, self.dtype, self.param_dtype, name="subsample_conv_projection")(
            input_features, input_features_mask)
        layers = c.num_hidden_layers
        stack = nn.scan(ConformerLayer, variable_axes={"params": 0, CONSTANTS: 0}, split_rngs={"params": True},
                        length=layers, in_axes=nn.broadcast, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(c, self.dtype, self.param_dtype, name=f"layers_0to{layers - 1}")(x.astype(jnp.float32), valid_BT)
        x = self.linear(c.output_proj_dims, ("embed", None), "output_proj", bias=True)(x.astype(self.dtype))
        return AudioEncoding(jnp.where(valid_BT[..., None], x.astype(jnp.float32), 0.0), valid_BT)


__all__ = ["CONSTANTS", "MODEL_TYPE", "Gemma4Audio", "Gemma4AudioEncoder"]
