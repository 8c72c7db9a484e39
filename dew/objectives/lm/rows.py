"""A batch's token rows and their per-token fields, as `LMObjective` reads them: from an array of ids
with the batch's `text_*` fields, or from a `ModelInputs` carrying its own."""

from __future__ import annotations

import jax
from flax import struct

from dew.data.inputs import MEDIA_CONDITIONING, MEDIA_FIELDS, TEXT_FIELDS, ModelInputs

# The per-slot fields a model call reads beside the token rows: the image fields, and the three-axis rotary
# positions images move (Qwen 3.5's).
_SLOTTED = MEDIA_FIELDS + ("rotary_positions",)


@struct.dataclass
class _Rows:
    """A batch's token rows `[B, S + 1]` and their per-token fields, each `[B, S + 1]` or None; `media`,
    a multimodal batch's image fields (`[B, S + 1]`, `dew.data.inputs.MEDIA_FIELDS`, and `rotary_positions`
    `[B, S + 1, 3]`) and its conditioning (`dew.data.inputs.MEDIA_CONDITIONING`), empty for text."""

    tokens: jax.Array
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    roles: jax.Array | None = None
    attention_mask: jax.Array | None = None
    media: dict = struct.field(default_factory=dict)

    def media_inputs(self) -> dict:
        """The media keywords of the model's call over the inputs `[:, :-1]` (conditioning whole)."""
        return {name: value[:, :-1] if name in _SLOTTED else value for name, value in self.media.items()}

    def media_targets(self):
        """Which targets `[B, S]` are an image's or a clip's soft tokens (None without media): they carry no loss."""
        soft = [indices[:, 1:] >= 0 for indices in (self.media.get("image_indices"), self.media.get("audio_indices"))
                if indices is not None]
        return None if not soft else soft[0] if len(soft) == 1 else soft[0] | soft[1]


def _rows_of(text, roles=None, segment_ids=None, positions=None) -> _Rows:
    """Token rows from an array (with the given fields) or a `ModelInputs` (its own token fields)."""
    if not isinstance(text, ModelInputs):
        return _Rows(text, segment_ids, positions, roles)
    unknown = sorted(set(text.token_fields) - set(TEXT_FIELDS + MEDIA_FIELDS))
    unknown += sorted(set(text.conditioning) - set(MEDIA_CONDITIONING))
    if unknown:
        raise ValueError(f"LMObjective has no place for {unknown}: it reads the token fields {list(TEXT_FIELDS)}, "
                         f"a multimodal model's {list(MEDIA_FIELDS)} and the conditioning {list(MEDIA_CONDITIONING)}")
    fields = dict(text.token_fields)
    media = {name: value for name, value in {**fields, **text.conditioning}.items()
             if name in _SLOTTED + MEDIA_CONDITIONING}
    given = {"segment_ids": segment_ids, "positions": positions}
    doubled = sorted(name for name, value in given.items() if value is not None and name in fields)
    if doubled:
        raise ValueError(f"{doubled} are given twice, as arguments and in the ModelInputs: give them once")
    return _Rows(text.tokens, fields.get("segment_ids", segment_ids), fields.get("positions", positions), roles,
                 fields.get("attention_mask"), media)


def _real(rows: _Rows) -> jax.Array | None:
    """Which tokens are real, not padding, `[B, S + 1]` bool: an attention mask's true slots that are
    in a segment (not 0); None when nothing marks padding."""
    real = None if rows.attention_mask is None else rows.attention_mask.astype(bool)
    if rows.segment_ids is not None:
        in_segment = rows.segment_ids != 0
        real = in_segment if real is None else real & in_segment
    return real
