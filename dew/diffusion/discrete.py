"""Discrete masked diffusion: MDLM (Sahoo et al. 2024, arXiv 2406.07524).

The forward process replaces each clean token by a mask id independently, with a probability that
grows with the time `t` in [0, 1]; a bidirectional decoder learns to predict the clean tokens at the
masked positions. `MDLM(mask_id=...)()` returns the `DiscreteProcess` the objective trains with and
`generate` samples from: the log-linear schedule, antithetic times, the NELBO weight, and the
`Unmask` sampler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dew.data.inputs import ModelInputs, text_fields
from dew.diffusion.unmask import Unmask, check_steps, compiled_refinement
from dew.diffusion.canvas import CanvasGeneration, assemble
from dew.sampling.generate import PROMPT_BUCKET, _check_prompts


@dataclasses.dataclass(frozen=True)
class LogLinear:
    """MDLM's log-linear schedule: a token is still clean at time `t` with probability
    `alpha(t) = 1 - (1 - eps) t`, so at `t = 1` a fraction `eps` stays clean.

    Training draws times in `[eps, 1]`: the NELBO weight `1 / t` grows without bound as `t` falls
    while the chance of any masked token falls with it, so times below `eps` would give the
    estimate an unbounded variance for a part of the bound worth about `eps` nats a token (MDLM's
    `sampling_eps` does the same).
    """

    eps: float = 1e-3

    def __post_init__(self):
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"LogLinear eps is {self.eps}; it must lie in (0, 1) (MDLM uses 1e-3)")

    def mask_probability(self, t: jax.Array) -> jax.Array:
        """`1 - alpha(t)`: the chance a token is masked at time `t`."""
        return (1.0 - self.eps) * t

    def weight(self, t: jax.Array) -> jax.Array:
        """The NELBO weight of a masked token's cross entropy, `-alpha'(t) / (1 - alpha(t)) = 1 / t`
        (0 at `t = 0`, where nothing is masked)."""
        return jnp.where(t > 0, 1.0 / jnp.where(t > 0, t, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class DiscreteProcess:
    """A masked-diffusion process: the `mask_id` corruption writes, its `schedule`, and the `sampler`
    `generate` runs (`Unmask()`, 64 model evaluations, unless a call asks for other `steps`).

    `logits_shift` 1 predicts each position from the decoder's state one position before it (Dream,
    which kept the next-token alignment of the autoregressive model it started from); a document's
    first position reads its own state. 0 (MDLM, LLaDA) predicts each position from its own state.
    """

    mask_id: int
    schedule: LogLinear = LogLinear()
    sampler: Unmask = Unmask()
    logits_shift: int = 0

    def __post_init__(self):
        if isinstance(self.mask_id, bool) or not isinstance(self.mask_id, (int, np.integer)) or self.mask_id < 0:
            raise ValueError(f"mask_id is {self.mask_id!r}; it is a token id, a whole number of at least 0")
        object.__setattr__(self, "mask_id", int(self.mask_id))
        if self.logits_shift not in (0, 1):
            raise ValueError(f"logits_shift is {self.logits_shift!r}; a position reads its own state (0) or the one "
                             "before it (1)")

    def predicting_states(self, hidden_BSE: jax.Array, segments_BS: jax.Array | None = None) -> jax.Array:
        """The decoder state `[B, S, E]` that predicts each position: its own, or with `logits_shift` the
        one before it in the same document (`segments_BS`; None: one document a row)."""
        if self.logits_shift == 0:
            return hidden_BSE
        before_BSE = jnp.concatenate([hidden_BSE[:, :1], hidden_BSE[:, :-1]], axis=1)
        if segments_BS is None:
            return before_BSE
        continues_BS = jnp.concatenate([jnp.zeros_like(segments_BS[:, :1], dtype=bool),
                                        segments_BS[:, 1:] == segments_BS[:, :-1]], axis=1)
        return jnp.where(continues_BS[..., None], before_BSE, hidden_BSE)

    def check_model(self, model) -> None:
        """Refuse a decoder this process cannot train or sample: a causal one, or one whose vocabulary
        has no slot for the mask id."""
        config = model.config
        if config.causal:
            raise ValueError(
                "the model is causal (causal=True): masked diffusion predicts every masked position from both "
                "sides, so it needs a bidirectional decoder; build it with causal=False, e.g. "
                "models.build('causal_transformer', ..., causal=False)"
            )
        if self.mask_id >= config.vocab_size:
            raise ValueError(
                f"mask_id {self.mask_id} is outside the model's vocab_size {config.vocab_size}: the mask needs an id "
                f"of its own inside the vocabulary; build the model with vocab_size={self.mask_id + 1} (the mask "
                "takes the id after the tokenizer's last)"
            )

    # -- training --------------------------------------------------------------------------------
    def sample_times(self, key: jax.Array, rows: int) -> jax.Array:
        """Antithetic times, float32 `[rows]`: `eps + (1 - eps) (i + u) / rows` for one uniform `u`,
        so the rows of a batch cover `[eps, 1]` evenly and the estimate's variance falls."""
        u = jax.random.uniform(key, ())
        eps = self.schedule.eps
        return eps + (1.0 - eps) * (jnp.arange(rows, dtype=jnp.float32) + u) / rows

    def corrupt(self, key: jax.Array, tokens_BS: jax.Array, real_BS: jax.Array, t_B: jax.Array):
        """(noisy tokens `[B, S]`, which positions were masked `[B, S]` bool): each real position of row
        `b` is replaced by the mask id with probability `mask_probability(t_B[b])`; padding
        (`real_BS` false) never is."""
        chance_B1 = self.schedule.mask_probability(t_B)[:, None]
        masked_BS = (jax.random.uniform(key, tokens_BS.shape) < chance_B1) & real_BS
        return jnp.where(masked_BS, self.mask_id, tokens_BS), masked_BS

    def weight(self, t_B: jax.Array) -> jax.Array:
        """The NELBO weight of each row's masked cross entropies."""
        return self.schedule.weight(t_B)

    # -- sampling --------------------------------------------------------------------------------
    def generate(self, model, variables, prompts, max_new_tokens: int, *, key: jax.Array, steps: int | None = None,
                 n: int = 1, eos_token_ids: Sequence[int] = (), pad_id: int = 0, decode=None) -> CanvasGeneration:
        """Write `max_new_tokens` tokens after each prompt, `n` times each, by unmasking them together.

        `prompts` are lists of token ids (or a `ModelInputs` whose `attention_mask` marks real
        tokens). Each row is the prompt, left-padded to a bucketed width, then `max_new_tokens` mask
        ids that the sampler refines over `steps` model evaluations (default: the sampler's 64, the
        last the clean prediction). Prompts stay as given, a literal mask id included. Continuation
        `j` of prompt `i` draws from `fold_in(fold_in(key, i), j)`, so asking for more continuations
        leaves the first ones unchanged. EOS (`eos_token_ids`) is applied after refinement; zero new
        tokens returns the prompts with no model evaluation.
        """
        self.check_model(model)
        steps = self.sampler.steps if steps is None else check_steps(steps)
        if isinstance(prompts, ModelInputs):
            text_fields(prompts.kwargs(), "masked generation")  # text decoders: media are refused by name
            prompts = prompts.valid_rows()
        rows = _check_prompts(prompts, model.config.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens is {max_new_tokens!r}; ask for a whole number of tokens, 0 or more")
        if n < 1:
            raise ValueError(f"n is {n}; ask for at least one continuation per prompt")
        longest = max(len(row) for row in rows)
        if longest + max_new_tokens > model.config.max_seq_len:
            raise ValueError(
                f"the longest prompt ({longest} tokens) plus max_new_tokens {max_new_tokens} is "
                f"{longest + max_new_tokens}, beyond the model's max_seq_len {model.config.max_seq_len}: "
                "shorten the prompt or ask for fewer tokens"
            )
        prompt_ids = np.repeat(np.arange(len(rows)), n)
        grouped = [rows[index] for index in prompt_ids]
        if max_new_tokens == 0:
            return assemble(grouped, np.zeros((len(grouped), 0), np.int32), 0, eos_token_ids, pad_id, decode)
        width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
        canvas = np.full((len(grouped), width + max_new_tokens), self.mask_id, np.int32)
        valid = np.ones(canvas.shape, np.int32)
        for r, row in enumerate(grouped):
            canvas[r, : width - len(row)] = 0
            valid[r, : width - len(row)] = 0
            canvas[r, width - len(row): width] = row
        continuation_ids = np.tile(np.arange(n), len(rows))
        row_keys = jax.vmap(lambda p, c: jax.random.fold_in(jax.random.fold_in(key, p), c))(
            jnp.asarray(prompt_ids), jnp.asarray(continuation_ids))
        run = compiled_refinement(model, self.schedule, self.mask_id, steps, width, self.logits_shift)
        responses = np.asarray(jax.device_get(run(variables, canvas, valid, row_keys)))
        return assemble(grouped, responses, steps, eos_token_ids, pad_id, decode)


@dataclasses.dataclass(frozen=True)
class MDLM:
    """MDLM's settings; calling it returns the `DiscreteProcess`: `MDLM(mask_id=50257)()`.

    `mask_id` is the id the corruption writes (it must lie inside the model's vocabulary and be one
    the tokenizer never writes), `eps` the log-linear schedule's floor, `steps` the model
    evaluations `generate` makes by default.
    """

    mask_id: int
    eps: float = 1e-3
    steps: int = 64

    def __call__(self) -> DiscreteProcess:
        return DiscreteProcess(self.mask_id, LogLinear(self.eps), Unmask(self.steps))
