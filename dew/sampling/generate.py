"""Cached generation: host-side preparation, then prefill and decode steps as pure compiled functions.

Prompts are validated and left-padded on the host to a bucketed width, so prompts whose valid lengths
differ but pad to the same width reuse the executable. Each row of the cache holds its own tokens
from slot 0 (padding takes no slot), so the cache holds the longest prompt plus the new tokens,
never the model's maximum. `prefill` and `decode_step` are the pure pieces; `generate` runs them as
one compiled call (prefill, then a `lax.scan` of decode steps), or, when it streams, as a host loop
over the compiled step. Sampling values travel as per-row arrays (`SamplingParams`), so a new
temperature does not recompile.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.data.inputs import MEDIA_FIELDS, ModelInputs, agree_on_mask, text_fields
from dew.nn.multimodal import MultimodalTransformer
from dew.nn.quantize import stacked_in_place
from dew.nn.transformer import CausalTransformer
from dew.sampling.sampling import Sampling, SamplingParams, draw
from dew.sampling.scoring import Scores, prompt_scores

PROMPT_BUCKET = 16
# The float32 rows as wide as the vocabulary one decoding row holds at once: its logits, the filtered
# logits, and the sorted copy and probabilities top-p works on.
_VOCABULARY_ROWS = 4
_CGROUP_MEMORY = Path("/sys/fs/cgroup/memory.max")


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


def row_bytes(model, capacity: int, max_new_tokens: int) -> int:
    """Bytes one row of generation holds while it decodes: its cache of `capacity` slots (KV or
    recurrent state, as `model.init_cache` lays it out), float32 rows as wide as the vocabulary, a
    repetition penalty's mask, and its tokens and log-probabilities."""
    cache = jax.eval_shape(lambda: model.init_cache(1, capacity))
    cached = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))
    vocab = model.config.vocab_size
    return cached + (_VOCABULARY_ROWS * 4 + 1) * vocab + 4 * capacity + 8 * max_new_tokens


def memory() -> tuple[int, str]:
    """(bytes, what they are) of the memory generation runs in: the first device's limit on an
    accelerator, else the host's, within the container's cgroup limit when it sets one."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"the memory of the {device.device_kind}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = _CGROUP_MEMORY.read_text().strip()
    except OSError:
        limit = "max"
    return (min(total, int(limit)) if limit.isdigit() else total), "the host's memory"


def memory_beside(params) -> tuple[int, int, str]:
    """(bytes `params` leave free of `memory()`, that memory's bytes, what it is)."""
    available, where = memory()
    free = available - sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params) if hasattr(leaf, "nbytes"))
    return free, available, where


def _check_memory(model, params, prompts: int, n: int, capacity: int, max_new_tokens: int) -> None:
    """Refuse more rows than fit beside the weights in `memory()`, before any of them is allocated."""
    per_row = row_bytes(model, capacity, max_new_tokens)
    free, available, where = memory_beside(params)
    if prompts * n * per_row <= free:
        return
    gib = lambda count: f"{count / 2**30:,.1f} GiB"
    most = max(free, 0) // per_row // prompts
    fix = (f"ask for n of at most {most:,}, and for more in further calls with other seeds" if most else
           "ask for fewer new tokens, or shorter prompts")
    raise ValueError(
        f"n {n:,} continuations of {prompts} prompt(s) are {prompts * n:,} rows, which would hold about "
        f"{gib(prompts * n * per_row)} while decoding ({per_row:,} bytes a row: a cache of {capacity} positions and "
        f"float32 logits over {model.config.vocab_size:,} tokens), more than the {gib(free)} the weights leave of "
        f"{where} ({gib(available)}): {fix}"
    )


def prefill(model, params, tokens_BP: jax.Array, valid_BP: jax.Array, cache, media=None):
    """Write each row's real prompt tokens into `cache` after the ones it holds; returns the float32
    logits of each row's last real token `[B, V]` and the cache. `valid_BP` marks real tokens
    (padding may sit on either side); `media` holds a multimodal model's image fields and pixels
    (`dew.data.inputs.MEDIA_FIELDS`, `pixel_values`), laid out like the tokens."""
    logits_BV, cache, _ = _prefill(model, params, tokens_BP, valid_BP, cache, media)
    return logits_BV, cache


def _prefill(model, params, tokens_BP, valid_BP, cache, media):
    """`prefill`'s logits and cache, and the model's output over every position (hidden states, head)."""
    output, cache = model.apply(params, tokens_BP, attention_mask=valid_BP, cache=cache, head=False, **(media or {}))
    P = tokens_BP.shape[1]
    last_B = P - 1 - jnp.argmax(valid_BP[:, ::-1] > 0, axis=1)
    hidden_BE = jnp.take_along_axis(output.hidden, last_B[:, None, None], axis=1)[:, 0]
    return output.head.logits(hidden_BE), cache, output


def decode_step(model, params, tokens_B: jax.Array, live_B: jax.Array, cache):
    """Append one token per live row (a finished row writes nothing) and return the next float32
    logits `[B, V]` and the cache."""
    output, cache = model.apply(params, tokens_B[:, None], attention_mask=live_B[:, None], cache=cache, head=False)
    return output.head.logits(output.hidden[:, 0]), cache


@struct.dataclass
class DecodeState:
    """Where decoding stands: the cache, the logits of each row's next token, which rows emitted EOS,
    how many tokens each emitted, and (with a repetition penalty) which tokens each row holds."""

    cache: object
    logits_BV: jax.Array
    done_B: jax.Array
    count_B: jax.Array
    seen_BV: jax.Array | None


def start(model, params, tokens_BP, valid_BP, capacity: int, penalty: bool, media=None) -> DecodeState:
    """Prefill a fresh cache of `capacity` slots per row (with a multimodal model's `media`, as `prefill`)."""
    return _start(model, params, tokens_BP, valid_BP, capacity, penalty, media)[0]


def start_scored(model, params, tokens_BP, valid_BP, capacity: int, penalty: bool, top: int,
                 media=None) -> tuple[DecodeState, Scores]:
    """`start`, and each prompt position's log-probability with the `top` most likely tokens there
    (`dew.sampling.scoring.prompt_scores`), from the same pass."""
    state, output = _start(model, params, tokens_BP, valid_BP, capacity, penalty, media)
    return state, prompt_scores(output.head, output.hidden, tokens_BP, top)


def _start(model, params, tokens_BP, valid_BP, capacity, penalty, media):
    B = tokens_BP.shape[0]
    fresh = model.init_cache(B, capacity).replace(fresh=True)  # attention's prefill may skip later key blocks
    logits_BV, cache, output = _prefill(model, params, tokens_BP, valid_BP, fresh, media)
    seen_BV = None
    if penalty:
        seen_BV = jnp.zeros(logits_BV.shape, bool).at[jnp.arange(B)[:, None], tokens_BP].max(valid_BP > 0)
    return DecodeState(cache, logits_BV, jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32), seen_BV), output


def advance(model, params, state: DecodeState, keys_B, step, sampling: SamplingParams, eos: tuple[int, ...],
            pad_id: int, choose=draw):
    """Draw each live row's next token, then feed it back; returns the new state and
    `(tokens [B], log-probabilities [B], live [B])` of this step (finished rows give `pad_id`).

    Row `b` draws with `fold_in(keys_B[b], step)`: `step` is one count for every row (`generate`'s
    decode step) or int32 `[B]`, each row's own (the serving engine's rows join at different steps).
    `choose(sampling, keys_B, logits_BV, seen_BV) -> (tokens, log-probabilities)` draws; `draw` by
    default.
    """
    steps_B = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys_B.shape)
    keys = jax.vmap(jax.random.fold_in)(keys_B, steps_B)
    token_B, log_prob_B = choose(sampling, keys, state.logits_BV, state.seen_BV)
    live_B = ~state.done_B
    token_B = jnp.where(live_B, token_B, pad_id)
    log_prob_B = jnp.where(live_B, log_prob_B, 0.0)
    seen_BV = state.seen_BV
    if seen_BV is not None:
        seen_BV = seen_BV | (jax.nn.one_hot(token_B, seen_BV.shape[1], dtype=bool) & live_B[:, None])
    done_B = state.done_B | jnp.isin(token_B, jnp.asarray(eos or (-1,), jnp.int32))
    logits_BV, cache = decode_step(model, params, token_B, live_B, state.cache)
    new = DecodeState(cache, logits_BV, done_B, state.count_B + live_B.astype(jnp.int32), seen_BV)
    return new, (token_B, log_prob_B, live_B)


def generate(model, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, key: jax.Array,
             sampling: Sampling = Sampling(), n: int = 1, decode=None,
             on_token: Callable[[np.ndarray, np.ndarray], None] | None = None) -> Generation:
    """Continue each prompt by `max_new_tokens` tokens, `n` times each, in one compiled call.

    `prompts` are lists of token ids, or a `ModelInputs` whose `attention_mask` marks each row's
    real tokens (for a multimodal model, with its images: they are encoded once, at prefill). Rows (prompts times `n`) that would not fit beside the weights in the memory
    generation runs in (`row_bytes`, `memory`) are refused before any is allocated. On a process pool
    every process makes a `ModelInputs` request together: they first agree on its `attention_mask`
    (`dew.data.inputs.agree_on_mask`).

    `on_token(tokens, live)`, when given, is called on the host after every decode step with that
    step's int32 tokens `[rows]` and which rows were still generating; decoding then runs as a host
    loop over the compiled step, so output streams as it is produced.
    """
    config = model.config
    media_rows = None
    if isinstance(prompts, ModelInputs):
        prompts = agree_on_mask(prompts)  # a process pool's requests agree on the field first
        if isinstance(model, MultimodalTransformer):
            media_rows = _media_rows(prompts)
        else:
            text_fields(prompts.kwargs(), "generate")  # text decoders: media are refused by name
        prompts = prompts.valid_rows()
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
    _check_memory(model, params, len(rows), n, width + max_new_tokens, max_new_tokens)
    tokens = np.zeros((len(rows) * n, width), np.int32)
    valid = np.zeros((len(rows) * n, width), np.int32)
    prompt_ids = np.repeat(np.arange(len(rows)), n)
    continuation_ids = np.tile(np.arange(n), len(rows))
    for r, prompt_index in enumerate(prompt_ids):
        row = rows[prompt_index]
        tokens[r, width - len(row):] = row
        valid[r, width - len(row):] = 1
    media = None if media_rows is None else _media_of(media_rows, prompt_ids, width)
    row_keys = jax.vmap(lambda p, c: jax.random.fold_in(jax.random.fold_in(key, p), c))(
        jnp.asarray(prompt_ids), jnp.asarray(continuation_ids)
    )
    sampling_params = SamplingParams.of([sampling] * len(prompt_ids))
    capacity = width + max_new_tokens
    if on_token is None:
        run = _compiled(model, max_new_tokens, sampling.eos_token_ids, sampling.pad_id)
        new_BN, log_probs_BN, done_B, count_B = jax.device_get(run(params, tokens, valid, row_keys, sampling_params,
                                                                   media))
    else:
        new_BN, log_probs_BN, done_B, count_B = _streamed(model, params, tokens, valid, row_keys, sampling_params,
                                                          capacity, max_new_tokens, sampling, on_token, media)

    prompt_lengths = valid.sum(axis=1)
    out = np.full((len(rows) * n, longest + max_new_tokens), sampling.pad_id, np.int32)
    for r in range(out.shape[0]):
        length = prompt_lengths[r]
        out[r, :length] = tokens[r, width - length:]
        out[r, length: length + max_new_tokens] = new_BN[r]
    return Generation(tokens=out, lengths=prompt_lengths + count_B, new_tokens=count_B, terminated=done_B,
                      log_probs=log_probs_BN, decode=decode)


def _media_rows(inputs: ModelInputs) -> dict:
    """A multimodal prompt's image fields (and three-axis rotary positions, which images move), each row's real
    slots only, and its conditioning, on the host."""
    mask = inputs.token_fields.get("attention_mask")
    valid = np.ones(inputs.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    fields = {name: [np.asarray(values)[row][valid[row]] for row in range(valid.shape[0])]
              for name, values in inputs.token_fields.items() if name in MEDIA_FIELDS + ("rotary_positions",)}
    return {"fields": fields, "conditioning": {name: np.asarray(value) for name, value in inputs.conditioning.items()}}


def _media_of(media_rows: dict, prompt_ids: np.ndarray, width: int) -> dict:
    """The image fields laid out as `generate` lays out the prompts (each row right-aligned in `width`
    slots, -1 before it) and the conditioning of each row's prompt."""
    media = {}
    for name, rows in media_rows["fields"].items():
        laid = np.full((len(prompt_ids), width, *rows[0].shape[1:]), -1, np.int32)
        for r, prompt in enumerate(prompt_ids):
            if len(rows[prompt]):
                laid[r, width - len(rows[prompt]):] = rows[prompt]
        media[name] = laid
    media.update({name: value[prompt_ids] for name, value in media_rows["conditioning"].items()})
    return media


def _in_place(model, params):
    """A causal decoder's `params` with its scanned runs' float kernels held whole, so that each decode step
    reads its layers' weights in place rather than XLA copying them out of the stack every step
    (`dew.nn.quantize.stacked_in_place`; the same products, so the same numbers)."""
    return stacked_in_place(model, params) if isinstance(model, CausalTransformer) else params


@functools.lru_cache(maxsize=32)
def _compiled(model, max_new_tokens: int, eos: tuple[int, ...], pad_id: int):
    """Prefill and `max_new_tokens` decode steps as one compiled call (sampling values are arguments)."""

    @jax.jit
    def run(params, tokens_BP, valid_BP, keys_B, sampling: SamplingParams, media):
        params = _in_place(model, model.stack_variables(params))  # once, not at every decode step
        state = start(model, params, tokens_BP, valid_BP, tokens_BP.shape[1] + max_new_tokens,
                      sampling.use_penalty, media)

        def step(state, t):
            return advance(model, params, state, keys_B, t, sampling, eos, pad_id)

        state, (tokens_NB, log_probs_NB, _) = jax.lax.scan(step, state, jnp.arange(max_new_tokens))
        return tokens_NB.T, log_probs_NB.T, state.done_B, state.count_B

    return run


@functools.lru_cache(maxsize=32)
def _pieces(model, capacity: int, eos: tuple[int, ...], pad_id: int):
    """The compiled prefill and decode step a streamed generation loops over on the host."""
    stack = jax.jit(lambda params: _in_place(model, model.stack_variables(params)))
    first = jax.jit(lambda params, tokens, valid, penalty, media: start(model, params, tokens, valid, capacity,
                                                                         penalty, media), static_argnums=3)
    step = jax.jit(lambda params, state, keys, t, sampling: advance(model, params, state, keys, t, sampling, eos,
                                                                   pad_id))
    return stack, first, step


def _streamed(model, params, tokens, valid, keys_B, sampling_params, capacity, max_new_tokens, sampling, on_token,
              media=None):
    stack, first, step = _pieces(model, capacity, sampling.eos_token_ids, sampling.pad_id)
    params = stack(params)
    state = first(params, tokens, valid, sampling_params.use_penalty, media)
    new, log_probs = [], []
    for t in range(max_new_tokens):
        state, (token_B, log_prob_B, live_B) = step(params, state, keys_B, jnp.int32(t), sampling_params)
        token_B, live_B = np.asarray(token_B), np.asarray(live_B)
        on_token(token_B, live_B)
        new.append(token_B)
        log_probs.append(np.asarray(log_prob_B))
    done_B, count_B = jax.device_get((state.done_B, state.count_B))
    return np.stack(new, axis=1), np.stack(log_probs, axis=1), done_B, count_B
