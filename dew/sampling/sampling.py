"""`Sampling`: the decoding policy, and the logits filters it applies in transformers' order."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits.

    In transformers' order: `repetition_penalty` first divides the positive logits (multiplies the
    negative ones) of every token already in the row, prompt included; then `temperature` 0 takes
    the argmax, otherwise the logits are divided by it, `top_k` keeps the k largest, `top_p` the
    smallest set whose probability reaches p, and `min_p` drops tokens below `min_p` times the top
    probability. A row stops after emitting one of `eos_token_ids`; its later slots hold `pad_id`.
    """

    temperature: float = 1.0
    """Divides the logits; 0 takes the most likely token (greedy)."""
    top_k: int | None = None
    """Keep the k most likely tokens; None keeps all."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probability reaches p, in (0, 1]; None keeps all."""
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
        logits_BV = logits_BV.astype(jnp.float32)
        if self.repetition_penalty is not None:
            if seen_BV is None:
                raise ValueError("repetition_penalty needs the tokens each row has seen")
            penalised = jnp.where(logits_BV < 0, logits_BV * self.repetition_penalty, logits_BV / self.repetition_penalty)
            logits_BV = jnp.where(seen_BV, penalised, logits_BV)
        if self.greedy:
            return logits_BV
        logits_BV = logits_BV / self.temperature
        if self.top_k is not None and self.top_k < logits_BV.shape[-1]:
            kth = jax.lax.top_k(logits_BV, self.top_k)[0][:, -1:]
            logits_BV = jnp.where(logits_BV < kth, _NEG, logits_BV)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
            probs = jax.nn.softmax(sorted_BV, axis=-1)
            # keep a token while the mass before it is below p (the top token always stays)
            before = jnp.cumsum(probs, axis=-1) - probs
            cutoff = jnp.min(jnp.where(before < self.top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
            logits_BV = jnp.where(logits_BV < cutoff, _NEG, logits_BV)
        if self.min_p is not None and self.min_p > 0.0:
            probs = jax.nn.softmax(logits_BV, axis=-1)
            floor = self.min_p * jnp.max(probs, axis=-1, keepdims=True)
            logits_BV = jnp.where(probs < floor, _NEG, logits_BV)
        return logits_BV

    def draw(self, keys_B: jax.Array, logits_BV: jax.Array, seen_BV: jax.Array | None = None):
        """(token ids `[B]` int32, their log-probabilities under the filtered distribution `[B]`)."""
        filtered = self.filter(logits_BV, seen_BV)
        if self.greedy:
            tokens = jnp.argmax(filtered, axis=-1).astype(jnp.int32)
        else:
            tokens = jax.vmap(jax.random.categorical)(keys_B, filtered).astype(jnp.int32)
        log_probs = jax.nn.log_softmax(filtered, axis=-1)
        return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
