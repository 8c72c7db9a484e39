"""The output head as an object: what turns final hidden states into capped float32 logits, and the
cross entropy over the vocabulary in tiles that the objectives ask it for.

A model hands its head to objectives and to generation inside its output (`ModelOutput.head`), so
nothing outside the model reads parameter paths or knows whether the head is a tied embedding. The head
owns its products: it runs them under its model's kernel policy (`dew.kernels.policy`).

`chunked_cross_entropy` never holds the `[N, V]` logits: the forward pass scans the vocabulary's tiles
keeping a running float32 log-sum-exp; the backward pass scans them again, recomputing each tile's logits
and turning them into that tile's gradient at once. The scans (not an unrolled loop) make the tiles run
one after another: XLA would otherwise compute the independent tile products side by side and hold every
tile at once. Under bf16 compute both products take bf16 operands and accumulate in float32, forward and
backward, as torch autocast runs the head. Tiles are `ceil(V / chunks)` wide; the last one starts early
enough to end at `V`, and the columns it shares with the tile before are masked out of it. `chunks=None`
picks the count from the rows at trace time: the fewest tiles whose float32 logits stay within
`TILE_BYTES` each. A single tile keeps its logits from the forward pass for the backward instead of
making them again: three head products instead of four, for the `[N, V]` buffer the forward pass held
anyway. A `temperature` other than 1 divides the capped logits before the softmax, as a sampler tempers
them; at 1 the tiles are not divided at all.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from dew.kernels import head_rows, softmax
from dew.kernels.blocks import blocks_product
from dew.kernels.int8 import dequantize, int8_product, kernel_takes
from dew.kernels.matmul import dot, product
from dew.kernels.policy import using


def vocab_logits(hidden_NE: jax.Array, weight: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` from hidden states and the head (`[E, V]`, or `[V, E]` when tied) of one
    dtype: a few rows in Dew's head kernel where the kernel policy in force lets it run
    (`dew.kernels.head_rows`), else XLA's dot."""
    if head_rows.takes(hidden_NE, weight, transposed):
        return head_rows.head_logits(hidden_NE, weight, transposed)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    return jax.lax.dot_general(hidden_NE, weight, (contract, ((), ())), preferred_element_type=jnp.float32)


# Vocabulary rows per piece of an int8 head: the piece's float copy (4,096 x width x 4 bytes) stays in cache
# between its conversion and its product; converted whole, XLA's CPU backend writes the float head to memory
# and reads it back.
_INT8_HEAD_ROWS = 4096


def _int8_vocab_logits(hidden_NE: jax.Array, q: jax.Array, scale: jax.Array, transposed: bool) -> jax.Array:
    """float32 logits `[N, V]` of an int8 head (`[E, V]` with scales `[G, V]`, or `[V, E]` and `[V, G]`
    when `transposed`), converted to float32 and multiplied piece by piece along the vocabulary (the
    fewest equal pieces of at most `_INT8_HEAD_ROWS`; one piece when the vocabulary does not split
    evenly into small ones), or whole in Dew's int8 kernel where it runs (`dew.kernels.int8`)."""
    if kernel_takes(hidden_NE, q, hidden_NE.dtype):
        # Dew's kernel widens the int8 rows in registers: no float copy, so no pieces either.
        return int8_product(hidden_NE, q, scale, hidden_NE.dtype, transposed)
    V = q.shape[0] if transposed else q.shape[1]
    pieces = next((p for p in range(-(-V // _INT8_HEAD_ROWS), V + 1) if V % p == 0 and V // p >= 256), 1)
    rows = V // pieces
    axis = 0 if transposed else 1

    # The kernel's operands: hidden states rounded to the compute dtype, weights q * scale in float32.
    hidden_NE = hidden_NE.astype(jnp.float32)

    def piece(i):
        part = jax.lax.dynamic_slice_in_dim(q, i * rows, rows, axis)
        part_scale = jax.lax.dynamic_slice_in_dim(scale, i * rows, rows, axis)
        return vocab_logits(hidden_NE, dequantize(part, part_scale, axis=1 - axis), transposed)

    logits_PNR = jax.lax.map(piece, jnp.arange(pieces))
    return jnp.moveaxis(logits_PNR, 0, 1).reshape(hidden_NE.shape[0], V)


def cap_logits(logits: jax.Array, softcap: float | None) -> jax.Array:
    """`softcap * tanh(logits / softcap)` (Gemma 2's final cap), or the logits unchanged."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


@struct.dataclass
class Head:
    """The output projection: `weight` in the compute dtype, `[E, V]`, or `[V, E]` when `transposed`
    (a tied embedding), the logit `softcap`, the `logit_divisor` the capped logits are divided by
    (Granite's `logits_scaling`), and the model's kernel policy `kernels`. Gradients flow into
    the parameter it was read from.

    With a GGUF file's blocks (`dew.interop.gguf_blocks`) `weight` is those bytes, `[V, E / n, B]` uint8
    for blocks of n values (always `transposed`), multiplied in Dew's blocks kernel (`dew.kernels.blocks`).
    With int8 weights (`dew.nn.quantize`) `weight` stays int8 and `scale` holds its float32 scales per
    vocabulary entry and group of the width (`[V, G]`, or `[G, V]` untied); `logits` converts inside its
    product. Such a head is for generation: objectives
    that read `weight` directly refuse int8 variables before they get here."""

    weight: jax.Array
    transposed: bool = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False, default=None)
    scale: jax.Array | None = None
    kernels: str = struct.field(pytree_node=False, default="auto")
    logit_divisor: float = struct.field(pytree_node=False, default=1.0)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0] if self.transposed else self.weight.shape[1]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Capped float32 logits `[..., V]` of hidden states `[..., E]` (`head_logits` in the reference)."""
        lead = hidden.shape[:-1]
        hidden_NE = hidden.reshape(-1, hidden.shape[-1])
        if self.weight.dtype == jnp.uint8:
            with using(self.kernels):
                logits_NV = blocks_product(hidden_NE, self.weight, hidden_NE.dtype)
        elif self.weight.dtype == jnp.bfloat16:  # through the kernel policy: XLA's CPU dot widens the head
            with using(self.kernels):
                hidden_NE = hidden_NE.astype(jnp.bfloat16)
                if head_rows.takes(hidden_NE, self.weight, self.transposed):  # a decode step's few rows
                    logits_NV = head_rows.head_logits(hidden_NE, self.weight, self.transposed)
                else:
                    logits_NV = dot(hidden_NE, self.weight, transpose_b=self.transposed)
        elif self.scale is None:
            with using(self.kernels):
                logits_NV = vocab_logits(hidden_NE.astype(self.weight.dtype), self.weight, self.transposed)
        else:
            with using(self.kernels):
                logits_NV = _int8_vocab_logits(hidden_NE, self.weight, self.scale, self.transposed)
        capped_NV = cap_logits(logits_NV, self.softcap)
        if self.logit_divisor != 1.0:
            capped_NV = capped_NV / self.logit_divisor
        return capped_NV.reshape(*lead, self.vocab_size)

    def cross_entropy(self, hidden_NE: jax.Array, targets_N: jax.Array, chunks: int | None = None,
                      accuracy: bool = True, temperature: float = 1.0):
        """Per-target `(ce, lse, correct)`, float32 `[N]` each, of hidden states `[N, E]` in the compute dtype
        against int32 targets `[N]`, over the vocabulary in tiles (`chunked_cross_entropy`; `correct` None
        without `accuracy`). Float weights only: an int8 head is for generation. The logit divisor
        divides the capped logits as `temperature` does, so the two multiply."""
        if self.scale is not None or self.weight.dtype == jnp.uint8:
            raise ValueError("cross_entropy reads float head weights, and this head is int8 or a GGUF file's blocks "
                             "(quantized for generation): score the float weights")
        return chunked_cross_entropy(hidden_NE, self.weight, targets_N, self.transposed, chunks, self.softcap,
                                     accuracy, temperature * self.logit_divisor, self.kernels)

    def without_column(self, column: int) -> "Head":
        """This head without vocabulary entry `column` (a column no target may be, such as a mask id)."""
        axis = 0 if self.transposed else 1
        before = lax.slice_in_dim(self.weight, 0, column, axis=axis)
        after = lax.slice_in_dim(self.weight, column + 1, self.vocab_size, axis=axis)
        return self.replace(weight=jnp.concatenate([before, after], axis=axis), scale=None)


# `chunks=None`: the fewest tiles whose float32 logits take at most this many bytes each (a 16 x 128
# micro-batch against a 4,096-id vocabulary is one tile; GPT-2's 50,257 ids over 1,024 rows are four). An
# accelerator takes wider tiles (`ACCELERATOR_TILE_BYTES`), each a whole number of its matrix unit's 128 lanes:
# a tile's product there costs little beside the scan's step, and a width off the lanes pads every product.
TILE_BYTES = 64 * 2**20
ACCELERATOR_TILE_BYTES = 512 * 2**20
LANES = 128


def tile_bytes() -> int:
    """The most bytes a tile's float32 logits take under `chunks=None` on this process's backend."""
    return TILE_BYTES if jax.default_backend() == "cpu" else ACCELERATOR_TILE_BYTES


def _layout(vocab: int, chunks: int | None, rows: int) -> tuple[int, int]:
    """(tile width, tile count)."""
    accelerator = jax.default_backend() != "cpu"
    if chunks is None:
        chunks = -(-rows * vocab * 4 // tile_bytes())
    chunks = max(1, min(chunks, vocab))
    width = -(-vocab // chunks)
    if accelerator and width < vocab:
        width = min(vocab, -(-width // LANES) * LANES)
    return width, -(-vocab // width)


def _tile(hidden_NE, weight, index, width, transposed, softcap, policy):
    """The tile's first column, its capped float32 logits `[N, width]` (shared columns at -inf), and the mask."""
    vocab = weight.shape[0] if transposed else weight.shape[1]
    start = jnp.minimum(index * width, vocab - width)
    if transposed:
        w_tile = lax.dynamic_slice_in_dim(weight, start, width, axis=0)
    else:
        w_tile = lax.dynamic_slice_in_dim(weight, start, width, axis=1)
    logits_NC = product(hidden_NE, w_tile, transpose_b=transposed, policy=policy)
    if softcap is not None:
        logits_NC = softcap * jnp.tanh(logits_NC / softcap)
    fresh_C = start + jnp.arange(width) >= index * width
    return start, w_tile, jnp.where(fresh_C[None, :], logits_NC, -jnp.inf), fresh_C


def _tempered(capped_NC, temperature: float):
    return capped_NC if temperature == 1.0 else capped_NC / temperature


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def chunked_cross_entropy(hidden_NE, weight, targets_N, transposed: bool, chunks: int, softcap: float | None,
                          accuracy: bool = True, temperature: float = 1.0, policy: str = "auto"):
    """Per-token `(ce, lse, correct)`, float32 `[N]` each.

    `weight` is the head, `[E, V]` (or `[V, E]` with `transposed`, a tied embedding); `hidden_NE` is in
    the compute dtype and `weight` already cast to it. `chunks` is the tile count, or None to pick it
    from the rows (see the module docstring). `ce = lse - logit[target]`; `correct` is 1.0
    where the argmax (first maximum) is the target. Gradients flow through `ce` and `lse`. With
    `accuracy` False (a static flag) `correct` is None and the scan takes no argmax over the tiles.
    `temperature` (a static Python float above 0) divides the capped logits first. `policy` is the kernel
    policy of the head's products (`dew.kernels.policy`).
    """
    return _forward(hidden_NE, weight, targets_N, transposed, chunks, softcap, accuracy, temperature, policy)[0]


def _forward(hidden_NE, weight, targets_N, transposed, chunks, softcap, accuracy, temperature, policy):
    N = hidden_NE.shape[0]
    width, count = _layout(weight.shape[0] if transposed else weight.shape[1], chunks, N)

    def body(carry, index):
        running_max, running_sum, target_logit, best = carry
        start, _, capped_NC, _ = _tile(hidden_NE, weight, index, width, transposed, softcap, policy)
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
            # The first column holding the tile's maximum, as `argmax` picks it, read in one pass a row
            # (`dew.kernels.softmax.first_max`: XLA's argmax reduction runs as a scalar loop on the CPU).
            first = softmax.first_max(logits_NC, policy)
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


def _backward(transposed, chunks, softcap, accuracy, temperature, policy, residuals, cotangents):
    hidden_NE, weight, targets_N, lse, kept = residuals
    g_ce, g_lse, _ = cotangents
    g_total = (g_ce + g_lse)[:, None]
    width, count = _layout(weight.shape[0] if transposed else weight.shape[1], chunks, hidden_NE.shape[0])
    axis = 0 if transposed else 1

    def body(carry, index):
        d_hidden, d_weight = carry
        if kept is None:
            start, w_tile, capped_NC, fresh_C = _tile(hidden_NE, weight, index, width, transposed, softcap, policy)
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
        d_hidden += product(d_logits, w_tile, transpose_b=not transposed, policy=policy)
        if transposed:
            d_tile = product(d_logits, hidden_NE, transpose_a=True, policy=policy)
        else:
            d_tile = product(hidden_NE, d_logits, transpose_a=True, policy=policy)
        before = lax.dynamic_slice_in_dim(d_weight, start, width, axis=axis)
        d_weight = lax.dynamic_update_slice_in_dim(d_weight, before + d_tile, start, axis=axis)
        return (d_hidden, d_weight), None

    start = (jnp.zeros(hidden_NE.shape, jnp.float32), jnp.zeros(weight.shape, jnp.float32))
    (d_hidden, d_weight), _ = lax.scan(body, start, jnp.arange(count))
    return d_hidden.astype(hidden_NE.dtype), d_weight.astype(weight.dtype), None


chunked_cross_entropy.defvjp(_forward, _backward)
