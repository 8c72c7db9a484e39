"""The serving engine's device side: a fixed set of slots (rows of one KV cache) and the two compiled
functions that change them, `step` (every occupied slot draws one token and feeds it back) and
`admit` (prefill a few new prompts into a small cache of their own, then copy those rows into free
slots; for prompts whose log-probabilities are asked for, a second compiled form also scores every
prompt position from the same pass), and `extend` (prefill the next chunk of a long prompt into the
slot that holds its beginning).

Shapes never depend on the requests: `step` compiles once per row count of the engine's ladder (it
runs over the first rows, those in use), `admit` once per (prefill rows, prompt width) pair, `extend`
once per chunk width, so a
warmed-up engine serves any mix of requests without compiling. A row draws exactly what a one-row `generate` draws: its key is
`fold_in(fold_in(key(seed), prompt_index), continuation)`, its step `t` folds in `t` (the row's own
count), and its sampling values are its own. A row that asks for log-probabilities gets, from the
step that draws each token, the model's float32 log-softmax of the logits it drew from (never the
tempered or filtered distribution) and the `top` most likely tokens; while no live row asks, the step
computes none of it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.nn.kv_cache import AttentionCache
from dew.sampling.generate import DecodeState, advance, prefill, start, start_scored
from dew.sampling.sampling import Sampling, SamplingParams, draw
from dew.sampling.scoring import Scores, empty_scores, score


@struct.dataclass
class Slots:
    """Every slot's decoding state: `decode` (cache `[slots, capacity]`, next-token logits, done,
    emitted count, seen tokens), each slot's key, sampling values, budget (`max_tokens`) and whether
    it reports log-probabilities (`scored_B`). A free slot is `done`, so it writes nothing and draws nothing."""

    decode: DecodeState
    keys_B: jax.Array
    sampling: SamplingParams
    budget_B: jax.Array
    scored_B: jax.Array


@struct.dataclass
class StepOutput:
    """One step's draws, int32 `tokens_B` (pad for rows that did not draw), which rows drew
    (`live_B`), which rows are done after it (`done_B`: EOS drawn, budget reached, or released), and
    the drawn tokens' `scores` (zeros unless a live row reports log-probabilities)."""

    tokens_B: jax.Array
    live_B: jax.Array
    done_B: jax.Array
    scores: Scores


def filtered_sampling(sampling: SamplingParams, top_k_bound: int) -> SamplingParams:
    """`sampling` with every filter switched on (rows whose values are neutral draw as without it)."""
    return sampling.replace(top_k_bound=top_k_bound, use_top_p=True, use_min_p=True, use_penalty=True)


def plain_sampling(sampling: SamplingParams) -> SamplingParams:
    return sampling.replace(top_k_bound=0, use_top_p=False, use_min_p=False, use_penalty=False)


def _uses_filters(sampling: SamplingParams, live_B: jax.Array) -> jax.Array:
    asks = (sampling.top_k > 0) | (sampling.top_p < 1.0) | (sampling.min_p > 0.0) | (sampling.repetition_penalty != 1.0)
    return jnp.any(asks & live_B)


def empty_slots(model, slots: int, capacity: int, top_k_bound: int) -> Slots:
    """Every slot free: an empty cache of `capacity` positions per slot."""
    vocab = model.config.vocab_size
    decode = DecodeState(cache=model.init_cache(slots, capacity), logits_BV=jnp.zeros((slots, vocab), jnp.float32),
                         done_B=jnp.ones((slots,), bool), count_B=jnp.zeros((slots,), jnp.int32),
                         seen_BV=jnp.zeros((slots, vocab), bool))
    neutral = SamplingParams.of([Sampling()] * slots)
    sampling = filtered_sampling(jax.tree_util.tree_map(jnp.asarray, neutral), top_k_bound)
    keys = jax.random.wrap_key_data(jnp.zeros((slots, 2), jnp.uint32))
    return Slots(decode, keys, sampling, jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), bool))


def compile_step(model, eos: tuple[int, ...], pad_id: int, rows: int, slots: int, top: int):
    """The compiled step over the first `rows` of `slots` slots, `(params, slots, release_B) -> (slots,
    StepOutput over those rows)`: rows marked in `release_B` stop first (the host ended them), then
    every live row draws and feeds back one token; a row that draws EOS or reaches its budget is done.
    The drawn tokens are scored, with the `top` most likely, while some live row reports log-probabilities.
    The state is donated (updated in place); with `rows` below `slots` the first rows are stepped: attention's
    cache is read and written in place, the rest of their state is cut out and written back, so a lightly
    loaded engine computes only the rows it uses and copies no cache."""

    def step(params, state: Slots, release_B):
        part = state if rows == slots else _first_rows(state, rows)
        decode = part.decode.replace(done_B=part.decode.done_B | release_B[:rows])
        live_B = ~decode.done_B
        # Filters sort or rank the vocabulary; skip them (one branch runs) while no live row asks for one.
        use = _uses_filters(part.sampling, live_B)
        scoring = jnp.any(part.scored_B & live_B)
        drawn_from_BV = decode.logits_BV

        def choose(sampling, keys_B, logits_BV, seen_BV):
            return jax.lax.cond(use, lambda: draw(sampling, keys_B, logits_BV, seen_BV),
                                lambda: draw(plain_sampling(sampling), keys_B, logits_BV, seen_BV))

        decode, (tokens_B, _, live_B) = advance(model, params, decode, part.keys_B, decode.count_B, part.sampling,
                                                eos, pad_id, choose=choose)
        scores = jax.lax.cond(scoring, lambda: score(drawn_from_BV, tokens_B, top), lambda: empty_scores(rows, top))
        decode = decode.replace(done_B=decode.done_B | (decode.count_B >= part.budget_B))
        part = part.replace(decode=decode)
        if rows < slots:
            part = _rows_written(state, part)
        return part, StepOutput(tokens_B, live_B, decode.done_B, scores)

    return jax.jit(step, donate_argnums=1)


def _in_place(run) -> bool:
    """Whether a step over the first rows reads and writes this run of the cache whole, in place (attention's
    keys and values: `AttentionCache.read(layer, rows)`), rather than a copy of those rows, which costs
    a copy of the rows' whole capacity in and out at every step."""
    return isinstance(run, AttentionCache)


def _without_runs(state: Slots) -> Slots:
    return state.replace(decode=state.decode.replace(cache=state.decode.cache.replace(runs=())))


def _with_runs(state: Slots, runs: tuple) -> Slots:
    return state.replace(decode=state.decode.replace(cache=state.decode.cache.replace(runs=runs)))


def _first_rows(state: Slots, rows: int) -> Slots:
    """The first `rows` rows of every slot's state (row axis 0; 1 for a cache run's `[layers, rows, ...]`);
    runs read in place (`_in_place`) stay whole."""
    cut = lambda axis: lambda x: jax.lax.slice_in_dim(x, 0, rows, axis=axis)  # noqa: E731
    runs = tuple(run if _in_place(run) else jax.tree_util.tree_map(cut(1), run) for run in state.decode.cache.runs)
    return _with_runs(jax.tree_util.tree_map(cut(0), _without_runs(state)), runs)


def _rows_written(state: Slots, part: Slots) -> Slots:
    """`state` with its first rows replaced by `part`'s (`_first_rows`'s layout; whole runs are taken as they are)."""
    put = lambda axis: lambda whole, x: jax.lax.dynamic_update_slice_in_dim(whole, x, 0, axis)  # noqa: E731
    runs = tuple(new if _in_place(old) else jax.tree_util.tree_map(put(1), old, new)
                 for old, new in zip(state.decode.cache.runs, part.decode.cache.runs))
    return _with_runs(jax.tree_util.tree_map(put(0), _without_runs(state), _without_runs(part)), runs)


@dataclasses.dataclass(frozen=True)
class Admission:
    """Host arrays for `admit`: `rows` prompts left-padded to `width` (int32 `tokens`, `valid`), the
    slot each goes to (`slots`; the engine's slot count marks a padding row, which is dropped), the
    key data of `jax.random.key(seed)` (uint32 `[rows, 2]`), prompt and continuation indices, the
    sampling values and budgets, whether each reports its drawn tokens' log-probabilities (`scored`);
    `media`, a multimodal model's slot fields `[rows, width, ...]` (`dew.serve.engine.SLOTTED`: image and
    audio indices, image groups, Qwen 3.5's `rotary_positions`) and conditioning `[rows, ...]` (images,
    their grids or patch positions, audio frames and their masks; `dew.serve.engine.Request.media`);
    None for text. `held` marks rows whose prompt goes on in chunks (`compile_extend`): they stay done,
    drawing nothing, until the last chunk is in. `reuse`, for prompts whose beginnings some slots' caches
    already hold, says where (`Reuse`): `tokens` then holds only what follows each beginning."""

    tokens: np.ndarray
    valid: np.ndarray
    slots: np.ndarray
    seed_keys: np.ndarray
    prompt_index: np.ndarray
    continuation: np.ndarray
    sampling: SamplingParams
    budget: np.ndarray
    scored: np.ndarray
    held: np.ndarray
    media: dict | None = None
    reuse: "Reuse | None" = None

    def arguments(self) -> tuple:
        """The arrays in the order `compile_admit`'s compiled function takes them, after params and slots."""
        return (self.tokens, self.valid, self.slots, self.seed_keys, self.prompt_index, self.continuation,
                self.sampling, self.budget, self.scored, self.held, self.media, self.reuse)


@struct.dataclass
class Reuse:
    """Where an admission's rows begin: row r's first `prefix[r]` prompt tokens are the first positions
    of slot `sources[r]`'s cache (copied, the slot unchanged), and its whole prompt is `prompts[r]`
    (int32 `[rows, C]`, left-aligned, `prompts_valid` marking it: the seen tokens of a repetition
    penalty). The rows are prefilled after their beginnings in a cache of `C` positions."""

    sources: np.ndarray
    prefix: np.ndarray
    prompts: np.ndarray
    prompts_valid: np.ndarray


def compile_admit(model, top: int):
    """The compiled admission `(params, slots, Admission, prompt_scores) -> slots`: prefill the new
    prompts into a cache as wide as their bucket, then copy each row (cache, logits, seen tokens) into
    its slot and reset the slot's count, key, sampling values, budget and scoring flag. `slots` is
    donated. With `prompt_scores` it returns `(slots, Scores [rows, width])` too: each prompt
    position's log-probability with the `top` most likely tokens (a form compiled of its own)."""

    def admit(params, slots: Slots, tokens_RW, valid_RW, slot_R, seed_keys_R, prompt_R, continuation_R,
              sampling_R: SamplingParams, budget_R, scored_R, held_R, media, reuse, prompt_scores):
        W = tokens_RW.shape[1]
        if reuse is not None:
            new = _after_beginnings(model, params, slots.decode.cache, tokens_RW, valid_RW, reuse)  # text only
        elif prompt_scores:
            new, scores = start_scored(model, params, tokens_RW, valid_RW, W, penalty=True, top=top, media=media)
        else:
            new = start(model, params, tokens_RW, valid_RW, W, penalty=True, media=media)
        put = lambda big, rows: big.at[slot_R].set(rows.astype(big.dtype), mode="drop")
        # Each run's cache lays out its rows its own way (a recurrent state has no slots): it puts them.
        cache = slots.decode.cache
        if reuse is None:
            runs = tuple(run.put_rows(slot_R, rows) for run, rows in zip(cache.runs, new.cache.runs))
        else:  # each row in place; a padding row puts back what it took from its source, unchanged
            rows_R = jnp.where(slot_R < cache.rows, slot_R, reuse.sources)
            runs = tuple(run.put_row_slices(rows_R, rows) for run, rows in zip(cache.runs, new.cache.runs))
        cache = cache.replace(runs=runs, lengths=put(cache.lengths, new.cache.lengths))
        if cache.groups is not None:  # which slots hold an image's tokens, for a multimodal model
            cache = cache.replace(groups=cache.groups.at[slot_R, :W].set(new.cache.groups, mode="drop"))
        if cache.rotary_delta is not None:  # where a three-axis rotary continues each row (Qwen 3.5's)
            cache = cache.replace(rotary_delta=put(cache.rotary_delta, new.cache.rotary_delta))
        decode = DecodeState(cache, put(slots.decode.logits_BV, new.logits_BV), put(slots.decode.done_B, held_R),
                             put(slots.decode.count_B, new.count_B), put(slots.decode.seen_BV, new.seen_BV))
        keys = jax.vmap(lambda k, p, c: jax.random.fold_in(jax.random.fold_in(k, p), c))(
            jax.random.wrap_key_data(seed_keys_R), prompt_R, continuation_R)
        keys_B = jax.random.wrap_key_data(put(jax.random.key_data(slots.keys_B), jax.random.key_data(keys)))
        sampling = slots.sampling.replace(**{name: put(getattr(slots.sampling, name), getattr(sampling_R, name))
                                             for name in ("temperature", "top_k", "top_p", "min_p",
                                                          "repetition_penalty")})
        admitted = Slots(decode, keys_B, sampling, put(slots.budget_B, budget_R), put(slots.scored_B, scored_R))
        return (admitted, scores) if prompt_scores else admitted

    jitted = jax.jit(admit, donate_argnums=1, static_argnames="prompt_scores")

    def run(params, slots: Slots, admission: Admission, prompt_scores: bool = False):
        return jitted(params, slots, *admission.arguments(), prompt_scores=prompt_scores)

    run.jitted = jitted
    return run


def _after_beginnings(model, params, cache, tokens_RW, valid_RW, reuse: Reuse) -> DecodeState:
    """Prefill each row's tokens after the beginning `reuse` says some slot holds, into a cache of those
    beginnings (copied from the slots' cache, `reuse.prompts`' width)."""
    C = reuse.prompts.shape[1]
    rows = cache.replace(runs=tuple(run.take_rows(reuse.sources, C) for run in cache.runs), lengths=reuse.prefix)
    logits_RV, rows = prefill(model, params, tokens_RW, valid_RW, rows)
    R = tokens_RW.shape[0]
    seen_RV = jnp.zeros(logits_RV.shape, bool).at[jnp.arange(R)[:, None], reuse.prompts].max(reuse.prompts_valid > 0)
    return DecodeState(rows, logits_RV, jnp.zeros((R,), bool), jnp.zeros((R,), jnp.int32), seen_RV)


def chunkable(cache) -> bool:
    """Whether `compile_extend` can go on with a prompt in this cache: text attention only (a cache of
    `AttentionCache` runs, without image groups or three-axis rotary offsets)."""
    return all(_in_place(run) for run in cache.runs) and cache.groups is None and cache.rotary_delta is None


def compile_extend(model):
    """The compiled chunk `(params, slots, tokens_1C, valid_1C, slot_1, last_1) -> slots`: prefill one
    row's next `C` prompt tokens (`valid` marks them; padding on the left) into slot `slot`'s cache after
    the tokens it holds, set the slot's next-token logits from the chunk's last token and add the chunk's
    tokens to its seen ones; with `last` the slot goes live (it draws at the next step). `slots` is donated."""

    def extend(params, slots: Slots, tokens_1C, valid_1C, slot_1, last_1):
        cache = slots.decode.cache
        slot = slot_1[0]
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=1)  # noqa: E731 - a run is [layers, rows, ...]
        row = cache.replace(runs=tuple(jax.tree_util.tree_map(cut, run) for run in cache.runs),
                            lengths=jax.lax.dynamic_slice_in_dim(cache.lengths, slot, 1))
        logits_1V, row = prefill(model, params, tokens_1C, valid_1C, row)
        put = lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part, slot, axis=1)  # noqa: E731
        runs = tuple(jax.tree_util.tree_map(put, old, new) for old, new in zip(cache.runs, row.runs))
        cache = cache.replace(runs=runs,
                              lengths=jax.lax.dynamic_update_slice_in_dim(cache.lengths, row.lengths, slot, 0))
        d = slots.decode
        seen_1V = jax.lax.dynamic_slice_in_dim(d.seen_BV, slot, 1).at[0, tokens_1C[0]].max(valid_1C[0] > 0)
        decode = d.replace(cache=cache, logits_BV=jax.lax.dynamic_update_slice_in_dim(d.logits_BV, logits_1V, slot, 0),
                           seen_BV=jax.lax.dynamic_update_slice_in_dim(d.seen_BV, seen_1V, slot, 0),
                           done_B=jax.lax.dynamic_update_slice_in_dim(d.done_B, ~last_1, slot, 0))
        return slots.replace(decode=decode)

    return jax.jit(extend, donate_argnums=1)
