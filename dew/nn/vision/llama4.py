"""Llama 4's vision tower: image tiles `[N, C, H, W]` to soft-token states `[N, tokens, projector_output_dim]`.

transformers' `Llama4VisionModel` (`llama4/modeling_llama4.py`): each tile unfolded into patches (channel,
then row, then column within a patch) and projected by a bias-free linear (`patch_embedding.linear`), a
learned `class_embedding` appended after the patches, a learned position vector per slot
(`positional_embedding_vlm`), `layernorm_pre`, pre-norm blocks (LayerNorms, biased q/k/v/o projections,
bidirectional attention whose queries and keys rotate in adjacent feature pairs, the first half of a
head's pairs by the patch's column and the second half by its row, the class slot unrotated, and an
erf-GELU MLP), `layernorm_post`, the class slot dropped, a pixel shuffle
folding each `1/ratio x 1/ratio` block of patches into one vector, and the `vision_adapter` MLP (two
bias-free linears, each followed by GELU). transformers' LayerNorms keep torch's epsilon 1e-5 and its
GELUs are erf's whatever `norm_eps` and `hidden_act` say, so Dew reads both and computes the same.

The parameter tree keeps transformers' names: `patch_embedding/linear`, `class_embedding`,
`positional_embedding_vlm`, `layernorm_pre`, `model/layers_0to{L-1}/{input_layernorm,self_attn/{q,k,v,o}_proj,
post_attention_layernorm,mlp/{fc1,fc2}}` (scanned), `layernorm_post`, `vision_adapter/mlp/{fc1,fc2}`.
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

from dew.nn.attention import attend
from dew.nn.linear import Linear, named
from dew.nn.mlp import ACTIVATIONS
from dew.nn.vision.base import TowerGeometry, layer_norm, require_positive_ints

MODEL_TYPE = "llama4_vision_model"
LAYER_NORM_EPS = 1e-5  # torch's LayerNorm default, which transformers' Llama 4 tower always uses
# Fields that change nothing transformers' tower computes (see the module), bookkeeping, and training-only rates.
_INERT = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "dtype",
    "torch_dtype", "use_bfloat16", "initializer_range", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "attn_implementation", "_attn_implementation_autoset", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tie_word_embeddings", "hidden_act", "norm_eps",
    "vision_feature_select_strategy", "multi_modal_projector_bias", "projector_dropout", "base_config_key",
})


@dataclasses.dataclass(frozen=True)
class Llama4VisionConfig:
    """The fields of transformers' `Llama4VisionConfig` that shape the computation, with its defaults;
    `rope_theta` is its `rope_parameters["rope_theta"]`. `attention_dropout` is recorded only."""

    hidden_size: int = 768
    num_hidden_layers: int = 34
    num_attention_heads: int = 16
    num_channels: int = 3
    intermediate_size: int = 5632
    vision_output_dim: int = 7680
    image_size: int = 448
    patch_size: int = 14
    pixel_shuffle_ratio: float = 0.5
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    rope_theta: float = 10000.0
    attention_dropout: float = 0.0

    def __post_init__(self):
        require_positive_ints(self, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                                     "intermediate_size", "vision_output_dim", "image_size", "patch_size",
                                     "projector_input_dim", "projector_output_dim"))
        heads, width = self.num_attention_heads, self.hidden_size
        if width % heads or (width // heads) % 4:
            raise ValueError(f"hidden_size {width} over num_attention_heads {heads} gives heads of {width / heads} "
                             "features; the 2-D rotation turns pairs by column and by row, so a head needs a "
                             "multiple of 4: give a head count that leaves one")
        fold = 1 / self.pixel_shuffle_ratio
        if not 0 < self.pixel_shuffle_ratio <= 1 or abs(fold - round(fold)) > 1e-9:
            raise ValueError(f"pixel_shuffle_ratio is {self.pixel_shuffle_ratio}; it is 1 / n for a whole n (0.5 "
                             "folds 2 x 2 patches into one token)")
        side = self.patches_per_side
        if side % self.fold:
            raise ValueError(f"a grid of {side} x {side} patches (image_size {self.image_size} / patch_size "
                             f"{self.patch_size}) does not fold into {self.fold} x {self.fold} blocks "
                             f"(pixel_shuffle_ratio {self.pixel_shuffle_ratio}): give a size whose grid it divides")
        checks = (("intermediate_size", self.intermediate_size, width * self.fold**2,
                   "the pixel shuffle's width, hidden_size / pixel_shuffle_ratio ** 2, which the adapter's fc1 reads"),
                  ("projector_output_dim", self.projector_output_dim, self.projector_input_dim,
                   "projector_input_dim: the adapter's fc2 reads fc1's output"),
                  ("vision_output_dim", self.vision_output_dim, self.projector_output_dim,
                   "projector_output_dim: the projector reads the adapter's output"))
        for name, value, wanted, why in checks:
            if value != wanted:
                raise ValueError(f"{name} is {value}; transformers' Llama 4 tower runs only with {wanted}, {why}")

    @property
    def fold(self) -> int:
        """Patches per side of one pixel-shuffle block."""
        return round(1 / self.pixel_shuffle_ratio)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:
        """Soft tokens per tile: the patch grid folded by the pixel shuffle."""
        return (self.patches_per_side // self.fold) ** 2

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Llama4VisionConfig":
        """The config a `vision_config` record describes, transformers' defaults for absent fields; a field
        that would change the computation and is not one of these is refused by name."""
        model_type = record.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"{where} has model_type {model_type!r}; a Llama 4 tower is transformers' {MODEL_TYPE!r}")
        fields = {field.name for field in dataclasses.fields(cls)} - {"rope_theta"}
        for name, value in record.items():
            if name not in fields | {"rope_parameters", "rope_theta"} and name not in _INERT:
                raise ValueError(f"{where} field {name!r} = {value!r} is not a field of transformers' "
                                 "Llama4VisionConfig that Dew computes: remove it if the tower was trained without it")
        rope = dict(record.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"}:
            raise ValueError(f"{where} rope_parameters is {rope}; the Llama 4 tower's rotation reads only rope_theta "
                             "(rope_type 'default')")
        theta = rope.get("rope_theta", record.get("rope_theta", cls.rope_theta))
        try:
            return cls(**{name: record[name] for name in fields if name in record}, rope_theta=float(theta))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` record of this tower, for a config.json."""
        record = {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}
        record["rope_parameters"] = {"rope_type": "default", "rope_theta": record.pop("rope_theta")}
        return record

    def geometry(self) -> TowerGeometry:
        return TowerGeometry(self.image_size, self.patch_size, self.num_channels)

    def example(self, dtype) -> dict:
        return self.geometry().example(dtype)

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Llama4Tower":
        """The tower computing in `dtype` with parameters stored in `param_dtype`."""
        return Llama4Tower(self, dtype, param_dtype)


def rotary_table(config: Llama4VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin `[P + 1, head_dim / 2]`, one angle per feature pair: pair j < head_dim / 4 turns by
    `(column + 1) * f_j`, the rest by `(row + 1) * f_{j - head_dim / 4}`, `f_i = theta ** (-2 i / (head_dim / 2))`,
    the class slot (last) by nothing. Computed in transformers' float32 order."""
    side, head_dim = config.patches_per_side, config.hidden_size // config.num_attention_heads
    half = head_dim // 2
    f32 = np.float32
    inv_freq = f32(1) / (f32(config.rope_theta) ** (np.arange(0, half, 2)[:half // 2].astype(f32) / f32(half)))
    index = np.arange(side * side)
    columns, rows = (index % side + 1).astype(f32), (index // side + 1).astype(f32)
    angles = np.concatenate([columns[:, None] * inv_freq, rows[:, None] * inv_freq], axis=1)
    angles = np.concatenate([angles, np.zeros((1, half), f32)])  # the class slot
    return np.cos(angles).astype(f32), np.sin(angles).astype(f32)


def _rotate_pairs(x_NPHD: jax.Array, cos_PF: jax.Array, sin_PF: jax.Array) -> jax.Array:
    """Each adjacent feature pair (a complex number) times `cos + i sin`, in float32, rounded back."""
    N, P, H, D = x_NPHD.shape
    pairs = x_NPHD.astype(jnp.float32).reshape(N, P, H, D // 2, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos_PF[None, :, None, :], sin_PF[None, :, None, :]
    turned = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return turned.reshape(N, P, H, D).astype(x_NPHD.dtype)


def _gelu(x, dtype):
    return ACTIVATIONS["gelu"](x.astype(jnp.float32)).astype(dtype)


class _Part(nn.Module):
    config: Llama4VisionConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def linear(self, features: int, bias: bool, names: tuple[str, str], name: str) -> Linear:
        return Linear(features, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype, names=names, name=name)

    def norm(self, name: str, x):
        return layer_norm(LAYER_NORM_EPS, self.param_dtype, name)(x).astype(self.dtype)


class _Attention(_Part):
    """Bidirectional multi-head attention over every slot, queries and keys rotated by `(cos, sin)`."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array, rotary) -> jax.Array:
        N, P, E = x_NPE.shape
        H = self.config.num_attention_heads
        heads = lambda name: self.linear(E, True, ("embed", "heads"), name)(x_NPE).reshape(N, P, H, E // H)
        q_NPHD, k_NPHD = _rotate_pairs(heads("q_proj"), *rotary), _rotate_pairs(heads("k_proj"), *rotary)
        v_NHPD = heads("v_proj").transpose(0, 2, 1, 3)
        out_NPHD = attend(q_NPHD, k_NPHD.transpose(0, 2, 1, 3), v_NHPD, jnp.ones((N, P, P), bool))
        return self.linear(E, True, ("heads", "embed"), "o_proj")(out_NPHD.reshape(N, P, E))


class _MLP(_Part):
    """`fc2(gelu(fc1(x)))` through `features` hidden units to `out`, biased or not; with `gelu_out` the
    output goes through GELU too (the vision adapter's)."""

    features: int = 0
    out: int = 0
    bias: bool = True
    gelu_out: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = _gelu(self.linear(self.features, self.bias, ("embed", "mlp"), "fc1")(x), self.dtype)
        y = self.linear(self.out, self.bias, ("mlp", "embed"), "fc2")(h)
        return _gelu(y, self.dtype) if self.gelu_out else y


class Llama4VisionLayer(_Part):
    """One pre-norm block over `[N, P + 1, hidden]`, rotating by `(cos, sin)`; a scan step (carry, nothing)."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array, rotary) -> tuple[jax.Array, None]:
        c, parts = self.config, (self.config, self.dtype, self.param_dtype)
        x_NPE = x_NPE + _Attention(*parts, name="self_attn")(self.norm("input_layernorm", x_NPE), rotary)
        mlp = _MLP(*parts, features=c.intermediate_size, out=c.hidden_size, name="mlp")
        return x_NPE + mlp(self.norm("post_attention_layernorm", x_NPE)), None


class _Encoder(_Part):
    """The blocks as one `nn.scan` named `layers_0to{L-1}`: compile time does not grow with depth."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array, rotary) -> jax.Array:
        layers = self.config.num_hidden_layers
        stack = nn.scan(Llama4VisionLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=nn.broadcast, length=layers, metadata_params={nn.PARTITION_NAME: "layers"})
        x_NPE, _ = stack(self.config, self.dtype, self.param_dtype, name=f"layers_0to{layers - 1}")(x_NPE, rotary)
        return x_NPE


class _Unfold(_Part):
    """Each tile's patches (channel, then row, then column inside a patch, as torch's Unfold orders them)
    through the bias-free `linear`: `[N, P, hidden]`."""

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        N, C = pixel_values.shape[:2]
        p, t = c.patch_size, c.patches_per_side
        pixels = pixel_values[:, :, :t * p, :t * p].reshape(N, C, t, p, t, p)
        patches_NPK = pixels.transpose(0, 2, 4, 1, 3, 5).reshape(N, t * t, C * p * p)
        return self.linear(c.hidden_size, False, (None, "embed"), "linear")(patches_NPK.astype(self.dtype))


class _Adapter(_Part):
    """The pixel shuffle, then `mlp`: two bias-free linears, each followed by GELU."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array) -> jax.Array:
        c = self.config
        mlp = _MLP(c, self.dtype, self.param_dtype, features=c.projector_input_dim, out=c.projector_output_dim,
                   bias=False, gelu_out=True, name="mlp")
        return mlp(pixel_shuffle(x_NPE, c.fold))


def pixel_shuffle(x_NPC: jax.Array, fold: int) -> jax.Array:
    """transformers' `pixel_shuffle` at ratio `1 / fold`: `[N, side ** 2, C]` to `[N, (side / fold) ** 2, C fold ** 2]`,
    each output vector the channels of a `fold x fold` block of patches, column-major inside the block."""
    N, P, C = x_NPC.shape
    side = math.isqrt(P)
    x = x_NPC.reshape(N, side, side // fold, C * fold)  # [N, h, w / fold, C fold]
    x = x.transpose(0, 2, 1, 3).reshape(N, side // fold, side // fold, C * fold * fold)  # [N, w / f, h / f, C f f]
    return x.transpose(0, 2, 1, 3).reshape(N, (side // fold) ** 2, C * fold * fold)


class Llama4Tower(_Part):
    """Tiles `[N, C, H, W]` (H = W = image_size, channels first, as transformers' processor gives them) to
    the vision adapter's states `[N, tokens, projector_output_dim]` in `dtype` (see the module)."""

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        c.geometry().check(pixel_values, "Llama 4", "tiles",
                           f"cut the images into tiles of {c.image_size} pixels a side (the processor does)")
        parts, E, P = (c, self.dtype, self.param_dtype), c.hidden_size, c.patches_per_side ** 2
        x_NPE = _Unfold(*parts, name="patch_embedding")(pixel_values)
        init = lambda names: named(nn.initializers.normal(E**-0.5), names)
        cls_E = self.param("class_embedding", init(("embed",)), (E,), self.param_dtype)
        positions_PE = self.param("positional_embedding_vlm", init((None, "embed")), (P + 1, E), self.param_dtype)
        x_NPE = jnp.concatenate([x_NPE, jnp.broadcast_to(cls_E.astype(self.dtype), (x_NPE.shape[0], 1, E))], axis=1)
        x_NPE = self.norm("layernorm_pre", x_NPE + positions_PE.astype(self.dtype))
        x_NPE = _Encoder(*parts, name="model")(x_NPE, tuple(jnp.asarray(table) for table in rotary_table(c)))
        x_NPE = self.norm("layernorm_post", x_NPE)[:, :-1]  # the class slot dropped
        return _Adapter(*parts, name="vision_adapter")(x_NPE)
