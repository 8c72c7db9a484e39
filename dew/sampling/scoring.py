"""Log-probabilities as a server reports them: the model's own float32 log-softmax of the logits that
draw (or follow) a token, whatever the sampling policy, and the most likely alternatives.

Every value, a token's and its alternatives', is `(x - max) - log(sum(exp(x - max)))` of the one logits
row (`jax.nn.log_softmax`'s formula), so a token that is the most likely has exactly the value of
the first alternative, as a harness that compares them for equality needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

SCORE_POSITIONS = 16
"""Prompt positions whose vocabulary-wide logits are held at once while a prompt is scored (a prompt
width is a multiple of it, `dew.sampling.generate.PROMPT_BUCKET`)."""


@struct.dataclass
class Scores:
    """float32 `log_prob` `[...]` of chosen tokens, and the `top` most likely ids (int32 `top_ids`
    `[..., top]`) with their float32 `top_log_probs`, most likely first."""

    log_prob: jax.Array
    top_ids: jax.Array
    top_log_probs: jax.Array


def score(logits_NV: jax.Array, ids_N: jax.Array, top: int) -> Scores:
    """The log-probabilities of `ids_N` under float32 logits `[N, V]`, and the `top` most likely."""
    logits_NV = logits_NV.astype(jnp.float32)
    high_N1 = jnp.max(logits_NV, axis=-1, keepdims=True)
    log_total_N1 = jnp.log(jnp.sum(jnp.exp(logits_NV - high_N1), axis=-1, keepdims=True))
    chosen_N1 = jnp.take_along_axis(logits_NV, ids_N[:, None], axis=-1)
    log_prob_N = ((chosen_N1 - high_N1) - log_total_N1)[:, 0]
    if top == 0:
        empty = jnp.zeros((logits_NV.shape[0], 0))
        return Scores(log_prob_N, empty.astype(jnp.int32), empty)
    best_NK, ids_NK = jax.lax.top_k(logits_NV, top)
    return Scores(log_prob_N, ids_NK.astype(jnp.int32), (best_NK - high_N1) - log_total_N1)


def empty_scores(rows: int, top: int) -> Scores:
    """Zeros in the shape of `score`'s answer for `rows` rows (the branch that scores nothing)."""
    return Scores(jnp.zeros((rows,)), jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top)))


def prompt_scores(head, hidden_BPE: jax.Array, tokens_BP: jax.Array, top: int) -> Scores:
    """Each prompt position's score given the positions before it, `[B, P]` (`[B, P, top]`), from the
    hidden states `[B, P, E]` of one pass over the prompt; position 0 scores nothing (zeros). The head
    runs over `SCORE_POSITIONS` positions at a time, so no `[B, P, V]` array is ever held."""
    B, P, E = hidden_BPE.shape
    chunks = -(-P // SCORE_POSITIONS)
    pad = chunks * SCORE_POSITIONS - P
    # position p's logits score token p + 1; the last position has nothing to score (any id will do)
    targets_BP = jnp.concatenate([tokens_BP[:, 1:], tokens_BP[:, :1]], axis=1)
    hidden_CBSE = jnp.pad(hidden_BPE, ((0, 0), (0, pad), (0, 0))).reshape(B, chunks, SCORE_POSITIONS, E).swapaxes(0, 1)
    targets_CBS = jnp.pad(targets_BP, ((0, 0), (0, pad))).reshape(B, chunks, SCORE_POSITIONS).swapaxes(0, 1)

    def chunk(args):
        hidden_BSE, targets_BS = args
        logits_NV = head.logits(hidden_BSE.reshape(B * SCORE_POSITIONS, E))
        return score(logits_NV, targets_BS.reshape(-1), top)

    scores = jax.lax.map(chunk, (hidden_CBSE, targets_CBS))  # leaves [chunks, B * S, ...]

    def lay_out(x):  # [chunks, B * S, ...] -> [B, P, ...], shifted one position right
        x = x.reshape(chunks, B, SCORE_POSITIONS, *x.shape[2:]).swapaxes(0, 1).reshape(B, chunks * SCORE_POSITIONS,
                                                                                      *x.shape[2:])[:, :P - 1]
        return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)

    return jax.tree_util.tree_map(lay_out, scores)
