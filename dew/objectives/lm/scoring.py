"""`LMObjective`'s policy scoring (`PolicyScoring`: `per_token_log_probs`, `sampled_log_probs`,
`head_logits`, `policy`) and the pieces behind it: a target's likelihood renormalised over the ids a
sampler kept (`support_log_probs`), left padding moved out of the way, and the rollout task `policy`
returns, which records the raw policy's likelihoods beside the sampler's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dew.data.inputs import ModelInputs
from dew.inference.text import TextGeneration
from dew.nn.head import Head, cap_logits
from dew.objectives.base import Variables
from dew.objectives.lm.rows import _real, _Rows, _rows_of
from dew.sampling import Generation, Sampling

if TYPE_CHECKING:
    from dew.objectives.lm.objective import Scores


def _head_columns(head: Head, ids):
    """The head's weight columns of `ids` (any shape), `[..., E]`."""
    return jnp.take(head.weight, ids, axis=0) if head.transposed else jnp.moveaxis(jnp.take(head.weight, ids, axis=1), 0, -1)


def _logits_of(states_BXE, head: Head, ids_BX, temperature: float):
    """float32 capped and tempered logits of `ids` at the given states, `[B, X]`."""
    columns_BXE = _head_columns(head, ids_BX)
    logits = jnp.einsum("bxe,bxe->bx", states_BXE.astype(head.weight.dtype), columns_BXE,
                        preferred_element_type=jnp.float32)
    return cap_logits(logits, head.softcap) / (temperature * head.logit_divisor)


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


class PolicyScoring:
    """`LMObjective`'s policy-scoring methods, as the reference writes them. They read the objective's
    `model`, `head_chunks` and its pass over token rows (`_forward`)."""

    # -- policy scoring ----------------------------------------------------------------------------
    def head_logits(self, params: Variables, states) -> jax.Array:
        """Capped float32 logits `[..., vocab]` of output states `[..., E]` (`Scores.states`) through
        the model's head over `params`."""
        return self._head(params).logits(states)

    def _head(self, params) -> Head:
        # The head is read inside the model's pass; one token's pass hands it over, and under jit the
        # unused layers are dropped.
        return self.model.apply(params, jnp.zeros((1, 1), jnp.int32), head=False).head

    def per_token_log_probs(self, params: Variables, tokens, *, left_padding=None) -> jax.Array:
        """Score raw policy likelihoods aligned to next-token targets.

        `tokens` are ids `[B, S + 1]` or a `ModelInputs` (its `attention_mask` marks padding); the
        result is float32 `[B, S]`, slot `j` the log-likelihood of token `j + 1` after tokens `0..j`
        under the full softmax of the capped logits. Explicit `left_padding` counts (int `[B]`) move
        each row's real context to position zero before scoring, so its positions start at 0. Returned
        slots whose input is padding are zero and unscored, as are slots whose target is padding by
        the attention mask or segment 0. Gradients flow (the chunked loss's).
        """
        rows = _rows_of(tokens)
        if left_padding is not None:
            if isinstance(tokens, ModelInputs):
                raise ValueError("left_padding moves padding of plain token rows; a ModelInputs marks its padding "
                                 "with attention_mask: give one or the other")
            check_left_padding(left_padding, rows.tokens)
            rows = _Rows(shift_left(jnp.asarray(rows.tokens), left_padding))
        forward = self._forward(params, rows, None)
        ce, _, _ = forward.head.cross_entropy(forward.hidden_NE, forward.targets_N, self.head_chunks, accuracy=False)
        log_probs_BS = -ce.reshape(forward.weights_BS.shape)
        real_BT = _real(rows)
        if real_BT is not None:
            log_probs_BS = jnp.where(real_BT[:, :-1] & real_BT[:, 1:], log_probs_BS, 0.0)
        if left_padding is not None:
            log_probs_BS = shift_back(log_probs_BS, left_padding)
        return log_probs_BS

    def sampled_log_probs(self, params: Variables, scores: Scores, tokens, support=None,
                          temperature: float = 1.0) -> jax.Array:
        """Each next-token target's likelihood as the sampler that drew it saw it.

        `scores` is `token_scores` over `tokens`, `[B, S + 1]`; the result is `[B, S]`. At unit
        temperature without support that is the raw policy, `-scores.losses`. `temperature` (above 0)
        divides the capped logits (`head_logits`). `support` is the per-row ragged `(ids, columns)`
        pair `sessions.pack` builds, `[B, C]` each, `columns` the column in `tokens` of the target
        each kept id belongs to (below 1: an unused entry); a target with entries is renormalised
        over them (`support_log_probs`), the others over the whole vocabulary.
        """
        if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature is {temperature!r}; give the sampler's temperature, a number above 0 (a "
                             "greedy draw, temperature 0, has likelihood 1 for its argmax and needs no scoring)")
        temperature = float(temperature)
        if temperature == 1.0 and support is None:
            return -scores.losses
        if scores.states is None:
            raise ValueError("these scores carry no output states: score the tokens with token_scores")
        if support is not None:
            check_support(support, tokens, self.model.config.vocab_size)
        head = self._head(params)
        B, S = scores.losses.shape
        log_probs_BS = -scores.losses
        if temperature != 1.0:
            targets_N = jnp.asarray(tokens)[:, 1:].reshape(-1).astype(jnp.int32)
            ce, _, _ = head.cross_entropy(scores.states.reshape(B * S, -1).astype(head.weight.dtype), targets_N,
                                          self.head_chunks, accuracy=False, temperature=temperature)
            log_probs_BS = -ce.reshape(B, S)
        if support is None:
            return log_probs_BS
        renormalised_BS, kept_BS = support_log_probs(scores.states, head, tokens, support, temperature)
        return jnp.where(kept_BS, renormalised_BS, log_probs_BS)

    def policy(self, params: Variables, sampling: Sampling = Sampling()) -> PolicyGeneration:
        """Expose the model over this training tree as a generation task.

        A rollout binds one snapshot of the policy and draws every completion from it; the result (a
        `Rollout`) records the actual and raw-policy likelihoods the objective's ratio needs: the
        sampler's (`log_probs`, tempered and filtered) and the raw policy's (`policy_log_probs`, the
        full softmax, as `per_token_log_probs` scores it).
        """
        return PolicyGeneration(self.model, params, sampling=sampling, raw_log_probs=self._compiled_log_probs)

    @functools.cached_property
    def _compiled_log_probs(self):
        """`per_token_log_probs` compiled once per objective, so that every rollout reuses it."""
        return jax.jit(self.per_token_log_probs)
