"""A batch's token rows and their per-token fields, as `LMObjective` reads them: from an array of ids
with the batch's `text_*` fields, or from a `ModelInputs` carrying its own."""

from __future__ import annotations

import jax
from flax import struct

from dew.data.inputs import ModelInputs, text_fields


@struct.dataclass
class _Rows:
    """A batch's token rows `[B, S + 1]` and their per-token fields, each `[B, S + 1]` or None."""

    tokens: jax.Array
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    roles: jax.Array | None = None
    attention_mask: jax.Array | None = None


def _rows_of(text, roles=None, segment_ids=None, positions=None) -> _Rows:
    """Token rows from an array (with the given fields) or a `ModelInputs` (its own token fields)."""
    if not isinstance(text, ModelInputs):
        return _Rows(text, segment_ids, positions, roles)
    if text.conditioning:
        raise ValueError(f"LMObjective scores text, and the inputs carry media {sorted(text.conditioning)}")
    fields = text_fields(text.token_fields, "LMObjective")
    given = {"segment_ids": segment_ids, "positions": positions}
    doubled = sorted(name for name, value in given.items() if value is not None and name in fields)
    if doubled:
        raise ValueError(f"{doubled} are given twice, as arguments and in the ModelInputs: give them once")
    return _Rows(text.tokens, fields.get("segment_ids", segment_ids), fields.get("positions", positions), roles,
                 fields.get("attention_mask"))


def _real(rows: _Rows) -> jax.Array | None:
    """Which tokens are real, not padding, `[B, S + 1]` bool: an attention mask's true slots that are
    in a segment (not 0); None when nothing marks padding."""
    real = None if rows.attention_mask is None else rows.attention_mask.astype(bool)
    if rows.segment_ids is not None:
        in_segment = rows.segment_ids != 0
        real = in_segment if real is None else real & in_segment
    return real
