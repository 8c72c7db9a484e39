"""Cross entropy over the vocabulary in tiles, so neither pass holds the `[N, V]` logits.

The forward pass scans the tiles keeping a running float32 log-sum-exp; the backward pass scans
them again, recomputing each tile's logits and turning them into that tile's gradient at once. The
scans (not an unrolled loop) make the tiles run one after another: XLA would otherwise compute the
independent tile products side by side and hold every tile at once. Under bf16 compute both
products take bf16 operands and accumulate in float32, forward and backward, as torch autocast
runs the head.

Tiles are `ceil(V / chunks)` wide; the last one starts early enough to end at `V`, and the columns
it shares with the tile before are masked out of it. `chunks=None` picks the count from the rows at
trace time: the fewest tiles whose float32 logits stay within `TILE_BYTES` each. A single tile
(`chunks=1`, or `None` with small logits) keeps its logits from the forward pass for the backward
instead of making them again: three head products instead of four, for the `[N, V]` buffer the
forward pass held anyway.

The products go through `dew.nn.fast_matmul.product` (oneDNN where measured faster, else XLA's).

A `temperature` other than 1 divides the capped logits before the softmax, as a sampler tempers
them (`LMObjective.sampled_log_probs`); at 1 the tiles are not divided at all.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from dew.nn import fast_softmax
from dew.nn.fast_matmul import product

# `chunks=None`: the fewest tiles whose float32 logits take at most this many bytes each (64 MiB: the
# rows of a 16 x 128 micro-batch against a 4,096-id vocabulary are 8 MiB, one tile; GPT-2's 50,257 ids
# over 1,024 rows are 206 MB, four tiles).
TILE_BYTES = 64 * 2**20


def _layout(vocab: int, chunks: int | None, rows: int) -> tuple[int, int]:
    """(tile width, tile count)."""
    if chunks is None:
        chunks = -(-rows * vocab * 4 // TILE_BYTES)
    chunks = max(1, min(chunks, vocab))
    width = -(-vocab // chunks)
    return width, -(-vocab // width)


def _tile(hidden_NE, weight, index, width, transposed, softcap):
    """The tile's first column, its capped float32 logits `[N, width]` (shared columns at -inf), and the mask."""
    vocab = weight.shape[0] if transposed else weight.shape[1]
    start = jnp.minimum(index * width, vocab - width)
    if transposed:
        w_tile = lax.dynamic_slice_in_dim(weight, start, width, axis=0)
    else:
        w_tile = lax.dynamic_slice_in_dim(weight, start, width, axis=1)
    logits_NC = product(hidden_NE, w_tile, transpose_b=transposed)
    if softcap is not None:
        logits_NC = softcap * jnp.tanh(logits_NC / softcap)
    fresh_C = start + jnp.arange(width) >= index * width
    return start, w_tile, jnp.where(fresh_C[None, :], logits_NC, -jnp.inf), fresh_C


def _tempered(capped_NC, temperature: float):
    return capped_NC if temperature == 1.0 else capped_NC / temperature


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def chunked_cross_entropy(hidden_NE, weight, targets_N, transposed: bool, chunks: int, softcap: float | None,
                          accuracy: bool = True, temperature: float = 1.0):
    """Per-token `(ce, lse, correct)`, float32 `[N]` each.

    `weight` is the head, `[E, V]` (or `[V, E]` with `transposed`, a tied embedding); `hidden_NE` is in
    the compute dtype and `weight` already cast to it. `chunks` is the tile count, or None to pick it
    from the rows (see the module docstring). `ce = lse - logit[target]`; `correct` is 1.0
    where the argmax (first maximum) is the target. Gradients flow through `ce` and `lse`. With
    `accuracy` False (a static flag) `correct` is None and the scan takes no argmax over the tiles.
    `temperature` (a static Python float above 0) divides the capped logits first.
    """
    return _forward(hidden_NE, weight, targets_N, transposed, chunks, softcap, accuracy, temperature)[0]


def _forward(hidden_NE, weight, targets_N, transposed, chunks, softcap, accuracy, temperature):
    N = hidden_NE.shape[0]
    width, count = _layout(weight.shape[0] if transposed else weight.shape[1], chunks, N)

    def body(carry, index):
        running_max, running_sum, target_logit, best = carry
        start, _, capped_NC, _ = _tile(hidden_NE, weight, index, width, transposed, softcap)
        logits_NC = _tempered(capped_NC, temperature)
        tile_max = jnp.max(logits_NC, axis=-1)
        new_max = jnp.maximum(running_max, tile_max)
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(logits_NC - new_max[:, None]), -1)
        column = targets_N - start
        inside = (column >= 0) & (column < width) & (targets_N >= index * width)
        picked = jnp.take_along_axis(logits_NC, jnp.clip(column, 0, width - 1)[:, None], axis=-1)[:, 0]
        target_logit = jnp.where(inside, picked, target_logit)
        if accuracy:  # the running first maximum: (its value, its column); absent from the carry otherwise
            best_value, best_index = best
            better = tile_max > best_value
            # The first column holding the tile's maximum, as `argmax` picks it: XLA's CPU backend runs
            # argmax's (value, index) reduction as a scalar loop (10% of a small step), and its plain
            # min-reduction form through an int32 copy of the tile (6%); `first_max` reads each row once.
            first = fast_softmax.first_max(logits_NC)
            best_index = jnp.where(better, start + first, best_index)
            best = (jnp.maximum(best_value, tile_max), best_index)
        return (new_max, running_sum, target_logit, best), (capped_NC if count == 1 else None)

    minus_inf = jnp.full((N,), -jnp.inf, jnp.float32)
    best = (minus_inf, jnp.zeros((N,), jnp.int32)) if accuracy else ()
    start = (minus_inf, jnp.zeros((N,), jnp.float32), jnp.zeros((N,), jnp.float32), best)
    (running_max, running_sum, target_logit, best), kept = lax.scan(body, start, jnp.arange(count))
    lse = running_max + jnp.log(running_sum)
    correct = (best[1] == targets_N).astype(jnp.float32) if accuracy else None
    # One tile: its capped logits go to the backward pass, which would otherwise make them again.
    return (lse - target_logit, lse, correct), (hidden_NE, weight, targets_N, lse, kept)


def _backward(transposed, chunks, softcap, accuracy, temperature, residuals, cotangents):
    hidden_NE, weight, targets_N, lse, kept = residuals
    g_ce, g_lse, _ = cotangents
    g_total = (g_ce + g_lse)[:, None]
    width, count = _layout(weight.shape[0] if transposed else weight.shape[1], chunks, hidden_NE.shape[0])
    axis = 0 if transposed else 1

    def body(carry, index):
        d_hidden, d_weight = carry
        if kept is None:
            start, w_tile, capped_NC, fresh_C = _tile(hidden_NE, weight, index, width, transposed, softcap)
        else:  # the single tile, whole: its logits kept by the forward pass
            start, w_tile, capped_NC, fresh_C = 0, weight, kept[index], jnp.ones((width,), bool)
        probs_NC = jnp.exp(_tempered(capped_NC, temperature) - lse[:, None])  # 0 on the shared columns
        target_NC = (targets_N[:, None] - start == jnp.arange(width)[None, :]) & fresh_C[None, :]
        d_logits = probs_NC * g_total - jnp.where(target_NC, g_ce[:, None], 0.0)
        if temperature != 1.0:
            d_logits = d_logits / temperature
        if softcap is not None:
            d_logits = jnp.where(fresh_C[None, :], d_logits * (1.0 - jnp.square(capped_NC / softcap)), 0.0)
        d_logits = d_logits.astype(hidden_NE.dtype)
        # d_hidden += d_logits @ w_tile^T; the tile's weight gradient is hidden^T @ d_logits (or its transpose).
        d_hidden += product(d_logits, w_tile, transpose_b=not transposed)
        if transposed:
            d_tile = product(d_logits, hidden_NE, transpose_a=True)
        else:
            d_tile = product(hidden_NE, d_logits, transpose_a=True)
        before = lax.dynamic_slice_in_dim(d_weight, start, width, axis=axis)
        d_weight = lax.dynamic_update_slice_in_dim(d_weight, before + d_tile, start, axis=axis)
        return (d_hidden, d_weight), None

    start = (jnp.zeros(hidden_NE.shape, jnp.float32), jnp.zeros(weight.shape, jnp.float32))
    (d_hidden, d_weight), _ = lax.scan(body, start, jnp.arange(count))
    return d_hidden.astype(hidden_NE.dtype), d_weight.astype(weight.dtype), None


chunked_cross_entropy.defvjp(_forward, _backward)
