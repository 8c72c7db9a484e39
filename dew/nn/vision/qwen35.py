"""Qwen 3.5's vision tower and patch merger: each image's patch vectors `[N, X, C*T*p*p]` with its patch grid
`(t, h, w)` to soft tokens `[N, X / merge**2, out_hidden_size]`.

transformers' `Qwen3_5VisionModel` (`qwen3_5/modeling_qwen3_5.py`). The image processor cuts an image into
`t x h x w` patches of `temporal_patch_size x patch_size x patch_size` pixels and lists them by merge block
(each `merge x merge` block of neighbours adjacent, blocks in row-major order), each vector channel first,
then time, then rows and columns. The tower projects each vector (a convolution whose kernel is the whole
patch, with a bias, here one product), adds a learned position vector resampled bilinearly (corners
aligned) from a square table of `num_position_embeddings` to the image's `h x w` grid, and runs pre-norm
blocks (LayerNorms with epsilon 1e-6, a fused biased `qkv` projection, attention within each frame of one
image whose queries and keys turn by the patch's row over the first quarter of a head's frequencies and by
its column over the second, rotate-half over the whole head, a biased `proj`, and a biased MLP). The merger
(`Qwen35Merger`, the "qwen3_5" projector) normalizes each patch, joins each block's `merge**2` patches into
one vector and maps it through `linear_fc1`, an exact GELU and `linear_fc2` to the text width.

Images of one call differ in size; compiled code sees one shape, so each image's patches are padded to the
call's largest count `X` (a whole number of merge blocks) and `grid_thw` `[N, 3]` says which are real: a
padding patch reads and is read by nothing (a padding image has grid `t = 0`). The parameter tree keeps
transformers' names: `patch_embed/{kernel,bias}` (the kernel `[C, T, p, p, hidden]`), `pos_embed/embedding`,
`layers_0to{L-1}/{norm1,attn/{qkv,proj},norm2,mlp/{linear_fc1,linear_fc2}}` (scanned), and the merger's
`norm`, `linear_fc1`, `linear_fc2`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import dot
from dew.nn.attention import attend
from dew.nn.linear import named
from dew.nn.mlp import ACTIVATIONS
from dew.nn.rotary import apply_rotary, rotary_frequencies
from dew.nn.vision.base import TowerPart, axial_record, layer_norm, read_axial_record, require_positive_ints
from dew.nn.vision.siglip import HIDDEN_ACTS

MODEL_TYPE = "qwen3_5_vision"
MODEL_TYPES = (MODEL_TYPE, "qwen3_5_moe_vision")  # Qwen 3.5-MoE's tower is the same
NORM_EPS = 1e-6  # transformers' Qwen 3.5 vision LayerNorms, whatever the config says
# Fields that change nothing the tower computes: bookkeeping, the weights' dtype, initialisers.
_INERT = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "dtype",
    "torch_dtype", "use_bfloat16", "initializer_range", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "attn_implementation", "_attn_implementation_autoset", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tie_word_embeddings", "base_config_key",
})


@dataclasses.dataclass(frozen=True)
class Qwen35VisionConfig:
    """The fields of transformers' `Qwen3_5VisionConfig` that shape the computation, with its defaults;
    `rope_theta` is its `rope_parameters["rope_theta"]` (an "axial" rotary)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    reads_grids: ClassVar[bool] = True  # its images differ in size: each comes with its patch grid

    def __post_init__(self):
        require_positive_ints(self, ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                     "patch_size", "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                                     "num_position_embeddings"))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"hidden_size {self.hidden_size} over num_heads {self.num_heads} gives heads of "
                             f"{self.hidden_size / self.num_heads} features; the 2-D rotary turns pairs by row and by "
                             "column, so a head needs a multiple of 4: give a head count that leaves one")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square: the learned "
                             "positions are a square grid (2304 = 48 x 48)")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act is {self.hidden_act!r}; Dew computes Qwen 3.5's tower with "
                             f"{sorted(HIDDEN_ACTS)} (transformers' names)")

    @property
    def patch_features(self) -> int:
        """The length of one patch vector, `in_channels * temporal_patch_size * patch_size ** 2`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def block(self) -> int:
        """Patches per merged token, `spatial_merge_size ** 2`."""
        return self.spatial_merge_size**2

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Qwen35VisionConfig":
        """The config a `vision_config` record describes, transformers' defaults for absent fields; a field
        that would change the computation and is not one of these is refused by name."""
        return read_axial_record(cls, record, where, MODEL_TYPES, "Qwen3_5VisionConfig", _INERT, 10000.0)

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` record of this tower, for a config.json."""
        return axial_record(self, MODEL_TYPE)

    def example(self, dtype) -> dict[str, jax.Array]:
        """The smallest input (one image of one merge block), which `init` builds the parameters from."""
        m = self.spatial_merge_size
        return {"pixel_values": jnp.zeros((1, 1, m * m, self.patch_features), dtype),
                "image_grid_thw": jnp.asarray([[[1, m, m]]], jnp.int32)}

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Qwen35Tower":
        return Qwen35Tower(self, dtype, param_dtype)


@dataclasses.dataclass(frozen=True)
class Qwen35MergerConfig:
    """Qwen 3.5's patch merger: `merge x merge` patches of `vision_hidden` features to one token of
    `out_hidden` (the text width)."""

    vision_hidden: int
    out_hidden: int
    merge: int = 2

    def __post_init__(self):
        require_positive_ints(self, ("vision_hidden", "out_hidden", "merge"))

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Qwen35MergerConfig":
        """The merger of a qwen3_5 config.json (its `vision_config`'s widths and merge size), whose output
        width must be the text decoder's."""
        tower = Qwen35VisionConfig.from_hf(dict(record.get("vision_config") or {}), f"{where} vision_config")
        text_hidden = dict(record.get("text_config") or {}).get("hidden_size", 4096)
        if tower.out_hidden_size != text_hidden:
            raise ValueError(f"{where} vision_config out_hidden_size {tower.out_hidden_size} differs from text_config "
                             f"hidden_size {text_hidden}: the merger's tokens take the text embeddings' place")
        return cls(tower.hidden_size, tower.out_hidden_size, tower.spatial_merge_size)

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Qwen35Merger":
        return Qwen35Merger(self, dtype, param_dtype)


def patch_layout(grid_N3: jax.Array, patches: int, merge: int) -> dict[str, jax.Array]:
    """Where each of `patches` slots of an image with patch grid `grid_N3` sits: int32 `row`, `col`,
    `frame` `[N, X]` (the processor's merge-block order) and `real` (bool, the slot holds a patch)."""
    t_N1, h_N1, w_N1 = (grid_N3[:, i:i + 1].astype(jnp.int32) for i in range(3))
    k_1X = jnp.arange(patches, dtype=jnp.int32)[None, :]
    frame_size = jnp.maximum(h_N1 * w_N1, 1)
    within = k_1X % frame_size
    block, inside = within // (merge * merge), within % (merge * merge)
    blocks_per_row = jnp.maximum(w_N1 // merge, 1)
    row = (block // blocks_per_row) * merge + inside // merge
    col = (block % blocks_per_row) * merge + inside % merge
    return {"row": row, "col": col, "frame": k_1X // frame_size, "real": k_1X < t_N1 * h_N1 * w_N1,
            "height": jnp.broadcast_to(h_N1, row.shape), "width": jnp.broadcast_to(w_N1, row.shape)}


def _bilinear_taps(index_NX, size_NX, side: int):
    """transformers' aligned-corners bilinear taps into a `side`-long axis for target `index` of `size`:
    (the two source indices, their weights), each `[N, X, 2]`, in float32 as it rounds them."""
    f32 = jnp.float32
    source = index_NX.astype(f32) * f32(side - 1) / jnp.maximum(size_NX - 1, 1).astype(f32)
    floor = jnp.floor(source)
    offsets = jnp.arange(2, dtype=f32)
    taps = jnp.clip(floor.astype(jnp.int32)[..., None] + jnp.arange(2, dtype=jnp.int32), 0, side - 1)
    distance = jnp.abs(source[..., None] - floor[..., None] - offsets)
    return taps, jnp.maximum(1 - distance, 0)


class Qwen35Attention(TowerPart):
    """Attention over `[N, X, E]` through a fused biased `qkv` and a biased `proj`, queries and keys turned by
    the rotary tables, keys limited by the mask `[N, X, X]`."""

    @nn.compact
    def __call__(self, x_NXE, cos_NXD, sin_NXD, mask_NXX):
        N, X, E = x_NXE.shape
        H = self.config.num_heads
        qkv_NX3HD = self.linear(3 * E, ("embed", "heads"), "qkv")(x_NXE).reshape(N, X, 3, H, E // H)
        q_NXHD = apply_rotary(qkv_NX3HD[:, :, 0], cos_NXD, sin_NXD)
        k_NHXD = apply_rotary(qkv_NX3HD[:, :, 1], cos_NXD, sin_NXD).transpose(0, 2, 1, 3)
        v_NHXD = qkv_NX3HD[:, :, 2].transpose(0, 2, 1, 3)
        out_NXHD = attend(q_NXHD, k_NHXD, v_NHXD, mask_NXX)
        return self.linear(E, ("heads", "embed"), "proj")(out_NXHD.reshape(N, X, E))


class Qwen35MLP(TowerPart):
    """`linear_fc2(act(linear_fc1(x)))`, the activation in float32 rounded once."""

    @nn.compact
    def __call__(self, x_NXE):
        c = self.config
        h = self.linear(c.intermediate_size, ("embed", "mlp"), "linear_fc1")(x_NXE)
        h = ACTIVATIONS[HIDDEN_ACTS[c.hidden_act]](h.astype(jnp.float32)).astype(self.dtype)
        return self.linear(c.hidden_size, ("mlp", "embed"), "linear_fc2")(h)


class Qwen35Block(TowerPart):
    """One pre-norm block over `[N, X, E]`, reading the rotary tables and the mask; a scan step."""

    @nn.compact
    def __call__(self, x_NXE, context):
        c, dtype, param_dtype = self.config, self.dtype, self.param_dtype
        norm = lambda name, x: layer_norm(NORM_EPS, param_dtype, name)(x).astype(dtype)
        x_NXE = x_NXE + Qwen35Attention(c, dtype, param_dtype, name="attn")(norm("norm1", x_NXE), *context)
        x_NXE = x_NXE + Qwen35MLP(c, dtype, param_dtype, name="mlp")(norm("norm2", x_NXE))
        return x_NXE, None


class Qwen35PatchEmbed(TowerPart):
    """transformers' patch convolution (its kernel the whole patch, biased) as one product over each patch's
    `C*T*p*p` numbers: float32 `[N, X, hidden]`."""

    @nn.compact
    def __call__(self, pixel_values):
        c = self.config
        N, X, K = pixel_values.shape
        E = c.hidden_size
        # torch's Conv3d weight [E, C, T, p, p] with its output axis last
        kernel = self.param("kernel", named(nn.initializers.lecun_normal(), (None, None, None, None, "embed")),
                            (c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size, E), self.param_dtype)
        bias = self.param("bias", named(nn.initializers.zeros_init(), ("embed",)), (E,), self.param_dtype)
        x_XE = dot(pixel_values.reshape(N * X, K).astype(self.dtype), kernel.reshape(K, E).astype(self.dtype))
        return x_XE.astype(jnp.float32).reshape(N, X, E) + bias.astype(jnp.float32)


class Qwen35Tower(TowerPart):
    """Patch vectors `[N, X, C*T*p*p]` and grids `[N, 3]` (see the module) to patch states `[N, X, hidden]`."""

    @nn.compact
    def __call__(self, pixel_values, grid_thw):
        c = self.config
        N, X, K = pixel_values.shape
        if K != c.patch_features or X % c.block:
            raise ValueError(f"pixel_values have shape {tuple(pixel_values.shape)}; Qwen 3.5's tower reads [images, "
                             f"patches (a multiple of {c.block}), {c.patch_features}] (channels x "
                             f"{c.temporal_patch_size} frames x {c.patch_size}^2 pixels), as its image processor "
                             "writes them")
        E, side = c.hidden_size, math.isqrt(c.num_position_embeddings)
        where = patch_layout(grid_thw, X, c.spatial_merge_size)
        x_NXE = Qwen35PatchEmbed(c, self.dtype, self.param_dtype, name="patch_embed")(pixel_values)

        table = nn.Embed(c.num_position_embeddings, E, dtype=jnp.float32, param_dtype=self.param_dtype,
                         embedding_init=named(nn.initializers.normal(0.02), (None, "embed")), name="pos_embed")
        row_taps, row_weights = _bilinear_taps(where["row"], where["height"], side)
        col_taps, col_weights = _bilinear_taps(where["col"], where["width"], side)
        taps_NX4 = (row_taps[..., :, None] * side + col_taps[..., None, :]).reshape(N, X, 4)
        weights_NX4 = (row_weights[..., :, None] * col_weights[..., None, :]).reshape(N, X, 4)
        position_NXE = jnp.sum(table(taps_NX4) * weights_NX4[..., None], axis=2)
        x_NXE = (x_NXE + position_NXE).astype(self.dtype)

        # one frequency table of a quarter head: rows turn the first quarter's pairs, columns the second
        inv_freq_F, _ = rotary_frequencies(E // c.num_heads // 2, c.rope_theta)
        angles = lambda axis: where[axis].astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
        freqs_NXF = jnp.concatenate([angles("row"), angles("col")], axis=-1)
        cos_NXD = jnp.concatenate([jnp.cos(freqs_NXF)] * 2, axis=-1)
        sin_NXD = jnp.concatenate([jnp.sin(freqs_NXF)] * 2, axis=-1)
        # a patch reads the real patches of its own frame; a padding slot reads only itself
        same_NXX = (where["frame"][:, :, None] == where["frame"][:, None, :]) & where["real"][:, None, :]
        mask_NXX = (same_NXX & where["real"][:, :, None]) | jnp.eye(X, dtype=bool)[None]

        stack = nn.scan(Qwen35Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.depth,
                        in_axes=nn.broadcast, metadata_params={nn.PARTITION_NAME: "layers"})
        x_NXE, _ = stack(c, self.dtype, self.param_dtype, name=f"layers_0to{c.depth - 1}")(
            x_NXE, (cos_NXD, sin_NXD, mask_NXX))
        return x_NXE


class Qwen35Merger(TowerPart):
    """Patch states `[N, X, hidden]` to soft tokens `[N, X / merge**2, out_hidden]` (see the module)."""

    @nn.compact
    def __call__(self, x_NXE):
        c = self.config
        N, X, E = x_NXE.shape
        joined = E * c.merge**2
        x_NTJ = layer_norm(NORM_EPS, self.param_dtype, "norm")(x_NXE).astype(self.dtype).reshape(N, X // c.merge**2, joined)
        h_NTJ = self.linear(joined, ("embed", "mlp"), "linear_fc1")(x_NTJ)
        h_NTJ = ACTIVATIONS["gelu"](h_NTJ.astype(jnp.float32)).astype(self.dtype)
        return self.linear(c.out_hidden, ("mlp", "embed"), "linear_fc2")(h_NTJ)


__all__ = ["Qwen35Merger", "Qwen35MergerConfig", "Qwen35Tower", "Qwen35VisionConfig", "patch_layout"]
