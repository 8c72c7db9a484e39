"""Projectors from a vision tower's patch states to a language model's embedding width.

`Llama4Projector` is transformers' `Llama4MultiModalProjector`: one bias-free linear `linear_1` from the
tower's `vision_output_dim` to the text width (the pixel shuffle and adapter MLP belong to the tower).

`GemmaProjector` is transformers' `Gemma3MultiModalProjector` (`gemma3/modeling_gemma3.py`): the
`side x side` patch grid average-pooled to `t x t` soft tokens, a Gemma RMSNorm (`(1 + weight)`) over
the vision width, and `x @ mm_input_projection_weight`, a `[vision_hidden, text_hidden]` matrix kept in
that layout (it is a parameter in transformers, not a Linear).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import dot
from dew.nn.linear import Linear, named
from dew.nn.norms import RMSNorm
from dew.nn.vision.base import require_positive_ints
from dew.nn.vision.llama4 import Llama4VisionConfig
from dew.nn.vision.siglip import SiglipConfig

TEXT_HIDDEN = 2304  # transformers' Gemma3TextConfig hidden_size, where a record has no text_config width
TOKENS_PER_IMAGE = 256  # transformers' Gemma3Config mm_tokens_per_image


@dataclasses.dataclass(frozen=True)
class GemmaProjectorConfig:
    """Gemma 3's projector: `tokens_per_image` soft tokens (a square, `tokens_per_side ** 2`) pooled from
    the `image_size / patch_size` patch grid, which they must tile, and `eps` the norm's epsilon (the
    vision config's `layer_norm_eps`, as transformers reads it)."""

    vision_hidden: int
    text_hidden: int
    image_size: int
    patch_size: int
    tokens_per_image: int = TOKENS_PER_IMAGE
    eps: float = 1e-6

    def __post_init__(self):
        require_positive_ints(self, ("vision_hidden", "text_hidden", "image_size", "patch_size", "tokens_per_image"))
        side, tokens = self.patches_per_side, self.tokens_per_image
        if math.isqrt(tokens) ** 2 != tokens:
            raise ValueError(f"mm_tokens_per_image {tokens} is not a square number: Gemma 3 pools the patch grid "
                             "to a square of soft tokens; give a square such as 256 (16 x 16)")
        if side % self.tokens_per_side:
            raise ValueError(f"a grid of {side} x {side} patches (image_size {self.image_size} / patch_size "
                             f"{self.patch_size}) does not pool evenly to {self.tokens_per_side} x "
                             f"{self.tokens_per_side} soft tokens (mm_tokens_per_image {tokens}): give a token "
                             f"count whose square root divides {side}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.tokens_per_image)

    @property
    def pooling(self) -> int:
        """The average pool's kernel and stride, in patches."""
        return self.patches_per_side // self.tokens_per_side

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "GemmaProjectorConfig":
        """The projector a Gemma 3 config record (config.json, `model_type` "gemma3") describes: its
        `mm_tokens_per_image`, its `vision_config` (read as a SigLIP tower's) and `text_config.hidden_size`,
        each at transformers' default where absent."""
        vision = SiglipConfig.from_hf(record.get("vision_config") or {}, f"{where} vision_config")
        text_hidden = (record.get("text_config") or {}).get("hidden_size", TEXT_HIDDEN)
        try:
            return cls(vision.hidden_size, text_hidden, vision.image_size, vision.patch_size,
                       record.get("mm_tokens_per_image", TOKENS_PER_IMAGE), vision.layer_norm_eps)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The projector's own field of a Gemma 3 config record (the widths belong to the tower's and the
        text model's records)."""
        return {"mm_tokens_per_image": self.tokens_per_image}

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "GemmaProjector":
        """The projector computing in `dtype` with parameters stored in `param_dtype`."""
        return GemmaProjector(self, dtype, param_dtype)


class GemmaProjector(nn.Module):
    """Patch states `[N, P, vision_hidden]` (P = patches_per_side ** 2, row-major) to soft tokens
    `[N, tokens_per_image, text_hidden]` in `dtype`."""

    config: GemmaProjectorConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_NPC: jax.Array) -> jax.Array:
        c = self.config
        N, P, C = x_NPC.shape
        side, t, k = c.patches_per_side, c.tokens_per_side, c.pooling
        if (P, C) != (side * side, c.vision_hidden):
            raise ValueError(f"the projector reads [images, {side * side}, {c.vision_hidden}] patch states (a "
                             f"{side} x {side} grid) but was given {tuple(x_NPC.shape)}: build it from the tower's "
                             "own config")
        pooled_NTC = x_NPC.astype(jnp.float32).reshape(N, t, k, t, k, C).mean(axis=(2, 4)).reshape(N, t * t, C)
        normed_NTC = RMSNorm(c.eps, "gemma", dtype=self.dtype, param_dtype=self.param_dtype,
                             name="mm_soft_emb_norm")(pooled_NTC)
        weight = self.param("mm_input_projection_weight", named(nn.initializers.normal(C**-0.5), (None, "embed")),
                            (C, c.text_hidden), self.param_dtype)
        out = dot(normed_NTC.reshape(N * t * t, C), weight.astype(self.dtype), out_dtype=self.dtype)
        return out.reshape(N, t * t, c.text_hidden)


LLAMA4_TEXT_HIDDEN = 5120  # transformers' Llama4TextConfig hidden_size


@dataclasses.dataclass(frozen=True)
class Llama4ProjectorConfig:
    """Llama 4's projector: the tower's `vision_output_dim` states to `text_hidden` (the text config's width)."""

    vision_output_dim: int
    text_hidden: int

    def __post_init__(self):
        require_positive_ints(self, ("vision_output_dim", "text_hidden"))

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "Llama4ProjectorConfig":
        """The projector a Llama 4 config record (config.json, `model_type` "llama4") describes: its
        `vision_config` (read as a Llama 4 tower's) and `text_config.hidden_size`, transformers' defaults where
        absent."""
        vision = Llama4VisionConfig.from_hf(record.get("vision_config") or {}, f"{where} vision_config")
        text_hidden = (record.get("text_config") or {}).get("hidden_size", LLAMA4_TEXT_HIDDEN)
        try:
            return cls(vision.vision_output_dim, text_hidden)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The projector's own fields of a Llama 4 config record: none (its widths are the tower's and text's)."""
        return {}

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Llama4Projector":
        return Llama4Projector(self, dtype, param_dtype)


class Llama4Projector(nn.Module):
    """`[N, T, vision_output_dim]` to soft tokens `[N, T, text_hidden]` in `dtype`."""

    config: Llama4ProjectorConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_NTC: jax.Array) -> jax.Array:
        c = self.config
        if x_NTC.shape[-1] != c.vision_output_dim:
            raise ValueError(f"the projector reads states of width {c.vision_output_dim} (vision_output_dim) but was "
                             f"given {tuple(x_NTC.shape)}: build it from the tower's own config")
        return Linear(c.text_hidden, dtype=self.dtype, param_dtype=self.param_dtype, names=("embed", None),
                      name="linear_1")(x_NTC.astype(self.dtype))
