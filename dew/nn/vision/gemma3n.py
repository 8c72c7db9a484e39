"""Gemma 3n's multimodal embedder (transformers' `Gemma3nMultimodalEmbedder`), one per modality, taking a tower's
soft features or the modality's hard token ids into the language model's width.

Soft features `[N, T, hidden]` -> `soft_embedding_norm` -> `embedding_projection` -> `embedding_post_projection_norm`
(`soft_embeddings`, transformers' `Gemma3nMultimodalEmbedder(inputs_embeds=...)`); a call multiplies vision features
by `sqrt(hidden)` first (as transformers' `get_image_features` does), audio features not, so audio projects
through `soft_embeddings` as it is. `Gemma3nProjectorModule` is the guide's name for the module. Hard ids in
`[vocab_offset, vocab_offset + vocab_size)` -> the `embedding` table (row `id - vocab_offset`) ->
`hard_embedding_norm` -> the same projection and post-norm. The two scaled norms are
RMSNorms multiplying by their weight (`x / rms(x) * weight`, in float32); the post-norm has no weight. The
projection is bias-free, its kernel `[hidden, text_hidden]`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear, named
from dew.nn.norms import RMSNorm, normalize
from dew.nn.vision.base import require_positive_ints

# transformers' Gemma3nVisionConfig / Gemma3nAudioConfig defaults: (hidden_size, vocab_size, vocab_offset)
MODALITIES = {"vision": (2048, 128, 262_144), "audio": (1536, 128, 262_272)}
TEXT_HIDDEN = 2048  # transformers' Gemma3nTextConfig hidden_size


@dataclasses.dataclass(frozen=True)
class Gemma3nEmbedderConfig:
    """The embedder of one `modality` ("vision" or "audio"): the tower's width `hidden_size`, the modality's
    `vocab_size` ids from `vocab_offset`, the text model's `text_hidden`, and the norms' `eps`."""

    hidden_size: int
    text_hidden: int
    vocab_size: int = 128
    vocab_offset: int = 262_144
    eps: float = 1e-6
    modality: str = "vision"

    def __post_init__(self):
        require_positive_ints(self, ("hidden_size", "text_hidden", "vocab_size"))
        if self.modality not in MODALITIES:
            raise ValueError(f"modality is {self.modality!r}; Gemma 3n embeds {sorted(MODALITIES)}")
        if not isinstance(self.vocab_offset, int) or self.vocab_offset < 0:
            raise ValueError(f"vocab_offset is {self.vocab_offset!r}; it must be a non-negative integer")
        if not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"rms_norm_eps is {self.eps!r}; it must be a positive number")

    @property
    def feature_scale(self) -> float:
        """What soft features are multiplied by before the norm: `sqrt(hidden_size)` for vision, 1 for audio."""
        return math.sqrt(self.hidden_size) if self.modality == "vision" else 1.0

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str, modality: str = "vision") -> "Gemma3nEmbedderConfig":
        """The `modality` embedder a Gemma 3n config record (config.json, `model_type` "gemma3n") describes: the
        `{modality}_config`'s `hidden_size`, `vocab_size`, `vocab_offset` and `rms_norm_eps` and the
        `text_config`'s `hidden_size`, transformers' defaults where absent."""
        if modality not in MODALITIES:
            raise ValueError(f"modality is {modality!r}; Gemma 3n embeds {sorted(MODALITIES)}")
        hidden, vocab, offset = MODALITIES[modality]
        part = record.get(f"{modality}_config") or {}
        text_hidden = (record.get("text_config") or {}).get("hidden_size", TEXT_HIDDEN)
        try:
            return cls(part.get("hidden_size", hidden), text_hidden, part.get("vocab_size", vocab),
                       part.get("vocab_offset", offset), part.get("rms_norm_eps", 1e-6), modality)
        except ValueError as error:
            raise ValueError(f"{where} {modality}_config: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The embedder's fields of the `{modality}_config` record (the text width is the text config's)."""
        return {"vocab_size": self.vocab_size, "vocab_offset": self.vocab_offset, "rms_norm_eps": self.eps}

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "Gemma3nEmbedder":
        """The embedder computing in `dtype` with parameters stored in `param_dtype`."""
        return Gemma3nEmbedder(self, dtype, param_dtype)


class Gemma3nEmbedder(nn.Module):
    """`__call__(features)`: a tower's soft features `[..., hidden_size]` to `[..., text_hidden]`, scaled by the
    config's `feature_scale` first; `soft_embeddings(features)`: the same without the scaling; `embed(ids)`: hard
    ids (each in `[vocab_offset, vocab_offset + vocab_size)`; the compiled model does not check) to
    `[..., text_hidden]`. All in `dtype`."""

    config: Gemma3nEmbedderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        c, dtype, param_dtype = self.config, self.dtype, self.param_dtype
        self.embedding = nn.Embed(c.vocab_size, c.hidden_size, dtype=jnp.float32, param_dtype=param_dtype,
                                  embedding_init=named(nn.initializers.normal(1.0), ("vocab", "embed")))
        self.hard_embedding_norm = RMSNorm(c.eps, "olmo", dtype=jnp.float32, param_dtype=param_dtype)
        self.soft_embedding_norm = RMSNorm(c.eps, "olmo", dtype=jnp.float32, param_dtype=param_dtype)
        self.embedding_projection = Linear(c.text_hidden, dtype=dtype, param_dtype=param_dtype,
                                           kernel_init=nn.initializers.normal(c.hidden_size**-0.5),
                                           names=("embed", None))

    def _project(self, normed: jax.Array) -> jax.Array:
        projected = self.embedding_projection(normed.astype(self.dtype))
        return normalize(projected.astype(jnp.float32), self.config.eps).astype(self.dtype)

    def __call__(self, features: jax.Array) -> jax.Array:
        return self.soft_embeddings(features.astype(jnp.float32) * self.config.feature_scale)

    def soft_embeddings(self, features: jax.Array) -> jax.Array:
        """Soft features `[..., hidden_size]` normed, projected and normed again, unscaled."""
        c = self.config
        if features.shape[-1] != c.hidden_size:
            raise ValueError(f"the {c.modality} embedder reads features of width {c.hidden_size} but was given "
                             f"{tuple(features.shape)}: build it from the tower's own config")
        if self.is_initializing():  # init traces one path; the hard one's parameters must exist as well
            self.embed(jnp.full((1,), c.vocab_offset, jnp.int32))
        return self._project(self.soft_embedding_norm(features.astype(jnp.float32)))

    def embed(self, ids: jax.Array) -> jax.Array:
        rows = self.embedding(ids - self.config.vocab_offset)
        return self._project(self.hard_embedding_norm(rows))


Gemma3nProjectorModule = Gemma3nEmbedder
"""The guide's name for Gemma 3n's embedder (`Gemma3nEmbedder`): `soft_embeddings` projects audio, unscaled."""
