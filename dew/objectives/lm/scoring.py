"""The pieces behind `LMObjective`'s policy scoring: a target's likelihood renormalised over the ids a
sampler kept (`support_log_probs`), left padding moved out of the way, and the rollout task `policy`
returns, which records the raw policy's likelihoods beside the sampler's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dew.inference.text import TextGeneration
from dew.nn.head import Head, cap_logits
from dew.sampling import Generation


def _head_columns(head: Head, ids):
    """The head's weight columns of `ids` (any shape), `[..., E]`."""
    return jnp.take(head.weight, ids, axis=0) if head.transposed else jnp.moveaxis(jnp.take(head.weight, ids, axis=1), 0, -1)


def _logits_of(states_BXE, head: Head, ids_BX, temperature: float):
    """float32 capped and tempered logits of `ids` at the given states, `[B, X]`."""
    columns_BXE = _head_columns(head, ids_BX)
    logits = jnp.einsum("bxe,bxe->bx", states_BXE.astype(head.weight.dtype), columns_BXE,
                        preferred_element_type=jnp.float32)
    return cap_logits(logits, head.softcap) / temperature


def support_log_probs(states_BSE, head: Head, tokens_BT, support, temperature: float = 1.0):
    """(each target's log-likelihood renormalised over its kept ids `[B, S]`, whether it has any `[B, S]`).

    `states_BSE` are the output states behind the targets `tokens_BT[:, 1:]` (`T = S + 1`); `support` is
    `(ids, columns)`, int `[B, C]` each: entry `c` of row `b` keeps vocabulary id `ids[b, c]` for the
    target in column `columns[b, c]` of `tokens_BT` (predicted from slot `column - 1`); a column below 1
    marks an unused entry. A target with entries scores `z_t / T - logsumexp_kept(z / T)` over the capped
    logits `z`, as a sampler that tempers, then keeps those ids, draws it; the others score nothing
    here (False in the second result).
    """
    ids_BC, columns_BC = (jnp.asarray(part, jnp.int32) for part in support)
    B, S = states_BSE.shape[:2]
    used_BC = columns_BC >= 1
    slot_BC = jnp.clip(columns_BC - 1, 0, S - 1)
    states_BCE = jnp.take_along_axis(states_BSE, slot_BC[..., None], axis=1)
    kept_BC = jnp.where(used_BC, _logits_of(states_BCE, head, ids_BC, temperature), -jnp.inf)
    rows_BC = jnp.broadcast_to(jnp.arange(B)[:, None], slot_BC.shape)
    # A log-sum-exp per slot over its entries; the shift by the slot's largest entry only keeps exp in range.
    top_BS = jax.lax.stop_gradient(jnp.full((B, S), -jnp.inf).at[rows_BC, slot_BC].max(kept_BC))
    has_BS = jnp.zeros((B, S), bool).at[rows_BC, slot_BC].max(used_BC)
    shift_BS = jnp.where(has_BS, top_BS, 0.0)
    total_BS = jnp.zeros((B, S), jnp.float32).at[rows_BC, slot_BC].add(
        jnp.where(used_BC, jnp.exp(kept_BC - shift_BS[rows_BC, slot_BC]), 0.0))
    lse_BS = shift_BS + jnp.log(jnp.where(has_BS, total_BS, 1.0))
    target_BS = _logits_of(states_BSE, head, jnp.asarray(tokens_BT)[:, 1:].astype(jnp.int32), temperature)
    return jnp.where(has_BS, target_BS - lse_BS, 0.0), has_BS


def check_support(support, tokens_BT, vocab: int) -> None:
    """Refuse a host `(ids, columns)` support that does not fit `tokens_BT` `[B, S + 1]`: shapes, ids
    outside the vocabulary, columns outside the targets, a target missing from its own kept ids."""
    if not isinstance(support, (tuple, list)) or len(support) != 2:
        raise TypeError("support is (ids, columns), int [B, C] each, as sessions.pack builds it")
    if any(isinstance(part, jax.core.Tracer) for part in (*support, tokens_BT)):
        return
    ids, columns = (np.asarray(part) for part in support)
    tokens = np.asarray(tokens_BT)
    if ids.shape != columns.shape or ids.ndim != 2 or ids.shape[0] != tokens.shape[0]:
        raise ValueError(f"support ids {ids.shape} and columns {columns.shape} must both be [B, C] with the tokens' "
                         f"B = {tokens.shape[0]}")
    used = columns >= 1
    if np.any(columns > tokens.shape[1] - 1):
        raise ValueError(f"support column {int(columns.max())} is past the last target column {tokens.shape[1] - 1} "
                         "of the tokens")
    bad = used & ((ids < 0) | (ids >= vocab))
    if bad.any():
        row, entry = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"support id {int(ids[row, entry])} at row {row}, entry {entry} is outside vocab_size {vocab}")
    for row, column in sorted({(int(r), int(columns[r, e])) for r, e in zip(*np.nonzero(used))}):
        kept = ids[row][columns[row] == column]
        if tokens[row, column] not in kept:
            raise ValueError(f"the target {int(tokens[row, column])} at row {row}, column {column} is not among the "
                             f"{len(kept)} ids its support keeps: the sampler could not have drawn it")


def shift_left(rows_BT, left_padding_B):
    """Each row rolled left by its padding count, so its real tokens start at column 0."""
    columns = (jnp.arange(rows_BT.shape[1])[None, :] + jnp.asarray(left_padding_B)[:, None]) % rows_BT.shape[1]
    return jnp.take_along_axis(rows_BT, columns, axis=1)


def shift_back(values_BS, left_padding_B):
    """Per-slot values of left-shifted rows back in their original slots; slots whose input was padding are 0."""
    pad_B1 = jnp.asarray(left_padding_B)[:, None]
    slots = jnp.arange(values_BS.shape[1])[None, :]
    moved = jnp.take_along_axis(values_BS, (slots - pad_B1) % values_BS.shape[1], axis=1)
    return jnp.where(slots >= pad_B1, moved, 0.0)


def check_left_padding(left_padding, tokens_BT) -> None:
    """Refuse padding counts that are not one per row, or leave a row no real input."""
    if isinstance(left_padding, jax.core.Tracer):
        return
    counts = np.asarray(left_padding)
    rows, width = np.shape(tokens_BT)
    if counts.shape != (rows,) or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"left_padding has shape {counts.shape} and dtype {counts.dtype}; give one integer count per "
                         f"row, [{rows}]")
    bad = np.flatnonzero((counts < 0) | (counts > width - 2))
    if len(bad):
        raise ValueError(f"left_padding {int(counts[bad[0]])} at row {int(bad[0])} is outside [0, {width - 2}]: a row of "
                         f"{width} tokens keeps at least one real input and its target")


@dataclasses.dataclass(frozen=True)
class Rollout(Generation):
    """A `Generation` drawn from one snapshot of a policy: `log_probs` `[rows, max_new_tokens]` are each
    new token's likelihood as the sampler saw it (tempered, filtered), `policy_log_probs` the raw
    policy's (the full softmax of the capped logits, as `per_token_log_probs` scores it); 0 past a
    row's new tokens."""

    policy_log_probs: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class PolicyGeneration(TextGeneration):
    """`LMObjective.policy`'s task: generation over one snapshot of the training tree whose results are
    `Rollout`s. `raw_log_probs(params, tokens)` scores rows `[B, T]` teacher-forced (`[B, T - 1]`)."""

    raw_log_probs: object = None

    def __call__(self, prompts, max_new_tokens: int | None = None, **options) -> Rollout:
        drawn = super().__call__(prompts, max_new_tokens, **options)
        scored = np.asarray(self.raw_log_probs(self.params, jnp.asarray(drawn.tokens)))
        # New token t of a row sits at column prompt + t, so slot prompt + t - 1 predicts it.
        prompt = drawn.lengths - drawn.new_tokens
        steps = np.arange(drawn.log_probs.shape[1])
        slots = np.clip(prompt[:, None] - 1 + steps[None, :], 0, scored.shape[1] - 1)
        raw = np.where(steps[None, :] < drawn.new_tokens[:, None], np.take_along_axis(scored, slots, axis=1), 0.0)
        fields = {field.name: getattr(drawn, field.name) for field in dataclasses.fields(Generation)}
        return Rollout(**fields, policy_log_probs=raw.astype(np.float32))
