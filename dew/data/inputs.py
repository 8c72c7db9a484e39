"""`ModelInputs`: what a model, an objective and generation read, tokens and their per-slot fields.

Three parts: `tokens` `[B, S]` int32; `token_fields`, per-slot arrays `[B, S, ...]` such as
`attention_mask` (true for real tokens; absent when every slot is real, so attention runs with
causality as a flag) and `positions`; and `conditioning`, what is not per slot (media, padded to the
row with the most items). Text decoders read the token fields; a model that takes no media refuses
conditioning by name. The host builds and checks inputs; compiled code does no checking.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

TEXT_FIELDS = ("attention_mask", "positions", "segment_ids", "rotary_positions")
"""The token fields a text decoder reads (`rotary_positions` `[B, S, 3]`: the three-axis positions of a
decoder whose rotary has an `mrope_section`, Qwen 3.5's)."""
MEDIA_FIELDS = ("image_indices", "image_groups", "audio_indices")
"""The token fields a multimodal model reads besides the text ones: the soft feature behind each slot and
the image it belongs to (-1 for text), and the encoded audio frame behind each audio slot (-1 elsewhere)."""
MEDIA_CONDITIONING = ("pixel_values", "image_grid_thw", "image_position_ids", "input_features", "input_features_mask",
                      "audio_lengths")
"""The conditioning a multimodal model reads: each row's images `[B, images, ...]`, for a tower that reads
images of many sizes (Qwen 3.5's) each one's patch grid `[B, images, 3]`, for one that reads padded patch
streams (Gemma 4's) each patch's (column, row) `[B, images, patches, 2]`; each row's audio clips as log-mel
frames `[B, clips, frames, mel]` with their mask `[B, clips, frames]` (true at real frames) and the clips a
row holds `[B]`."""


@struct.dataclass
class ModelInputs:
    """Token ids `[B, S]` with their per-slot `token_fields` and the row's `conditioning`."""

    tokens: Any
    token_fields: dict = struct.field(default_factory=dict)
    conditioning: dict = struct.field(default_factory=dict)

    @classmethod
    def of(cls, tokens, **token_fields) -> "ModelInputs":
        """Inputs from token ids and any token fields, checked to share the tokens' `[B, S]`."""
        tokens = np.asarray(tokens) if not isinstance(tokens, jax.Array) else tokens
        if tokens.ndim != 2:
            raise ValueError(f"tokens have shape {tuple(tokens.shape)}; ModelInputs holds [rows, slots]")
        fields = {name: value for name, value in token_fields.items() if value is not None}
        for name, value in fields.items():
            if tuple(np.shape(value))[:2] != tuple(tokens.shape):
                raise ValueError(f"token field {name!r} has shape {tuple(np.shape(value))}; it must start with the "
                                 f"tokens' {tuple(tokens.shape)}")
        return cls(tokens, fields)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments `model.apply(variables, inputs.tokens, **inputs.kwargs())` takes."""
        return {**self.token_fields, **self.conditioning}

    def take_rows(self, rows) -> "ModelInputs":
        """The inputs of the given rows (an index array; repeats allowed), every part alike."""
        take = lambda x: jnp.take(jnp.asarray(x), jnp.asarray(rows), axis=0)
        return ModelInputs(take(self.tokens), {k: take(v) for k, v in self.token_fields.items()},
                           {k: take(v) for k, v in self.conditioning.items()})

    def valid_rows(self) -> list[list[int]]:
        """Each row's real token ids, on the host, padding (where `attention_mask` is false) dropped."""
        tokens = np.asarray(self.tokens)
        mask = self.token_fields.get("attention_mask")
        if mask is None:
            return [list(map(int, row)) for row in tokens]
        mask = np.asarray(mask).astype(bool)
        return [list(map(int, row[keep])) for row, keep in zip(tokens, mask)]


def text_fields(fields: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The token fields of `fields` a text decoder reads; anything else (media) is refused by name."""
    unknown = sorted(set(fields) - set(TEXT_FIELDS))
    if unknown:
        raise ValueError(f"{who} takes text only and has no place for {unknown}: it reads the token fields "
                         f"{list(TEXT_FIELDS)}")
    return dict(fields)


def with_mask(inputs: ModelInputs) -> ModelInputs:
    """`inputs` with an `attention_mask` of booleans `[B, S]`: its own, or all true where every slot is
    real (which costs attention its causal flag; see `agree_on_mask`)."""
    mask = inputs.token_fields.get("attention_mask")
    mask = np.ones(inputs.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    return ModelInputs(inputs.tokens, {**inputs.token_fields, "attention_mask": mask}, inputs.conditioning)


def agree_on_mask(inputs: ModelInputs) -> ModelInputs:
    """This process's inputs of a generation request, agreed with the other processes of the pool before
    anything is assembled: padding belongs to each process's own rows, so a process may have an
    `attention_mask` where another has none. Every process gets one (all true where it had none) if
    any process has one, and none keeps one otherwise (`with_mask`; one flag gathered from every
    process). In one process the inputs are returned as they are."""
    if jax.process_count() == 1:
        return inputs
    has = np.asarray(["attention_mask" in inputs.token_fields])
    if np.any(multihost_utils.process_allgather(has)):
        return with_mask(inputs)
    return inputs
