"""Cross entropy over the vocabulary in row chunks, so neither pass holds the `[N, V]` logits.

The rows (tokens) are split into `chunks` equal pieces (the last padded with rows that weigh
nothing) and a scan runs them one after another: each piece's float32 logits `[N / chunks, V]`
are made, reduced and dropped before the next. The scan, not an unrolled loop, is what makes the
pieces run in turn: XLA would otherwise compute independent products side by side and hold them all.

Two entry points share the per-piece arithmetic:

- `chunked_cross_entropy` gives per-token `(ce, lse, correct)` that differentiate like any array:
  its backward pass makes each piece's logits again (a fourth head product).
- `weighted_cross_entropy` gives the training loss `sum(a * ce + b * lse**2)` with per-token
  weights `a` and `b` fixed by the data. Its gradient is a scalar times a gradient known in the
  forward pass, so the forward pass computes it while each piece's logits are at hand: three head
  products in all, as the unchunked head costs, and no recomputation.

Under bf16 compute the products take bf16 operands and accumulate in float32, forward and backward,
as torch autocast runs the head.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn.transformer import cap_logits, vocab_logits


def _pieces(rows: int, chunks: int) -> tuple[int, int]:
    """(rows per piece, piece count) for `rows` rows split `chunks` ways."""
    count = max(1, min(chunks, rows))
    return -(-rows // count), count


def _split(array, per_piece: int, count: int):
    """`[N, ...]` -> `[count, per_piece, ...]`, zero-padded at the end."""
    pad = per_piece * count - array.shape[0]
    if pad:
        array = jnp.pad(array, [(0, pad)] + [(0, 0)] * (array.ndim - 1))
    return array.reshape(count, per_piece, *array.shape[1:])


def _join(array, rows: int):
    """`[count, per_piece, ...]` -> the first `rows` rows of `[count * per_piece, ...]`."""
    return array.reshape(-1, *array.shape[2:])[:rows]


def _scores(hidden_RE, weight, targets_R, transposed, softcap):
    """One piece's (capped float32 logits `[R, V]`, ce, lse, correct)."""
    logits_RV = cap_logits(vocab_logits(hidden_RE, weight, transposed), softcap)
    lse = jax.nn.logsumexp(logits_RV, axis=-1)
    target_logit = jnp.take_along_axis(logits_RV, targets_R[:, None], axis=-1)[:, 0]
    correct = (jnp.argmax(logits_RV, axis=-1) == targets_R).astype(jnp.float32)
    return logits_RV, lse - target_logit, lse, correct


def _input_grads(hidden_RE, weight, targets_R, logits_RV, lse, d_ce, d_lse, transposed, softcap):
    """Gradients for the piece's hidden rows `[R, E]` and the head, given d(out)/d(ce) and d(out)/d(lse) per row.

    d(logits) = softmax * (d_ce + d_lse) - onehot(target) * d_ce, through the softcap's tanh.
    """
    probs_RV = jnp.exp(logits_RV - lse[:, None])
    onehot_RV = targets_R[:, None] == jnp.arange(logits_RV.shape[1])[None, :]
    d_logits = probs_RV * (d_ce + d_lse)[:, None] - jnp.where(onehot_RV, d_ce[:, None], 0.0)
    if softcap is not None:
        d_logits = d_logits * (1.0 - jnp.square(logits_RV / softcap))
    d_logits = d_logits.astype(hidden_RE.dtype)
    w_contract = ((1,), (0,)) if transposed else ((1,), (1,))
    d_hidden = lax.dot_general(d_logits, weight, (w_contract, ((), ())), preferred_element_type=jnp.float32)
    if transposed:
        d_weight = lax.dot_general(d_logits, hidden_RE, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        d_weight = lax.dot_general(hidden_RE, d_logits, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return d_hidden.astype(hidden_RE.dtype), d_weight


def _accumulate(hidden_NE, weight, targets_N, chunks, per_row, piece, with_weight_grad: bool):
    """Run `piece(hidden_RE, targets_R, *row_values) -> (d_weight or None, outputs)` over the row pieces.

    `per_row` are `[N]` arrays split alongside the rows. Returns the pieces' `d_weight`s summed in
    float32 (None without `with_weight_grad`) and their outputs (each `[R, ...]`) joined to `[N, ...]`.
    """
    N = hidden_NE.shape[0]
    per_piece, count = _pieces(N, chunks)
    xs = tuple(_split(x, per_piece, count) for x in (hidden_NE, targets_N, *per_row))

    def body(d_weight, piece_xs):
        d_piece, outputs = piece(*piece_xs)
        return (d_weight if d_piece is None else d_weight + d_piece), outputs

    start = jnp.zeros(weight.shape, jnp.float32) if with_weight_grad else None
    d_weight, outputs = lax.scan(body, start, xs)
    return d_weight, jax.tree_util.tree_map(lambda x: _join(x, N), outputs)


# -- per-token scores, differentiable ---------------------------------------------------------------
@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_cross_entropy(hidden_NE, weight, targets_N, transposed: bool, chunks: int, softcap: float | None):
    """Per-token `(ce, lse, correct)`, float32 `[N]` each.

    `weight` is the head, `[E, V]` (or `[V, E]` with `transposed`, a tied embedding); `hidden_NE` is in
    the compute dtype and `weight` already cast to it. `ce = lse - logit[target]`; `correct` is 1.0
    where the argmax (first maximum) is the target. Gradients flow through `ce` and `lse`.
    """
    return _scores_forward(hidden_NE, weight, targets_N, transposed, chunks, softcap)


def _scores_forward(hidden_NE, weight, targets_N, transposed, chunks, softcap):
    def piece(hidden_RE, targets_R):
        _, ce, lse, correct = _scores(hidden_RE, weight, targets_R, transposed, softcap)
        return None, (ce, lse, correct)

    _, outputs = _accumulate(hidden_NE, weight, targets_N, chunks, (), piece, with_weight_grad=False)
    return outputs


def _scores_fwd(hidden_NE, weight, targets_N, transposed, chunks, softcap):
    outputs = _scores_forward(hidden_NE, weight, targets_N, transposed, chunks, softcap)
    return outputs, (hidden_NE, weight, targets_N)


def _scores_bwd(transposed, chunks, softcap, residuals, cotangents):
    hidden_NE, weight, targets_N = residuals
    g_ce, g_lse, _ = cotangents

    def piece(hidden_RE, targets_R, d_ce, d_lse):
        logits_RV, _, lse, _ = _scores(hidden_RE, weight, targets_R, transposed, softcap)
        d_hidden, d_weight = _input_grads(hidden_RE, weight, targets_R, logits_RV, lse, d_ce, d_lse, transposed, softcap)
        return d_weight, d_hidden

    d_weight, d_hidden = _accumulate(hidden_NE, weight, targets_N, chunks, (g_ce, g_lse), piece, with_weight_grad=True)
    return d_hidden, d_weight.astype(weight.dtype), None


chunked_cross_entropy.defvjp(_scores_fwd, _scores_bwd)


# -- the weighted training loss, gradient made in the forward pass ----------------------------------
def weighted_cross_entropy(hidden_NE, weight, targets_N, ce_weights_N, lse_square_weights_N, *,
                           transposed: bool, chunks: int, softcap: float | None):
    """`(loss, (ce, lse, correct))`: `loss = sum(ce_weights * ce + lse_square_weights * lse**2)`.

    Only `loss` carries a gradient (to `hidden_NE` and `weight`); the per-token float32 `[N]` scores
    are for statistics and do not. The weights are data (padding masks, z-loss coefficients) and
    take no gradient either.
    """
    loss, scores = _weighted(hidden_NE, weight, targets_N, lax.stop_gradient(ce_weights_N),
                             lax.stop_gradient(lse_square_weights_N), transposed, chunks, softcap)
    return loss, jax.tree_util.tree_map(lax.stop_gradient, scores)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _weighted(hidden_NE, weight, targets_N, ce_weights_N, lse_square_weights_N, transposed, chunks, softcap):
    return _weighted_fwd(hidden_NE, weight, targets_N, ce_weights_N, lse_square_weights_N,
                         transposed, chunks, softcap, with_grads=False)[0]


def _weighted_fwd(hidden_NE, weight, targets_N, ce_weights_N, lse_square_weights_N, transposed, chunks, softcap,
                  with_grads=True):
    def piece(hidden_RE, targets_R, a, b):
        logits_RV, ce, lse, correct = _scores(hidden_RE, weight, targets_R, transposed, softcap)
        if not with_grads:
            return None, (ce, lse, correct)
        d_hidden, d_weight = _input_grads(hidden_RE, weight, targets_R, logits_RV, lse, a, 2.0 * b * lse,
                                          transposed, softcap)
        return d_weight, (ce, lse, correct, d_hidden)

    d_weight, outputs = _accumulate(hidden_NE, weight, targets_N, chunks, (ce_weights_N, lse_square_weights_N),
                                    piece, with_weight_grad=with_grads)
    ce, lse, correct = outputs[:3]
    loss = jnp.sum(ce_weights_N * ce) + jnp.sum(lse_square_weights_N * jnp.square(lse))
    result = (loss, (ce, lse, correct))
    if not with_grads:
        return result, None
    return result, (outputs[3], d_weight.astype(weight.dtype))


def _weighted_bwd(transposed, chunks, softcap, residuals, cotangents):
    d_hidden, d_weight = residuals
    g_loss = cotangents[0]
    return (g_loss * d_hidden).astype(d_hidden.dtype), (g_loss * d_weight).astype(d_weight.dtype), None, None, None


_weighted.defvjp(
    lambda h, w, t, a, b, transposed, chunks, softcap: _weighted_fwd(h, w, t, a, b, transposed, chunks, softcap),
    _weighted_bwd,
)
