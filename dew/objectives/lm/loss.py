"""Cross entropy over the vocabulary in tiles, so neither pass holds the `[N, V]` logits.

The forward pass keeps a running float32 log-sum-exp across tiles; the backward pass recomputes each
tile's logits and turns them into the gradient of that tile at once. Under bf16 compute both products
take bf16 operands and accumulate in float32, forward and backward, as torch autocast runs the head.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn.transformer import vocab_logits


def _tiles(vocab: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, vocab))
    width = -(-vocab // chunks)
    return [(start, min(start + width, vocab)) for start in range(0, vocab, width)]


def _tile_weight(weight, start, stop, transposed):
    return weight[start:stop] if transposed else weight[:, start:stop]


def _tile_logits(hidden_NE, weight, start, stop, transposed, softcap):
    raw_NC = vocab_logits(hidden_NE, _tile_weight(weight, start, stop, transposed), transposed)
    if softcap is None:
        return raw_NC, raw_NC
    return raw_NC, softcap * jnp.tanh(raw_NC / softcap)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_cross_entropy(hidden_NE, weight, targets_N, transposed: bool, chunks: int, softcap: float | None):
    """Per-token `(ce, lse, correct)`, float32 `[N]` each.

    `weight` is the head, `[E, V]` (or `[V, E]` with `transposed`, a tied embedding); `hidden_NE` is in
    the compute dtype and `weight` already cast to it. `ce = lse - logit[target]`; `correct` is 1.0
    where the argmax (first maximum) is the target. Gradients flow through `ce` and `lse`.
    """
    return _forward(hidden_NE, weight, targets_N, transposed, chunks, softcap)[0]


def _forward(hidden_NE, weight, targets_N, transposed, chunks, softcap):
    N = hidden_NE.shape[0]
    running_max = jnp.full((N,), -jnp.inf, jnp.float32)
    running_sum = jnp.zeros((N,), jnp.float32)
    target_logit = jnp.zeros((N,), jnp.float32)
    best_value = jnp.full((N,), -jnp.inf, jnp.float32)
    best_index = jnp.zeros((N,), jnp.int32)
    for start, stop in _tiles(weight.shape[0] if transposed else weight.shape[1], chunks):
        _, logits_NC = _tile_logits(hidden_NE, weight, start, stop, transposed, softcap)
        tile_max = jnp.max(logits_NC, axis=-1)
        new_max = jnp.maximum(running_max, tile_max)
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(
            jnp.exp(logits_NC - new_max[:, None]), axis=-1
        )
        running_max = new_max
        inside = (targets_N >= start) & (targets_N < stop)
        picked = jnp.take_along_axis(logits_NC, jnp.clip(targets_N - start, 0, stop - start - 1)[:, None], axis=-1)
        target_logit = jnp.where(inside, picked[:, 0], target_logit)
        better = tile_max > best_value
        best_index = jnp.where(better, start + jnp.argmax(logits_NC, axis=-1).astype(jnp.int32), best_index)
        best_value = jnp.maximum(best_value, tile_max)
    lse = running_max + jnp.log(running_sum)
    correct = (best_index == targets_N).astype(jnp.float32)
    return (lse - target_logit, lse, correct), (hidden_NE, weight, targets_N, lse)


def _backward(transposed, chunks, softcap, residuals, cotangents):
    hidden_NE, weight, targets_N, lse = residuals
    g_ce, g_lse, _ = cotangents
    g_total = (g_ce + g_lse)[:, None]
    d_hidden = jnp.zeros(hidden_NE.shape, jnp.float32)
    d_tiles = []
    for start, stop in _tiles(weight.shape[0] if transposed else weight.shape[1], chunks):
        raw_NC, logits_NC = _tile_logits(hidden_NE, weight, start, stop, transposed, softcap)
        probs_NC = jnp.exp(logits_NC - lse[:, None])
        onehot_NC = (targets_N[:, None] - start) == jnp.arange(stop - start)[None, :]
        d_logits = probs_NC * g_total - jnp.where(onehot_NC, g_ce[:, None], 0.0)
        if softcap is not None:
            d_logits = d_logits * (1.0 - jnp.square(logits_NC / softcap))
        d_logits = d_logits.astype(hidden_NE.dtype)
        w_tile = _tile_weight(weight, start, stop, transposed)
        # d_hidden = d_logits @ w_tile^T; d_w = hidden^T @ d_logits (or its transpose when tied).
        w_contract = ((1,), (0,)) if transposed else ((1,), (1,))
        d_hidden += lax.dot_general(d_logits, w_tile, (w_contract, ((), ())), preferred_element_type=jnp.float32)
        if transposed:
            d_w = lax.dot_general(d_logits, hidden_NE, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        else:
            d_w = lax.dot_general(hidden_NE, d_logits, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        d_tiles.append(d_w.astype(weight.dtype))
    d_weight = jnp.concatenate(d_tiles, axis=0 if transposed else 1)
    return d_hidden.astype(hidden_NE.dtype), d_weight, None


chunked_cross_entropy.defvjp(
    lambda h, w, t, transposed, chunks, softcap: _forward(h, w, t, transposed, chunks, softcap), _backward
)
