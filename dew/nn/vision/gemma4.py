"""Gemma 4's vision tower and its embedder: padded patch streams `[N, X, 3*p*p]` with patch positions
`[N, X, 2]` to soft tokens `[N, X / k**2, text width]`.

transformers' `Gemma4VisionModel` and `Gemma4MultimodalEmbedder` (`gemma4/modeling_gemma4.py`). The image
processor cuts each image (its sides multiples of `k * patch_size`, `k` the `pooling_kernel_size`) into
patches of `patch_size` pixels, each a vector of rows, columns then channels with values in [0, 1], and pads
the list to a fixed count `X` with patches at position `(-1, -1)`. The tower maps `2 * (x - 0.5)` through a
bias-free `patch_embedder.input_proj`, adds a learned vector per column and one per row (the two rows of
`position_embedding_table [2, position_embedding_size, hidden]`), and runs sandwich-norm blocks (four
RMSNorms that multiply by their weight; attention over the real patches with grouped keys and values,
queries and keys RMS-normed with a scale, values without one, unscaled scores; a 2-D rotary that turns the
first half of each head by the patch's column and the second half by its row, rotate-half within each half;
a gated MLP). Every projection inside is a clipped linear where `use_clipped_linears` says so: its input and
output clipped to bounds the checkpoint holds, frozen values in the `constants` collection. The pooler
averages each `k x k` block of patches by position (padding contributes nothing) into `X / k**2` soft tokens,
the image's real ones first in row-major order, and multiplies by `sqrt(hidden)`; with `standardize`,
`(x - std_bias) * std_scale` (constants too). The embedder (the "gemma4" projector, `Gemma4ProjectorModule`)
divides each token by its rms (no scale) and maps it through the bias-free `embedding_projection` to the text width;
the audio tower's frames take the same module, its input width the audio config's `output_proj_dims`.

Parameter tree: `patch_embedder/{input_proj/kernel,position_embedding_table}`,
`layers_0to{L-1}/{input_layernorm,post_attention_layernorm,pre_feedforward_layernorm,post_feedforward_layernorm,
self_attn/{q,k,v,o}_proj/linear,self_attn/{q,k}_norm,mlp/{gate,up,down}_proj/linear}` (scanned), and the
embedder's `embedding_projection/kernel`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import dot
from dew.nn.attention import attend
from dew.nn.audio.base import INERT, TowerPart, rms_norm
from dew.nn.audio.gemma4 import CONSTANTS, HIDDEN_ACTS, ClippableLinear
from dew.nn.linear import Linear, named
from dew.nn.mlp import ACTIVATIONS
from dew.nn.rotary import apply_rotary, rotary_frequencies
from dew.nn.vision.base import axial_record, read_axial_record, require_positive_ints

MODEL_TYPE = "gemma4_vision"
TEXT_HIDDEN = 2304  # transformers' Gemma4TextConfig hidden_size, where a record has no text_config width
# Fields that change nothing the tower computes (the audio towers' bookkeeping fields), the dropout
# of training, the longest sequence (the tower has no rotary table to size), the biases it never builds.
_INERT = INERT | {"attention_dropout", "max_position_embeddings"}


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    """The fields of transformers' `Gemma4VisionConfig` that shape the computation, with its defaults;
    `rope_theta` is its `rope_parameters["rope_theta"]` (an "axial" rotary)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False
    attention_bias: bool = False
    rope_theta: float = 100.0
    reads_positions: ClassVar[bool] = True  # each patch comes with its (column, row), (-1, -1) for padding

    def __post_init__(self):
        require_positive_ints(self, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "pooling_kernel_size", "patch_size",
                                     "position_embedding_size"))
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} is not a multiple of 4: the 2-D rotary turns pairs by column "
                             "over half a head and by row over the other half")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_key_value_heads}: query heads share key/value heads in equal groups")
        if self.hidden_activation not in HIDDEN_ACTS:
            raise ValueError(f"hidden_activation is {self.hidden_activation!r}; Dew computes Gemma 4's tower with "
                             f"{sorted(HIDDEN_ACTS)} (transformers' names)")
        for name in ("use_clipped_linears", "standardize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be true or false")
        if self.attention_bias:
            raise ValueError("attention_bias is true; transformers' Gemma 4 tower builds its projections without "
                             "biases whatever it says: write false")

    @property
    def patch_features(self) -> int:
        """The length of one patch vector, `3 * patch_size ** 2`."""
        return 3 * self.patch_size**2

    @property
    def block(self) -> int:
        """Patches per soft token, `pooling_kernel_size ** 2`."""
        return self.pooling_kernel_size**2

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Gemma4VisionConfig":
        """The config a `vision_config` record describes, transformers' defaults for absent fields; a field
        that would change the computation and is not one of these is refused by name."""
        return read_axial_record(cls, record, where, (MODEL_TYPE,), "Gemma4VisionConfig", _INERT, 100.0)

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` record of this tower, for a config.json."""
        return axial_record(self, MODEL_TYPE)

    def example(self, dtype) -> dict[str, jax.Array]:
        """The smallest input (one image of one soft token), which `init` builds the parameters from."""
        k = self.pooling_kernel_size
        columns, rows = jnp.meshgrid(jnp.arange(k), jnp.arange(k))
        positions = jnp.stack([columns.reshape(-1), rows.reshape(-1)], axis=-1).astype(jnp.int32)
        return {"pixel_values": jnp.zeros((1, 1, k * k, self.patch_features), dtype),
                "image_position_ids": positions[None, None]}

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Gemma4Tower":
        return Gemma4Tower(self, dtype, param_dtype)


@dataclasses.dataclass(frozen=True)
class Gemma4ProjectorConfig:
    """Gemma 4's embedder: soft tokens of `vision_hidden` features, normed without a scale (epsilon `eps`), to
    `text_hidden` (the text config's width)."""

    vision_hidden: int
    text_hidden: int
    eps: float = 1e-6

    def __post_init__(self):
        require_positive_ints(self, ("vision_hidden", "text_hidden"))

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Gemma4ProjectorConfig":
        """The embedder of a gemma4 config.json: its `vision_config`'s width and epsilon to `text_config`'s width."""
        tower = Gemma4VisionConfig.from_hf(dict(record.get("vision_config") or {}), f"{where} vision_config")
        text_hidden = dict(record.get("text_config") or {}).get("hidden_size", TEXT_HIDDEN)
        try:
            return cls(tower.hidden_size, text_hidden, tower.rms_norm_eps)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The embedder's own fields of a config record: none (its widths are the tower's and the text's)."""
        return {}

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Gemma4Projector":
        return Gemma4Projector(self, dtype, param_dtype)


class _Part(TowerPart):
    config: Gemma4VisionConfig

    def clippable(self, features: int, names, name: str) -> ClippableLinear:
        return ClippableLinear(self.config, self.dtype, self.param_dtype, features, names, name=name)

    def rms(self, x, name: str):
        return self.norm(x, name, self.config.rms_norm_eps)


class Gemma4VisionAttention(_Part):
    """Attention over `[N, X, E]` (see the module): float32 `[N, X, E]`."""

    @nn.compact
    def __call__(self, x_NXE, cos_NXD, sin_NXD, mask_NXX):
        c = self.config
        N, X, _ = x_NXE.shape
        H, K, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        project = lambda heads, name: self.clippable(heads * D, ("embed", "heads"), name)(x_NXE).reshape(N, X, heads, D)
        q_NXHD = _rotate_2d(self.rms(project(H, "q_proj"), "q_norm"), cos_NXD, sin_NXD)
        k_NXKD = _rotate_2d(self.rms(project(K, "k_proj"), "k_norm"), cos_NXD, sin_NXD)
        v_NXKD = rms_norm(project(K, "v_proj"), jnp.ones((D,), jnp.float32), c.rms_norm_eps)
        out_NXHD = attend(q_NXHD.astype(self.dtype), k_NXKD.transpose(0, 2, 1, 3).astype(self.dtype),
                          v_NXKD.transpose(0, 2, 1, 3).astype(self.dtype), mask_NXX, scale=1.0)
        return self.clippable(c.hidden_size, ("heads", "embed"), "o_proj")(out_NXHD.reshape(N, X, H * D))


def _rotate_2d(x_NXHD, cos_NXD, sin_NXD):
    """The first half of each head turned by the columns' tables, the second by the rows' (float32 in and out)."""
    half = x_NXHD.shape[-1] // 2
    return jnp.concatenate([apply_rotary(x_NXHD[..., :half], cos_NXD[0], sin_NXD[0]),
                            apply_rotary(x_NXHD[..., half:], cos_NXD[1], sin_NXD[1])], axis=-1)


class Gemma4VisionMLP(_Part):
    """`down(act(gate(x)) * up(x))` through clipped linears, float32 out."""

    @nn.compact
    def __call__(self, x_NXE):
        c = self.config
        gate = self.clippable(c.intermediate_size, ("embed", "mlp"), "gate_proj")(x_NXE)
        up = self.clippable(c.intermediate_size, ("embed", "mlp"), "up_proj")(x_NXE)
        hidden = ACTIVATIONS[HIDDEN_ACTS[c.hidden_activation]](gate) * up
        return self.clippable(c.hidden_size, ("mlp", "embed"), "down_proj")(hidden)


class Gemma4VisionBlock(_Part):
    """One sandwich-norm block over float32 `[N, X, E]`, reading the rotary tables and the mask; a scan step."""

    @nn.compact
    def __call__(self, x_NXE, context):
        c, dtype, param_dtype = self.config, self.dtype, self.param_dtype
        attention = Gemma4VisionAttention(c, dtype, param_dtype, name="self_attn")(self.rms(x_NXE, "input_layernorm"),
                                                                                  *context)
        x_NXE = x_NXE + self.rms(attention, "post_attention_layernorm")
        mlp = Gemma4VisionMLP(c, dtype, param_dtype, name="mlp")(self.rms(x_NXE, "pre_feedforward_layernorm"))
        return x_NXE + self.rms(mlp, "post_feedforward_layernorm"), None


class Gemma4PatchEmbedder(_Part):
    """`input_proj(2 * (pixels - 0.5))` plus the column's and the row's learned vectors (none for padding):
    float32 `[N, X, hidden]`."""

    @nn.compact
    def __call__(self, pixel_values, columns_NX, rows_NX, real_NX):
        c = self.config
        x_NXE = Linear(c.hidden_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                       names=(None, "embed"), name="input_proj")((2 * (pixel_values - 0.5)).astype(self.dtype))
        table = self.param("position_embedding_table", named(nn.initializers.ones_init(), (None, None, "embed")),
                           (2, c.position_embedding_size, c.hidden_size), self.param_dtype).astype(jnp.float32)
        position_NXE = jnp.take(table[0], columns_NX, axis=0) + jnp.take(table[1], rows_NX, axis=0)
        return x_NXE.astype(jnp.float32) + jnp.where(real_NX[..., None], position_NXE, 0.0)


class Gemma4Tower(_Part):
    """Patch vectors `[N, X, 3*p*p]` and positions `[N, X, 2]` (see the module) to pooled soft tokens
    `[N, X / k**2, hidden]`, the image's real ones first (float32, standardized where the config says)."""

    @nn.compact
    def __call__(self, pixel_values, position_ids):
        c = self.config
        N, X, P = pixel_values.shape
        if P != c.patch_features or X % c.block or tuple(position_ids.shape) != (N, X, 2):
            raise ValueError(f"pixel_values have shape {tuple(pixel_values.shape)} and image_position_ids "
                             f"{tuple(position_ids.shape)}; Gemma 4's tower reads [images, patches (a multiple of "
                             f"{c.block}), {c.patch_features}] (3 x {c.patch_size}^2 pixels) beside [images, patches, "
                             "2], as its image processor writes them")
        real_NX = jnp.any(position_ids != -1, axis=-1)
        where_NX2 = jnp.maximum(position_ids, 0).astype(jnp.int32)
        columns_NX, rows_NX = where_NX2[..., 0], where_NX2[..., 1]
        x_NXE = Gemma4PatchEmbedder(c, self.dtype, self.param_dtype, name="patch_embedder")(
            pixel_values, columns_NX, rows_NX, real_NX)

        # quarter-head frequencies: columns turn the first half-head (rotate-half within it), rows the second;
        # the reference turns padding by its (-1, -1), which nothing real reads
        inv_freq_F, _ = rotary_frequencies(c.head_dim // 2, c.rope_theta)
        tables = []
        for axis in (0, 1):
            angles_NXF = position_ids[..., axis].astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
            tables.append((jnp.concatenate([jnp.cos(angles_NXF)] * 2, -1),
                           jnp.concatenate([jnp.sin(angles_NXF)] * 2, -1)))
        cos_2NXD = jnp.stack([tables[0][0], tables[1][0]])
        sin_2NXD = jnp.stack([tables[0][1], tables[1][1]])
        # a patch reads the real patches of its image; a padding slot (or a padding image) also reads itself
        mask_NXX = real_NX[:, None, :] | jnp.eye(X, dtype=bool)[None]

        stack = nn.scan(Gemma4VisionBlock, variable_axes={"params": 0, CONSTANTS: 0}, split_rngs={"params": True},
                        length=c.num_hidden_layers, in_axes=nn.broadcast, metadata_params={nn.PARTITION_NAME: "layers"})
        x_NXE, _ = stack(c, self.dtype, self.param_dtype, name=f"layers_0to{c.num_hidden_layers - 1}")(
            x_NXE, (cos_2NXD, sin_2NXD, mask_NXX))
        return self.pool(jnp.where(real_NX[..., None], x_NXE, 0.0), columns_NX, rows_NX)

    def pool(self, x_NXE, columns_NX, rows_NX):
        """Each `k x k` block of patches averaged into its soft token (block column plus block row times the
        image's blocks a row), times `sqrt(hidden)`, then standardized where the config says."""
        c = self.config
        k, X = c.pooling_kernel_size, x_NXE.shape[1]
        across_N1 = (jnp.max(columns_NX, axis=1, keepdims=True) + 1) // k
        token_NX = columns_NX // k + across_N1 * (rows_NX // k)
        weights_NXL = jax.nn.one_hot(token_NX, X // c.block, dtype=jnp.float32) / c.block
        pooled_NLE = jnp.einsum("nxl,nxe->nle", weights_NXL, x_NXE, precision=jax.lax.Precision.HIGHEST)
        pooled_NLE = pooled_NLE * jnp.float32(c.hidden_size**0.5)
        if c.standardize:
            init = lambda value: lambda: jnp.full((c.hidden_size,), value, jnp.float32)
            bias = self.variable(CONSTANTS, "std_bias", init(0.0)).value
            scale = self.variable(CONSTANTS, "std_scale", init(1.0)).value
            pooled_NLE = (pooled_NLE - bias) * scale
        return pooled_NLE


class Gemma4Projector(nn.Module):
    """Soft tokens `[N, T, vision_hidden]` to `[N, T, text_hidden]` in `dtype` (see the module)."""

    config: Gemma4ProjectorConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_NTC):
        c = self.config
        N, T, C = x_NTC.shape
        if C != c.vision_hidden:
            raise ValueError(f"the embedder reads soft tokens of width {c.vision_hidden} but was given "
                             f"{tuple(x_NTC.shape)}: build it from the tower's own config")
        normed = rms_norm(x_NTC, jnp.ones((C,), jnp.float32), c.eps).astype(self.dtype)
        kernel = self.param("embedding_projection", named(nn.initializers.lecun_normal(), ("embed", None)),
                            (C, c.text_hidden), self.param_dtype)
        out = dot(normed.reshape(N * T, C), kernel.astype(self.dtype), out_dtype=self.dtype)
        return out.reshape(N, T, c.text_hidden)


Gemma4ProjectorModule = Gemma4Projector
"""The guide's name for Gemma 4's embedder (`Gemma4Projector`), which images and audio frames both go through."""

__all__ = ["Gemma4Projector", "Gemma4ProjectorConfig", "Gemma4ProjectorModule", "Gemma4Tower", "Gemma4VisionConfig"]
