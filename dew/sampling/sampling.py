"""`Sampling`: the decoding policy, and the logits filters it applies in transformers' order."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits.

    In transformers' order: `repetition_penalty` first divides the positive logits (multiplies the
    negative ones) of every token already in the row, prompt included; then `temperature` 0 takes
    the argmax, otherwise the logits are divided by it, `top_k` keeps the k largest, `top_p` the
    smallest set whose probability reaches p (at least the most likely token), and `min_p` drops tokens below `min_p` times the top
    probability. A row stops after emitting one of `eos_token_ids`; its later slots hold `pad_id`.

    Compiled decoding reads the values as per-row arrays (`SamplingParams`), so a new temperature,
    top-p or penalty reuses the executable.
    """

    temperature: float = 1.0
    """Divides the logits; 0 takes the most likely token (greedy)."""
    top_k: int | None = None
    """Keep the k most likely tokens; None keeps all."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches p (at least the top one), in (0, 1]; None keeps all."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]; None drops none."""
    repetition_penalty: float | None = None
    """Penalise tokens already in the row (1 is neutral, above 1 discourages repeats); None applies none."""
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end a row; none: every row runs to the budget."""
    pad_id: int = 0
    """The id written after a row has ended."""

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} is {value}; it must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature is {self.temperature}; use 0 for greedy or a positive value")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k is {self.top_k}; use None to keep every token or a count >= 1")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p is {self.top_p}; it must lie in (0, 1]")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p is {self.min_p}; it must lie in [0, 1]")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty is {self.repetition_penalty}; use None, or a value > 0 (1 is neutral)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filter(self, logits_BV: jax.Array, seen_BV: jax.Array | None = None) -> jax.Array:
        """float32 logits, penalised, tempered, with filtered-out tokens at -inf.

        `seen_BV` marks the tokens each row already holds (needed with `repetition_penalty`).
        """
        return filter_logits(SamplingParams.of([self] * logits_BV.shape[0]), logits_BV, seen_BV)

    def draw(self, keys_B: jax.Array, logits_BV: jax.Array, seen_BV: jax.Array | None = None):
        """(token ids `[B]` int32, their log-probabilities under the filtered distribution `[B]`)."""
        return draw(SamplingParams.of([self] * logits_BV.shape[0]), keys_B, logits_BV, seen_BV)


SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds `jax.random.key` takes: a signed 64-bit integer."""


def check_seed(seed: int, name: str = "seed") -> int:
    """`seed` when `jax.random.key(seed)` takes it; else a ValueError naming `name`, the value and the range."""
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ValueError(f"{name} is {seed!r}; a seed is an integer from -2**63 to 2**63 - 1 "
                         f"({low} to {high}), the 64-bit range of a JAX key: use a smaller one")
    return seed


def _bucket(count: int) -> int:
    """The next power of two: how many candidates `lax.top_k` computes for a largest `top_k` of `count`."""
    return 1 << max(count - 1, 0).bit_length()


@struct.dataclass
class SamplingParams:
    """One row's `Sampling` values per row, as arrays `[B]`, for compiled decoding.

    Off values: `top_k` 0, `top_p` 1, `min_p` 0, `repetition_penalty` 1. The static part says
    which filters any row uses (`top_k_bound`, the power of two at or above the largest `top_k`, 0
    when no row filters by rank), so values change without a recompile; switching a filter on
    for the first time compiles once more.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    top_k_bound: int = struct.field(pytree_node=False, default=0)
    use_top_p: bool = struct.field(pytree_node=False, default=False)
    use_min_p: bool = struct.field(pytree_node=False, default=False)
    use_penalty: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def of(cls, rows: Sequence[Sampling]) -> "SamplingParams":
        """The arrays of one `Sampling` per row (host numpy, placed by the compiled call)."""
        column = lambda values, dtype: np.asarray(values, dtype)
        top_k = column([s.top_k or 0 for s in rows], np.int32)
        top_p = column([1.0 if s.top_p is None else s.top_p for s in rows], np.float32)
        min_p = column([s.min_p or 0.0 for s in rows], np.float32)
        penalty = column([1.0 if s.repetition_penalty is None else s.repetition_penalty for s in rows], np.float32)
        # Flags follow the values whatever the temperature, so a switch to greedy does not recompile.
        return cls(
            temperature=column([s.temperature for s in rows], np.float32), top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=penalty, top_k_bound=_bucket(int(top_k.max())) if (top_k > 0).any() else 0,
            use_top_p=bool((top_p < 1.0).any()), use_min_p=bool((min_p > 0.0).any()),
            use_penalty=any(s.repetition_penalty is not None for s in rows),
        )


def penalise(params: SamplingParams, logits_BV: jax.Array, seen_BV: jax.Array | None = None) -> jax.Array:
    """float32 logits with each row's repetition penalty applied to the tokens it has seen (what a greedy
    row chooses from)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if not params.use_penalty:
        return logits_BV
    if seen_BV is None:
        raise ValueError("repetition_penalty needs the tokens each row has seen")
    penalty = jnp.asarray(params.repetition_penalty)[:, None]
    penalised = jnp.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return jnp.where(seen_BV, penalised, logits_BV)


def filter_logits(params: SamplingParams, logits_BV: jax.Array, seen_BV: jax.Array | None = None) -> jax.Array:
    """float32 logits with each row's policy applied (see `Sampling`); greedy rows are only penalised."""
    logits_BV = penalise(params, logits_BV, seen_BV)
    column = lambda values: jnp.asarray(values)[:, None]
    greedy = column(params.temperature) == 0.0
    sampled_BV = logits_BV / jnp.where(greedy, 1.0, column(params.temperature))
    vocab = logits_BV.shape[-1]
    if params.top_k_bound:
        top_BK = jax.lax.top_k(sampled_BV, min(params.top_k_bound, vocab))[0]
        k = jnp.clip(jnp.asarray(params.top_k), 1, top_BK.shape[1])
        kth = jnp.take_along_axis(top_BK, (k - 1)[:, None], axis=1)
        by_rank = (column(params.top_k) > 0) & (column(params.top_k) < vocab)
        sampled_BV = jnp.where(by_rank & (sampled_BV < kth), _NEG, sampled_BV)
    if params.use_top_p:
        sorted_BV = jnp.sort(sampled_BV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep a token while the mass before it is below p, and the most likely one whatever p is, as
        # transformers (min_tokens_to_keep=1) and vLLM do: a p below float32's normal range reads as 0
        # on a CPU that flushes denormals, and would otherwise keep nothing.
        before = jnp.cumsum(probs, axis=-1) - probs
        top_p = column(params.top_p)
        kept = (before < top_p) | (jnp.arange(vocab) == 0)
        cutoff = jnp.min(jnp.where(kept, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        sampled_BV = jnp.where((top_p < 1.0) & (sampled_BV < cutoff), _NEG, sampled_BV)
    if params.use_min_p:
        probs = jax.nn.softmax(sampled_BV, axis=-1)
        floor = column(params.min_p) * jnp.max(probs, axis=-1, keepdims=True)
        sampled_BV = jnp.where(probs < floor, _NEG, sampled_BV)
    return jnp.where(greedy, logits_BV, sampled_BV)


def draw(params: SamplingParams, keys_B: jax.Array, logits_BV: jax.Array, seen_BV: jax.Array | None = None):
    """(token ids `[B]` int32, their log-probabilities under each row's filtered distribution `[B]`).

    A greedy row (temperature 0) takes the first maximum; the others draw from their filtered logits.
    """
    filtered = filter_logits(params, logits_BV, seen_BV)
    greedy_B = jnp.asarray(params.temperature) == 0.0
    # The draws (a random number per token of the vocabulary) only where a row samples: at batch 1 on a
    # CPU they cost more than the rest of the sampling together.
    drawn = jax.lax.cond(jnp.all(greedy_B), lambda: jnp.zeros(keys_B.shape, jnp.int32),
                         lambda: categorical(keys_B, filtered))
    # A greedy row's filtered logits are its penalised ones: its maximum is taken there, so a step whose
    # log-probabilities go unused never lays the filtered logits out.
    tokens = jnp.where(greedy_B, first_maximum(penalise(params, logits_BV, seen_BV)), drawn)
    log_probs = jax.nn.log_softmax(filtered, axis=-1)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def categorical(keys_B: jax.Array, logits_BV: jax.Array) -> jax.Array:
    """int32 `[B]`: what `jax.vmap(jax.random.categorical)(keys_B, logits_BV)` draws (the same Gumbel noise
    from the same keys, the first maximum of noise plus logits), with the noise laid out as an array first:
    inside argmax's paired reduction XLA's CPU backend computes the noise's two logarithms an element at a
    time, three times slower than as an elementwise array."""
    noise_BV = jax.vmap(lambda key: jax.random.gumbel(key, logits_BV.shape[1:], logits_BV.dtype))(keys_B)
    return first_maximum(logits_BV + noise_BV)


def first_maximum(x_BV: jax.Array) -> jax.Array:
    """`jnp.argmax(x_BV, axis=-1)` as int32 `[B]` (the first maximum; the first NaN where a row holds one),
    from plain reductions: XLA's CPU backend runs argmax's paired reduction an element at a time."""
    B, V = x_BV.shape

    def with_nans():
        # A reduction's maximum need not propagate a NaN (XLA's CPU backend may hand it to a library whose
        # maximum skips them), so a row holding one is marked by its own reduction.
        nan_BV = jnp.isnan(x_BV)
        top_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
        return _first_hit(jnp.where(jnp.any(nan_BV, axis=-1, keepdims=True), nan_BV, x_BV == top_B1))

    def without_nans():
        if V % _BLOCK:
            return _first_hit(x_BV == jnp.max(x_BV, axis=-1, keepdims=True))
        # In blocks of the vocabulary: the first block whose maximum is the row's, then the first maximum
        # inside that block alone (the flat form lays out an index per entry).
        x_BNW = x_BV.reshape(B, V // _BLOCK, _BLOCK)
        tops_BN = jnp.max(x_BNW, axis=-1)
        top_B1 = jnp.max(tops_BN, axis=-1, keepdims=True)
        block_B = _first_hit(tops_BN == top_B1)
        inside_BW = jnp.take_along_axis(x_BNW, block_B[:, None, None], axis=1)[:, 0]
        return block_B * _BLOCK + _first_hit(inside_BW == top_B1)

    # A sum holds a NaN where an entry does (or where infinities of both signs meet: the exact branch too).
    return jax.lax.cond(jnp.isnan(jnp.sum(x_BV)), with_nans, without_nans)


_BLOCK = 128  # vocabulary entries per block of `first_maximum`


def _first_hit(hit_BV: jax.Array) -> jax.Array:
    """int32 `[B]`: the first index of each row where `hit_BV` holds (the row's length where none does)."""
    return jnp.min(jnp.where(hit_BV, jnp.arange(hit_BV.shape[-1], dtype=jnp.int32), hit_BV.shape[-1]), axis=-1)
