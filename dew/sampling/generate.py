"""Cached generation: host-side preparation, then prefill and a `lax.scan` decode in one compiled call.

Prompts are validated and left-padded on the host to a bucketed width, so prompts whose valid lengths
differ but pad to the same width reuse the executable. The dense cache holds the bucket plus the new
tokens, never the model's maximum; padded slots carry segment 0 and take no attention.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from dew.nn.transformer import project
from dew.sampling.sampling import Sampling

PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Generation:
    """Prompts and their continuations.

    `tokens` is int32 `[rows, prompt_width + max_new_tokens]`: each row's prompt, then its new tokens,
    then `pad_id`; `lengths` counts a row's prompt plus new tokens up to and including its EOS;
    `new_tokens` counts the generated ones, `terminated` says whether the row emitted EOS, and
    `log_probs` `[rows, max_new_tokens]` holds each new token's log-probability under the sampler.
    Rows are grouped by prompt: row `i * n + j` is continuation `j` of prompt `i`.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    new_tokens: np.ndarray
    terminated: np.ndarray
    log_probs: np.ndarray
    decode: object = None

    def host(self) -> "Generation":
        return self

    @property
    def text(self) -> list[str]:
        if self.decode is None:
            raise ValueError("this generation has no tokenizer bound; decode the ids in .tokens yourself")
        return [self.decode(list(row[: length])) for row, length in zip(self.tokens, self.lengths)]

    def continuations(self) -> list[list[int]]:
        """The new token ids of each row, without the prompt and without padding."""
        return [list(row[length - count: length]) for row, length, count in zip(self.tokens, self.lengths, self.new_tokens)]


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of Python ints, refused unless each is a non-empty row of integer ids
    inside the vocabulary (a float id is refused, never truncated)."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    if len(prompts) == 0:
        raise ValueError("no prompts were given; pass a list of token-id lists")
    rows = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, (np.ndarray, jax.Array)):
            prompt = np.asarray(prompt).tolist()
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"prompt {index} is {prompt!r}, not a row of token ids: pass a list of token-id lists "
                             "(a text prompt needs a tokenizer, as TextGeneration has)")
        row = list(prompt)
        if not row:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token id")
        wrong = [t for t in row if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if wrong:
            raise ValueError(f"prompt {index} holds {wrong[0]!r} ({type(wrong[0]).__name__}); token ids are integers: "
                             "pass int ids (an id is never rounded)")
        row = [int(t) for t in row]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} holds token id {bad[0]}, outside the model's vocab_size {vocab_size}")
        rows.append(row)
    return rows


def generate(model, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, key: jax.Array,
             sampling: Sampling = Sampling(), n: int = 1, decode=None,
             on_token: Callable[[np.ndarray, np.ndarray], None] | None = None) -> Generation:
    """Continue each prompt by `max_new_tokens` tokens, `n` times each, in one compiled call.

    `on_token(tokens, live)`, when given, is called on the host after every decode step with that
    step's int32 tokens `[rows]` and which rows were still generating; it streams output while the
    compiled call runs.
    """
    config = model.config
    rows = _check_prompts(prompts, config.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; ask for at least one new token")
    if n < 1:
        raise ValueError(f"n is {n}; ask for at least one continuation per prompt")
    longest = max(len(row) for row in rows)
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens {max_new_tokens} is "
            f"{longest + max_new_tokens}, beyond the model's max_seq_len {config.max_seq_len}: "
            "shorten the prompt or ask for fewer tokens"
        )
    width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.zeros((len(rows) * n, width), np.int32)
    valid = np.zeros((len(rows) * n, width), np.int32)
    prompt_ids = np.repeat(np.arange(len(rows)), n)
    continuation_ids = np.tile(np.arange(n), len(rows))
    for r, prompt_index in enumerate(prompt_ids):
        row = rows[prompt_index]
        tokens[r, width - len(row):] = row
        valid[r, width - len(row):] = 1
    row_keys = jax.vmap(lambda p, c: jax.random.fold_in(jax.random.fold_in(key, p), c))(
        jnp.asarray(prompt_ids), jnp.asarray(continuation_ids)
    )
    run = _compiled(model, sampling, max_new_tokens, on_token is not None)
    _LISTENER[0] = on_token
    try:
        new_BN, log_probs_BN, done_B, count_B = jax.device_get(run(params, tokens, valid, row_keys))
    finally:
        _LISTENER[0] = None

    prompt_lengths = valid.sum(axis=1)
    out = np.full((len(rows) * n, longest + max_new_tokens), sampling.pad_id, np.int32)
    for r in range(out.shape[0]):
        length = prompt_lengths[r]
        out[r, :length] = tokens[r, width - length:]
        out[r, length: length + max_new_tokens] = new_BN[r]
    return Generation(tokens=out, lengths=prompt_lengths + count_B, new_tokens=count_B, terminated=done_B,
                      log_probs=log_probs_BN, decode=decode)


# The executable is shared across calls, so it reports to whichever listener the current call set.
_LISTENER: list = [None]


def _emit(tokens_B, live_B) -> None:
    if _LISTENER[0] is not None:
        _LISTENER[0](np.asarray(tokens_B), np.asarray(live_B))


@functools.lru_cache(maxsize=32)
def _compiled(model, sampling: Sampling, max_new_tokens: int, stream: bool = False):
    eos = jnp.asarray(sampling.eos_token_ids or (-1,), jnp.int32)

    @jax.jit
    def run(params, tokens_BP, valid_BP, keys_B):
        B, P = tokens_BP.shape
        cache = model.init_cache(B, P + max_new_tokens)
        positions_BP = jnp.maximum(jnp.cumsum(valid_BP, axis=1) - 1, 0)
        # Only the last slot's logits are needed: left padding puts every row's last token there.
        hidden_BPE, cache = model.apply(params, tokens_BP, positions=positions_BP, segment_ids=valid_BP,
                                        cache=cache, head=False)
        last_BV = project(model.config, params["params"], hidden_BPE[:, -1])
        next_position_B = jnp.sum(valid_BP, axis=1)

        def step(carry, t):
            cache, logits_BV, position_B, done_B, count_B, seen_BV = carry
            keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(keys_B)
            token_B, log_prob_B = sampling.draw(keys, logits_BV, seen_BV)
            token_B = jnp.where(done_B, sampling.pad_id, token_B)
            if seen_BV is not None:
                seen_BV = seen_BV | (jax.nn.one_hot(token_B, seen_BV.shape[1], dtype=bool) & ~done_B[:, None])
            log_prob_B = jnp.where(done_B, 0.0, log_prob_B)
            if stream:
                io_callback(_emit, None, token_B, ~done_B, ordered=True)
            count_B = count_B + (~done_B).astype(jnp.int32)
            done_B = done_B | jnp.isin(token_B, eos)
            hidden_B1E, cache = model.apply(
                params, token_B[:, None], positions=position_B[:, None],
                segment_ids=jnp.ones((B, 1), jnp.int32), cache=cache, head=False,
            )
            return (cache, project(model.config, params["params"], hidden_B1E[:, 0]), position_B + 1, done_B, count_B, seen_BV), (token_B, log_prob_B)

        seen_BV = None
        if sampling.repetition_penalty is not None:
            vocab = last_BV.shape[-1]
            seen_BV = jnp.zeros((B, vocab), bool).at[jnp.arange(B)[:, None], tokens_BP].max(valid_BP.astype(bool))
        start = (cache, last_BV, next_position_B, jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32), seen_BV)
        (_, _, _, done_B, count_B, _), (tokens_NB, log_probs_NB) = jax.lax.scan(step, start, jnp.arange(max_new_tokens))
        return tokens_NB.T, log_probs_NB.T, done_B, count_B

    return run
