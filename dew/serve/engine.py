"""`Engine`: continuous batching over a fixed number of slots, run by one thread.

Requests wait in a bounded queue. Between decode steps the engine admits waiting requests into free
slots (prefilled in batches of a few rows at bucketed prompt widths, a long prompt in chunks, one chunk
between two steps; see `dew.serve.slots`), then
dispatches one compiled step for every occupied slot. It dispatches step t+1 before it reads step
t's tokens, so the host's work (handing tokens to their requests, decoding text, finding stop
strings) overlaps the device's. A row that ends (EOS, its budget, a stop string its consumer found,
a cancelled request) frees its slot at once; one ended by the host is released in the next step.

Each request hands its tokens to a `Consumer`, on the engine's thread; one that asks for
log-probabilities also hands it each prompt position's (scored at its admission, from the same prefill)
and each drawn token's (from the step that draws it), EOS included. A request the engine cannot
serve is refused by `submit`, on the caller's thread, so no request reaches the engine's thread that
could fail it; should that thread fail anyway, it ends every request as "cancelled", keeps the error in
`failure` and calls the `on_failure` given to `start`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from dew.data.inputs import MEDIA_FIELDS
from dew.sampling.generate import PROMPT_BUCKET, memory_beside, row_bytes
from dew.sampling.sampling import Sampling, SamplingParams, _bucket, check_seed
from dew.serve.slots import (Admission, Reuse, chunkable, compile_admit, compile_extend, compile_step, empty_slots,
                              plain_sampling)

logger = logging.getLogger("dew.serve")

TOP_K_LIMIT = 64
"""The largest `top_k` a request may ask for, unless the source's own default is larger."""
MAX_LOG_PROBS = 20
"""The most alternatives a request may ask for at each position by default (vLLM's `--max-logprobs`)."""
PREFILL_CHUNK = 256
"""The widest prompt prefilled in one piece by default; a longer one goes on in chunks of this width."""
BATCHED_WIDTH = PREFILL_CHUNK
WAVES = 3
"""The most rounds of admissions one arrival of prompts is prefilled in, so that a prompt may begin with a
copy of another's beginning prefilled in an earlier round."""
"""The widest prompt width prefilled several rows at a time (a batch holds at most `prefill_rows` times
as many positions). Rows prefilled together share each layer's weights and the calls around them, which
costs less than a row at a time at every width up to here, most in bfloat16 (docs/performance.md,
"dew serve prefill: rows together up to 256 positions"). Wider prompts (only those not chunked: with media,
asking for their log-probabilities, or of a model whose cache is not text attention's) go one at a time."""


class QueueFull(RuntimeError):
    """The engine's waiting queue holds its bound: the request was not taken."""


class TooLong(ValueError):
    """A prompt plus its budget does not fit one slot's positions."""


class Consumer(Protocol):
    """What receives a request's tokens, called on the engine's thread (keep it short)."""

    def token(self, token_id: int) -> bool:
        """Take the next token (never an EOS token); True ends the request here (a stop string)."""

    def finish(self, reason: str, completion_tokens: int) -> None:
        """The request ended: "stop" (EOS drawn, or `token` returned True), "length" (budget reached)
        or "cancelled"; `completion_tokens` counts the tokens drawn, EOS included."""

    def scores(self, entries: "list[Scored]") -> None:
        """Log-probabilities, for a request that asks for them: first its prompt's (with `prompt_log_probs`,
        one entry per prompt token), then one entry per drawn token, EOS included, before `token`."""


@dataclasses.dataclass(frozen=True)
class Scored:
    """One position's token, its log-probability (the model's float32 log-softmax, whatever the
    sampling policy) and the most likely tokens there, `(id, log-probability)`, most likely first."""

    token: int
    log_prob: float | None  # None at a prompt's first position, which nothing comes before
    top: tuple[tuple[int, float], ...]


# A request's media laid per prompt slot (the rest, its conditioning, is one entry an image or clip).
SLOTTED = MEDIA_FIELDS + ("rotary_positions",)


@dataclasses.dataclass(eq=False)
class Request:
    """One continuation: `prompt` token ids, at most `max_tokens` new ones, drawn with `sampling`
    (its EOS and pad ids are the engine's) and the key of `generate(..., key=jax.random.key(seed))`
    row `prompt_index * n + continuation`. `media`, for a multimodal model, holds the prompt's slot
    fields (`image_indices`, `image_groups`, `audio_indices`, each as long as the prompt; Qwen 3.5's
    `rotary_positions [prompt, 3]` too) and its conditioning, one entry an image or clip: `pixel_values
    [images, C, H, W]` (Qwen 3.5's patch vectors `[images, patches, C*T*p*p]` beside `image_grid_thw
    [images, 3]`, Gemma 4's patch streams beside `image_position_ids`), `input_features [clips, frames,
    mel]` with `input_features_mask`; None for text. `log_probs` asks for each drawn token's
    log-probability with that many alternatives, `prompt_log_probs` for each prompt position's (None: not)."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    consumer: Consumer
    prompt_index: int = 0
    continuation: int = 0
    drawn: int = 0
    ended: bool = False
    media: dict | None = None
    log_probs: int | None = None
    prompt_log_probs: int | None = None

    @property
    def media_shape(self) -> tuple:
        """The shapes of the conditioning (the count of images and clips, an image's pixel shape, which
        Qwen 3.5's patch count varies, a clip's frames), which an admission's rows share; () for text."""
        if self.media is None:
            return ()
        return tuple((name, np.shape(value)) for name, value in sorted(self.media.items()) if name not in SLOTTED)


class Engine:
    """Continuous batching for `model` with `params` over `slots` rows of `capacity` positions each.

    `submit` queues requests (at most `queue_limit` wait; beyond that it raises `QueueFull`);
    `cancel` drops one wherever it is. Prompts are prefilled at widths 16, 32, 64, 96, 128, 192, 256,
    384 ... (steps of at most 1.5x from 64 up) up to `prefill_chunk`, in batches of 1, 2, 4 ... up to
    `prefill_rows` rows at widths up to `BATCHED_WIDTH`, one row at a time above. A longer prompt is
    admitted by its head (what leaves whole chunks after it) and goes on in chunks of `prefill_chunk`
    tokens into its slot's cache, one chunk between two steps; its row draws once the last is in (a model
    whose cache is not text attention's, a prompt with media or asking for its log-probabilities, is
    prefilled whole, at widths of the same ladder up to `capacity`). With `reuse_prefixes`, a plain prompt
    that begins with tokens a slot's cache holds is prefilled after a copy of their keys and values
    (`_waves`). Requests take the lowest free slots (one going on with a slot's tokens, that slot), and a
    step runs over the first 1, 2, 4 ... `slots` rows, the fewest that hold every
    occupied slot. `eos_token_ids` end a row, `pad_id` fills. `top_k_limit` bounds a request's
    `top_k`, `max_log_probs` the alternatives it may ask for.

    Each (rows, width) admission, the chunk and each step width is a program compiled ahead of time.
    `start` compiles the few that serve any request first (the step over every slot, the one-row
    admission at the narrowest prompt width, and the chunk, or where prompts are not chunked the widest
    admission), takes the slots' state (made on a thread of its own since the engine was made, beside the
    programs: the KV cache's zeros), sets `ready`, and compiles the rest on a thread of its own; until a program
    is compiled, the engine uses the nearest compiled one that holds the work (a wider step, a wider
    prompt width or a head and chunks, fewer rows per admission), so no request waits on a
    compile (but the first that asks for its prompt's log-probabilities at a width, or brings a new
    count of images or clips or a new media shape: Qwen 3.5's patch count, a clip's length). `warm_up` compiles
    every program at once.
    """

    program_cache = None
    """Where compiled programs are kept between processes (a `dew.serve.programs.ProgramCache`, which `dew
    serve` sets before `start`); None: each is traced, lowered and compiled."""

    def __init__(self, model, params, *, slots: int, capacity: int, eos_token_ids: Sequence[int] = (),
                 pad_id: int = 0, queue_limit: int = 256, prefill_rows: int = 4, top_k_limit: int = TOP_K_LIMIT,
                 max_log_probs: int = MAX_LOG_PROBS, prefill_chunk: int = PREFILL_CHUNK, reuse_prefixes: bool = True):
        config = model.config
        if slots < 1:
            raise ValueError(f"slots is {slots}; the engine needs at least one")
        if not 2 <= capacity <= config.max_seq_len:
            raise ValueError(f"capacity {capacity} must lie in [2, the model's max_seq_len {config.max_seq_len}]: "
                             "it is the positions of one request, prompt and new tokens")
        if prefill_chunk < PROMPT_BUCKET:
            raise ValueError(f"prefill_chunk {prefill_chunk} is below the narrowest prompt width {PROMPT_BUCKET}: "
                             f"give at least {PROMPT_BUCKET}")
        if queue_limit < 0 or prefill_rows < 1:
            raise ValueError(f"queue_limit {queue_limit} and prefill_rows {prefill_rows} must be >= 0 and >= 1")
        if not 0 <= max_log_probs <= config.vocab_size:
            raise ValueError(f"max_log_probs {max_log_probs} must lie in [0, the vocabulary's {config.vocab_size}]")
        self.model, self.slots, self.capacity, self.queue_limit = model, slots, capacity, queue_limit
        self.eos = tuple(int(i) for i in eos_token_ids)
        self.pad_id = int(pad_id)
        self.top_k_limit = top_k_limit
        self.max_log_probs = max_log_probs
        self.widths = _widths(capacity)
        self.prefill_rows = _ladder(1, min(prefill_rows, slots))  # at widths up to BATCHED_WIDTH; one row above
        _check_memory(model, params, slots, capacity)
        # once, not at every step; weights already in the model's own form are used as they are (a jitted
        # stacking would copy every one, and the caller's would stay in memory beside the copies)
        self.params = params if model.stack_variables(params) is params else jax.jit(model.stack_variables)(params)
        self._top_k_bound = _bucket(top_k_limit)
        # The slots' state, whose KV cache (every position of every slot and layer) is most of the engine's
        # memory and of its start, zeros to write, is made on a thread of its own while the programs load and
        # the server starts: they need only its shapes. The engine's thread takes it before it is ready.
        make_state = jax.jit(lambda: empty_slots(model, slots, capacity, self._top_k_bound),
                             out_shardings=_state_sharding(self.params))
        state = jax.eval_shape(make_state)
        self._state = None
        self._state_made = _in_background(make_state, "dew-serve-state")
        # A text attention model prefills a prompt longer than `chunk` in chunks; others prefill it whole.
        self.chunk = max(w for w in self.widths if w <= prefill_chunk) if chunkable(state.decode.cache) else capacity
        self.plain_widths = tuple(w for w in self.widths if w <= self.chunk)  # compiled ahead for plain prompts
        # A plain prompt that fits a chunk may begin with tokens some slot's cache holds: those are copied
        # (text attention only: a recurrent state holds no positions to copy).
        self.reuse_prefixes = reuse_prefixes and chunkable(state.decode.cache)
        self._held = np.full((slots, capacity), -1, np.int32)  # each slot's cached tokens from position 0, as known
        self._held_lengths = np.zeros(slots, np.int32)
        self.prompt_tokens = self.reused = 0  # prompt tokens admitted, and those a copied beginning held
        self._extend = compile_extend(model)
        self._chunks: list[tuple[int, Request, int]] = []  # (slot, request, tokens in) of prompts going on
        self.step_rows = _ladder(1, slots)
        self._steps = {rows: compile_step(model, self.eos, self.pad_id, rows, slots, max_log_probs)
                       for rows in self.step_rows}
        self._admit = compile_admit(model, max_log_probs)
        self._programs: dict[tuple, Callable] = {}  # ("step", rows), ("admit", rows, width), ("extend", width)
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))  # noqa: E731
        self._abstract = (jax.tree_util.tree_map(abstract, self.params), state)
        # the first programs serve any prompt: a long one as a head of 16 tokens and chunks after it
        widest = ("extend", self.chunk) if self.chunk < capacity else ("admit", 1, self.chunk)
        # (one program, where the narrowest width is the widest: a capacity of one prompt width)
        first = list(dict.fromkeys([("step", self.step_rows[-1]), ("admit", 1, self.widths[0]), widest]))
        rest = [("step", rows) for rows in self.step_rows] + [("admit", 1, width) for width in self.plain_widths] + \
            [("admit", rows, width) for width in self.plain_widths for rows in self._rows_at(width)[1:]] + \
            ([widest] if self.chunk < capacity else []) + \
            [("reuse", rows, width) for width in self.plain_widths[:-1] if self.reuse_prefixes for rows in self._rows_at(width)] + \
            ([("resume", 1, self.chunk)] if self.reuse_prefixes and self.chunk < capacity else [])
        self.first_programs = first
        self.later_programs = [key for key in dict.fromkeys(rest) if key not in first]
        self.ready = threading.Event()
        self.compile_seconds = 0.0
        self._owners: list[Request | None] = [None] * slots
        self._release = np.zeros(slots, bool)
        self._waiting: collections.deque[Request] = collections.deque()
        self._cancelled: set[Request] = set()
        self._lock = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._compiler: threading.Thread | None = None
        self._on_failure: Callable[[BaseException], None] | None = None
        self.failure: BaseException | None = None
        self.steps = 0

    # -- the host's view, thread-safe ----------------------------------------------------------------

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue `requests` together (all or none: `QueueFull` when they do not fit the bound now,
        ValueError when they never would, or one of them cannot be served)."""
        self.check_rows(len(requests))
        for request in requests:
            self.check(len(request.prompt), request.max_tokens, request.sampling)
            self.check_log_probs(request.log_probs)
            self.check_log_probs(request.prompt_log_probs)
            check_seed(request.seed)
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is closed")
            free = sum(owner is None for owner in self._owners)
            if len(self._waiting) + len(requests) - free > self.queue_limit:
                raise QueueFull(f"{len(requests)} new rows with {len(self._waiting)} already waiting would leave "
                                f"{len(self._waiting) + len(requests) - free} waiting for {free} free slots, and the "
                                f"queue holds {self.queue_limit} (dew serve --queue): retry later")
            self._waiting.extend(requests)
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """Drop `request`: out of the queue, or its slot freed before the next step."""
        with self._lock:
            self._cancelled.add(request)
            self._lock.notify()

    def check(self, prompt_tokens: int, max_tokens: int, sampling: Sampling) -> None:
        """Refuse (ValueError) a request this engine cannot serve: too long, or a top_k past the bound."""
        if prompt_tokens < 1:
            raise ValueError("the prompt is empty; give at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens}; ask for at least one token")
        if prompt_tokens + max_tokens > self.capacity:
            raise TooLong(f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} make "
                             f"{prompt_tokens + max_tokens}, beyond this server's context of {self.capacity} tokens "
                             "per request (dew serve --capacity): shorten the prompt or lower max_tokens")
        if sampling.top_k is not None and sampling.top_k > self.top_k_limit:
            raise ValueError(f"top_k is {sampling.top_k}; this server keeps at most the {self.top_k_limit} most "
                             "likely tokens: ask for fewer, or none")

    def check_log_probs(self, alternatives: int | None, name: str = "logprobs") -> None:
        """Refuse (ValueError) asking for more alternatives per position than `max_log_probs`."""
        if alternatives is not None and not 0 <= alternatives <= self.max_log_probs:
            raise ValueError(f"{name} is {alternatives}; this server gives at most the {self.max_log_probs} most "
                             "likely tokens at each position (dew serve --max-logprobs): ask for fewer")

    @property
    def max_rows(self) -> int:
        """The most requests one `submit` can ever take: every slot free and the queue empty."""
        return self.slots + self.queue_limit

    def check_rows(self, rows: int) -> None:
        """Refuse (ValueError) `rows` requests submitted together that could never all be taken."""
        if rows > self.max_rows:
            raise ValueError(f"{rows} requests submitted together can never all be taken: the engine runs "
                             f"{self.slots} at once and queues {self.queue_limit} more, {self.max_rows} in all")

    def load(self) -> dict:
        """Whether the engine's thread runs and is `ready`, the programs compiled of all, those still to be
        compiled once more to keep for the next start (`keeping`: `ProgramCache.keeping`), and how busy it
        is: occupied slots, waiting requests, steps run, prompt tokens admitted and of those the ones copied
        from a slot's cache instead of prefilled."""
        keeping = self.program_cache.keeping() if self.program_cache is not None else 0
        with self._lock:
            running = not self._closing and self._thread is not None and self._thread.is_alive()
            return {"running": running, "ready": self.ready.is_set(), "compiled": len(self._programs),
                    "programs": len(self.first_programs) + len(self.later_programs), "keeping": keeping,
                    "slots": self.slots,
                    "busy": sum(owner is not None for owner in self._owners), "waiting": len(self._waiting),
                    "capacity": self.capacity, "steps": self.steps, "prompt_tokens": self.prompt_tokens,
                    "reused_prompt_tokens": self.reused}

    # -- life cycle ---------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile every program now, on this thread (then `start` compiles nothing)."""
        for key in [*self.first_programs, *self.later_programs]:
            self._compile(key)
        self._first_use()

    def _compile(self, key: tuple) -> None:
        if key in self._programs:
            return
        started = time.perf_counter()
        params, state = self._abstract
        if key[0] == "step":
            jitted, options = self._steps[key[1]], {}
            arguments = (params, state, jax.ShapeDtypeStruct((self.slots,), bool))
        elif key[0] == "extend":
            tokens = jax.ShapeDtypeStruct((1, key[1]), np.int32)
            jitted, options = self._extend, {}
            arguments = (params, state, tokens, tokens, jax.ShapeDtypeStruct((1,), np.int32),
                         jax.ShapeDtypeStruct((1,), bool))
        else:
            rows, width = key[1:]
            reuse = [(0, 0)] * rows if key[0] in ("reuse", "resume") else None
            padding = self._admission([None] * rows, width, np.full(rows, self.slots, np.int32), reuse=reuse,
                                      kind=key[0])
            jitted, options = self._admit.jitted, {"prompt_scores": False}
            arguments = (params, state, *padding.arguments())
        if self.program_cache is None:
            program = jitted.lower(*arguments, **options).compile()
        else:
            program = self.program_cache.load(key, arguments)
            if program is None:
                program = self.program_cache.compile(key, arguments, jitted.lower(*arguments, **options))
        self._programs[key] = program
        self.compile_seconds += time.perf_counter() - started

    def _first_use(self) -> None:
        for seed in (0, 2**40):  # the host's key derivation, for small and large seeds
            _seed_key(seed)

    def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """Start the engine's thread, which compiles the first programs, sets `ready` and serves, while
        another thread compiles the rest; should the engine's thread fail, `on_failure(error)` is called
        on it, last."""
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="dew-serve-engine", daemon=True)
        self._thread.start()

    def _compile_later(self) -> None:
        try:
            for key in self.later_programs:
                if self._closing:
                    return
                self._compile(key)
            logger.info("compiled all %d programs (%.1f s of compiling)", len(self._programs), self.compile_seconds)
        except Exception:  # noqa: BLE001 - the engine serves on with the programs it has
            logger.exception("compiling the serving programs in the background failed; the compiled ones serve")

    def close(self) -> None:
        """Stop the threads; requests still waiting or running end as "cancelled"."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        if self._compiler is not None:  # it stops after the program it is compiling
            self._compiler.join()

    # -- the engine's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for key in self.first_programs:
                self._compile(key)
            self._first_use()
            self._state = self._state_made.result()
            self.ready.set()
            logger.info("ready: compiled the first %d programs in %.1f s; compiling %d more meanwhile",
                        len(self.first_programs), self.compile_seconds, len(self.later_programs))
            self._compiler = threading.Thread(target=self._compile_later, name="dew-serve-compile", daemon=True)
            self._compiler.start()
            self._loop()
        except BaseException as error:  # noqa: BLE001 - logged here, and handed to on_failure below
            logger.exception("the serving engine stopped")
            self.failure = error
        with self._lock:
            self._closing = True
            left = [*self._waiting, *(owner for owner in self._owners if owner is not None)]
            self._waiting.clear()
            self._owners = [None] * self.slots
        for request in left:
            self._end(request, "cancelled")
        if self.failure is not None and self._on_failure is not None:
            self._on_failure(self.failure)

    def _loop(self) -> None:
        pending = None  # the dispatched step whose tokens are not read yet, and its rows' owners
        while True:
            with self._lock:
                while not self._closing and pending is None and not self._waiting and not self._cancelled \
                        and not self._chunks and all(owner is None for owner in self._owners):
                    self._lock.wait()
                if self._closing:
                    return
                cancelled, self._cancelled = self._cancelled, set()
                for request in cancelled:
                    if request in self._waiting:
                        self._waiting.remove(request)
                admitted = self._take_waiting()
            for request in cancelled:
                self._free(request, release=True)  # its row may still be live on the device
                self._end(request, "cancelled")
            self._place(admitted)
            self._go_on()
            dispatched = None
            used = max((slot + 1 for slot, owner in enumerate(self._owners) if owner is not None), default=0)
            if used:
                # the smallest compiled row count that covers every occupied slot (they fill from slot 0)
                rows = next(r for r in self.step_rows if r >= used and ("step", r) in self._programs)
                release = self._release.copy()
                self._release[:rows] = False  # rows past the step keep theirs for a later, wider step
                self._state, output = self._programs["step", rows](self.params, self._state, release)
                dispatched = (output, list(self._owners[:rows]))
                self.steps += 1
            if pending is not None:
                self._hand_out(*pending)
            pending = dispatched

    def _rows_at(self, width: int) -> tuple[int, ...]:
        """The row counts prompts of `width` positions are prefilled in together."""
        return self.prefill_rows if width <= BATCHED_WIDTH else (1,)

    def _batches(self, width: int, count: int, compiled: bool = True, kind: str = "admit") -> list[int]:
        """The admissions' row counts (padding rows included) that prefill `count` prompts of `width`: the
        fewest rows of the ladder that hold what is left, at most its top, and with `compiled`, at most the
        rows of a compiled admission of `kind` (one row always is, of a plain admission)."""
        ladder, batches = self._rows_at(width), []
        while count > 0:
            rows = next((r for r in ladder if r >= count), ladder[-1])
            if compiled:
                rows = max(r for r in ladder if r <= rows and (kind, r, width) in self._programs)
            batches.append(rows)
            count -= rows
        return batches

    def _take_waiting(self) -> list[tuple[int, Request]]:
        """Pair free slots with waiting requests, first come first served (under the lock)."""
        free = [slot for slot, owner in enumerate(self._owners) if owner is None]
        taken = []
        while free and self._waiting:
            request = self._waiting.popleft()
            slot = free.pop(0)
            self._owners[slot] = request
            self._release[slot] = False  # the admission resets the row
            taken.append((slot, request))
        return taken

    def _place(self, admitted: list[tuple[int, Request]]) -> None:
        """Prefill the admitted requests, grouped by prompt width and media shapes (a count or shape not seen
        before compiles its admission once), in batches of the ladder's sizes; a plain width's last batch
        goes in the padding rows of the next wider one's where they hold it (`_share_padding`). A plain
        prompt longer than the compiled widths is admitted by its head, and its chunks go on (`_go_on`). A
        prompt that begins with what a slot's cache holds, or will once others are in, is prefilled after a
        copy of that beginning (`_waves`)."""
        self.prompt_tokens += sum(len(request.prompt) for _, request in admitted)
        for whole, reusing in self._waves(self._own_slots(admitted)):
            self._place_whole(whole)
            self._place_after(reusing)

    def _place_whole(self, admitted: list[tuple[int, Request]]) -> None:
        by_width: dict[tuple, list[tuple[int, Request]]] = collections.defaultdict(list)
        heads = {}
        for slot, request in admitted:
            plain = request.media is None and request.prompt_log_probs is None
            if plain:  # the narrowest compiled width that holds its head
                heads[slot] = self._head(len(request.prompt))
                width = next(w for w in self.plain_widths if w >= heads[slot] and ("admit", 1, w) in self._programs)
                if heads[slot] < len(request.prompt):
                    self._chunks.append((slot, request, heads[slot]))
            else:
                width = next(w for w in self.widths if w >= len(request.prompt))
            by_width[width, request.media_shape, not plain].append((slot, request))
        counts = {width: len(group) for (width, _, special), group in by_width.items() if not special}
        for width, (wider, moved) in _share_padding(counts, self._batches).items():
            narrow, wide = by_width[width, (), False], by_width[wider, (), False]
            wide.extend(narrow[len(narrow) - moved:])  # the narrow group's last rows fill the wider's padding
            del narrow[len(narrow) - moved:]
        for (width, shapes, special), group in by_width.items():
            while group:
                rows = self._batches(width, len(group), compiled=not special)[0]
                batch, group = group[:rows], group[rows:]
                slots = np.full(rows, self.slots, np.int32)
                slots[: len(batch)] = [slot for slot, _ in batch]
                requests = [request for _, request in batch] + [None] * (rows - len(batch))
                admission = self._admission(requests, width, slots, media=bool(shapes),
                                            heads=None if special else [heads.get(slot) for slot in slots])
                if not special:
                    self._state = self._programs["admit", rows, width](self.params, self._state,
                                                                        *admission.arguments())
                    continue
                if batch[0][1].prompt_log_probs is None:  # media, at counts and shapes not compiled ahead
                    self._state = self._admit(self.params, self._state, admission)
                    continue
                self._state, scores = self._admit(self.params, self._state, admission, prompt_scores=True)
                self._hand_prompt_scores([request for _, request in batch], width, jax.device_get(scores))

    def _place_after(self, reusing: dict[tuple[str, int], list]) -> None:
        """Prefill each of `reusing`'s prompts after the beginning copied from a slot, {(kind, width): [(slot,
        request, the slot copied from, the tokens copied, the tokens in after it)]}: "reuse" for a prompt
        that fits a chunk, "resume" for a longer one, whose chunks go on after (`_go_on`)."""
        for (kind, width), group in reusing.items():
            while group:
                rows = self._batches(width, len(group), kind=kind)[0]
                batch, group = group[:rows], group[rows:]
                slots = np.full(rows, self.slots, np.int32)
                slots[: len(batch)] = [slot for slot, *_ in batch]
                requests = [request for _, request, *_ in batch] + [None] * (rows - len(batch))
                reuse = [(source, prefix) for _, _, source, prefix, _ in batch] + [(0, 0)] * (rows - len(batch))
                heads = [end for *_, end in batch] + [None] * (rows - len(batch))
                admission = self._admission(requests, width, slots, heads=heads, reuse=reuse, kind=kind)
                self._state = self._programs[kind, rows, width](self.params, self._state, *admission.arguments())
                self.reused += sum(prefix for _, _, _, prefix, _ in batch)
                self._chunks += [(slot, request, end) for slot, request, _, _, end in batch if end < len(request.prompt)]

    def _own_slots(self, admitted: list[tuple[int, Request]]) -> list[tuple[int, Request]]:
        """The admitted requests over the same slots, reassigned so that one whose prompt begins with what a
        slot's cache holds takes that slot (a conversation going on), longest beginning first; the others take
        what is left in order."""
        if not self.reuse_prefixes or len(admitted) < 2:
            return admitted
        free = sorted(slot for slot, _ in admitted)
        holding = [slot for slot in free if self._held_lengths[slot]]
        matches = sorted(((self._common(request.prompt, slot), -index, slot, index)
                          for index, (_, request) in enumerate(admitted) for slot in holding), reverse=True)
        placed: dict[int, int] = {}  # request index -> slot
        for common, _, slot, index in matches:
            if common and index not in placed and slot in free:
                placed[index] = slot
                free.remove(slot)
        rest = iter(free)
        assigned = [(placed[index] if index in placed else next(rest), request)
                    for index, (_, request) in enumerate(admitted)]
        with self._lock:
            for slot, request in assigned:
                self._owners[slot] = request
        return assigned

    def _common(self, prompt: Sequence[int], slot: int) -> int:
        """How many of `prompt`'s tokens but its last `slot`'s cache holds from its first position."""
        return _shared(prompt[:-1], self._held[slot, : self._held_lengths[slot]])

    def _waves(self, admitted: list[tuple[int, Request]]) -> list[tuple[list, dict]]:
        """The admitted requests in waves, each (those prefilled whole, those prefilled after a copied
        beginning: `_place_after`'s), a wave's whole ones first; this records what each slot will hold.

        A prompt is prefilled after a copied beginning where that leaves it a narrower width (a compiled
        one): the longest held by a slot not admitted to now, by its own slot still, or by a prompt placed
        earlier (longest prompts first; whole ones this wave, any the wave before). It waits a wave where a
        prompt placed before it this wave begins with more of it than that (at most `WAVES` waves). A prompt
        longer than a chunk goes on after a copied beginning of at least a chunk, its first piece making the
        rest whole chunks."""
        own = self._held_lengths.copy()  # a slot's own earlier tokens may begin its new prompt
        for slot, _ in admitted:  # the rest of what they held is written over
            self._held_lengths[slot] = 0
        pending, waves = sorted(admitted, key=lambda pair: -len(pair[1].prompt)), []
        for wave in range(WAVES):
            whole, reusing, later, before = [], collections.defaultdict(list), [], []
            for slot, request in pending:
                length = len(request.prompt)
                plain = request.media is None and request.prompt_log_probs is None
                if self.reuse_prefixes and plain and length > self.chunk and ("resume", 1, self.chunk) in self._programs:
                    source, prefix = self._longest_held(request.prompt, slot, own[slot])
                    if prefix >= self.chunk:  # at least a chunk saved: the first piece after it makes whole chunks
                        end = length - self.chunk * ((length - prefix - 1) // self.chunk)
                        reusing["resume", self.chunk].append((slot, request, source, prefix, end))
                        continue
                elif self.reuse_prefixes and plain and length <= self.chunk:
                    source, prefix = self._longest_held(request.prompt, slot, own[slot])
                    width = self._narrowest(length - prefix, "reuse")
                    if wave < WAVES - 1 and any(self._narrower(length, _shared(request.prompt, other), width)
                                                for other in before):
                        later.append((slot, request))
                        before.append(request.prompt)
                        continue
                    before.append(request.prompt)
                    if width is not None and width < (self._narrowest(length, "admit") or self.chunk + 1):
                        reusing["reuse", width].append((slot, request, source, prefix, length))
                        continue
                whole.append((slot, request))
                if request.media is None:  # its head is in the slot once its admission has run
                    self._hold(slot, request.prompt[: self._head(length) if plain else length])
            for group in reusing.values():
                for slot, request, *_, end in group:
                    self._hold(slot, request.prompt[:end])
            waves.append((whole, reusing))
            if not later:
                break
            pending = later
        return waves

    def _narrower(self, length: int, shared: int, width: int | None) -> bool:
        """Whether a copied beginning of `shared` tokens leaves a `length`-token prompt a narrower compiled
        width than `width` (None: its whole width)."""
        narrower = self._narrowest(length - min(shared, length - 1), "reuse")
        return narrower is not None and narrower < (width or self._narrowest(length, "admit") or self.chunk + 1)

    def _longest_held(self, prompt: Sequence[int], slot: int, own: int) -> tuple[int, int]:
        """The slot whose cache holds the longest beginning of `prompt` (`slot` itself holding its first `own`
        tokens still) and that beginning's length, leaving the prompt's last token to prefill."""
        tokens = np.asarray(prompt[:-1], np.int32)
        if not len(tokens):
            return slot, 0
        same = self._held[:, : len(tokens)] == tokens
        common = np.where(same.all(axis=1), len(tokens), same.argmin(axis=1))
        held = self._held_lengths.copy()
        held[slot] = own
        common = np.minimum(common, held)
        source = int(np.argmax(common))
        return source, int(common[source])

    def _narrowest(self, length: int, kind: str) -> int | None:
        """The narrowest plain width holding `length` tokens whose one-row program of `kind` is compiled."""
        return next((w for w in self.plain_widths if w >= length and (kind, 1, w) in self._programs), None)

    def _hold(self, slot: int, tokens: Sequence[int], start: int = 0) -> None:
        """Record that `slot`'s cache holds `tokens` from position `start` on (and nothing known after)."""
        self._held[slot, start: start + len(tokens)] = tokens
        self._held_lengths[slot] = start + len(tokens)

    def _head(self, length: int) -> int:
        """How many of a plain prompt's `length` tokens its admission prefills (the rest go on in chunks):
        all that fit a compiled width, else what leaves whole chunks after it, in the narrowest compiled
        width that holds it or the widest compiled."""
        compiled = [w for w in self.plain_widths if ("admit", 1, w) in self._programs]
        if length <= compiled[-1]:
            return length
        head = length - self.chunk * ((length - 1) // self.chunk)
        return min(head, compiled[-1])

    def _go_on(self) -> None:
        """Prefill the next chunk of each prompt that goes on in chunks (one each, between two steps, so
        a long prompt does not stall the rows drawing); one whose request ended is dropped."""
        going_on = []
        for slot, request, done in self._chunks:
            if self._owners[slot] is not request:
                continue
            piece = request.prompt[done: done + self.chunk]
            tokens, valid = np.zeros((1, self.chunk), np.int32), np.zeros((1, self.chunk), np.int32)
            tokens[0, self.chunk - len(piece):], valid[0, self.chunk - len(piece):] = piece, 1
            last = done + len(piece) == len(request.prompt)
            self._state = self._programs["extend", self.chunk](self.params, self._state, tokens, valid,
                                                               np.array([slot], np.int32), np.array([last]))
            if self._held_lengths[slot] == done:
                self._hold(slot, piece, done)
            if not last:
                going_on.append((slot, request, done + len(piece)))
        self._chunks = going_on

    def _admission(self, requests: list[Request | None], width: int, slots: np.ndarray,
                   media: bool = False, heads: list[int] | None = None,
                   reuse: list[tuple[int, int]] | None = None, kind: str = "admit") -> Admission:
        """The admission of `requests` (None: a padding row) at `width`, of the first `heads[r]` tokens of
        row r's prompt (all when not given; fewer hold the row back for its chunks). With `reuse`, row r's
        first `reuse[r][1]` tokens are copied from slot `reuse[r][0]`'s cache, and the rest are prefilled, in
        a cache of the chunk's positions ("reuse") or every position ("resume")."""
        rows = len(requests)
        tokens, valid = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
        held = np.zeros(rows, bool)
        seed_keys = np.zeros((rows, 2), np.uint32)
        prompt_index, continuation, budget = (np.zeros(rows, np.int32) for _ in range(3))
        scored = np.zeros(rows, bool)
        policies = []
        for r, request in enumerate(requests):
            if request is None:  # a padding row: prefilled (nothing valid), then dropped
                policies.append(Sampling())
                continue
            length = len(request.prompt) if heads is None or heads[r] is None else heads[r]
            held[r] = length < len(request.prompt)
            begun = 0 if reuse is None else reuse[r][1]
            tokens[r, width - length + begun:], valid[r, width - length + begun:] = request.prompt[begun:length], 1
            seed_keys[r] = _seed_key(request.seed)
            prompt_index[r], continuation[r], budget[r] = request.prompt_index, request.continuation, request.max_tokens
            scored[r] = request.log_probs is not None
            policies.append(request.sampling)
        sampling = plain_sampling(SamplingParams.of(policies))  # only the values travel; the flags stay fixed
        media = _media(requests, width) if media else None
        begun = None
        if reuse is not None:
            positions = self.capacity if kind == "resume" else self.chunk
            prompts, prompts_valid = np.zeros((rows, positions), np.int32), np.zeros((rows, positions), np.int32)
            for r, request in enumerate(requests):
                if request is not None:
                    prompts[r, : len(request.prompt)], prompts_valid[r, : len(request.prompt)] = request.prompt, 1
            sources, prefix = (np.array(column, np.int32) for column in zip(*reuse))
            begun = Reuse(sources, prefix, prompts, prompts_valid)
        return Admission(tokens, valid, slots, seed_keys, prompt_index, continuation, sampling, budget, scored, held,
                         media, begun)

    def _hand_prompt_scores(self, requests: list[Request], width: int, scores) -> None:
        """Give each request its prompt positions' scores (row r of `scores`, host arrays `[rows, width]`)."""
        for r, request in enumerate(requests):
            first = width - len(request.prompt)
            entries = [Scored(request.prompt[0], None, ())] + [_scored(scores, (r, p), request.prompt_log_probs, request.prompt[p - first])
                                for p in range(first + 1, width)]
            self._give_scores(request, entries)

    def _give_scores(self, request: Request, entries: list) -> None:
        try:
            request.consumer.scores(entries)
        except Exception:  # noqa: BLE001 - one consumer's fault must not stop the others
            logger.exception("a request's consumer failed")

    def _hand_out(self, output, owners: list[Request | None]) -> None:
        """Give each live row's token to the request that owned the row when the step was dispatched."""
        tokens_B, live_B, done_B = (np.asarray(x) for x in jax.device_get((output.tokens_B, output.live_B,
                                                                              output.done_B)))
        scores = None
        if any(request is not None and request.log_probs is not None for request in owners):
            scores = jax.device_get(output.scores)
        for slot, request in enumerate(owners):
            if request is None or request.ended or not live_B[slot]:
                continue
            token = int(tokens_B[slot])
            if self._held_lengths[slot] == len(request.prompt) + request.drawn < self.capacity:
                self._hold(slot, (token,), int(self._held_lengths[slot]))  # fed back: its keys are in the cache
            request.drawn += 1
            if request.log_probs is not None:
                self._give_scores(request, [_scored(scores, (slot,), request.log_probs, token)])
            if token in self.eos:
                self._free(request)
                self._end(request, "stop")
            elif request.consumer.token(token):
                self._free(request, release=True)
                self._end(request, "stop")
            elif done_B[slot]:
                self._free(request)
                self._end(request, "length")

    def _free(self, request: Request, release: bool = False) -> None:
        """Give `request`'s slot back (`release`: the device row is still live, stop it next step)."""
        with self._lock:
            for slot, owner in enumerate(self._owners):
                if owner is request:
                    self._owners[slot] = None
                    self._release[slot] = release or self._release[slot]

    def _end(self, request: Request, reason: str) -> None:
        if request.ended:
            return
        request.ended = True
        try:
            request.consumer.finish(reason, request.drawn)
        except Exception:  # noqa: BLE001 - one consumer's fault must not stop the others
            logger.exception("a request's consumer failed")


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` begin with alike."""
    n = min(len(a), len(b))
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(same.argmin())


def _scored(scores, where: tuple[int, ...], alternatives: int, token: int) -> Scored:
    """The `Scored` entry at index `where` of host `Scores`, with its first `alternatives` alternatives."""
    top = zip(scores.top_ids[where][:alternatives].tolist(), scores.top_log_probs[where][:alternatives].tolist())
    return Scored(token, float(scores.log_prob[where]), tuple(top))


def _media(requests: list[Request | None], width: int) -> dict:
    """The slot fields of rows left-padded to `width` slots (-1 before a prompt; rotary positions 0, which no
    real slot reads and which leave the row's rotary delta to its real slots) and the conditioning of rows
    that share its shapes (a padding row's is zeros, Qwen 3.5's grids too)."""
    rows = len(requests)
    first = next(r.media for r in requests if r is not None)
    media = {}
    for name, value in first.items():
        if name in SLOTTED:
            media[name] = np.full((rows, width, *np.shape(value)[1:]), 0 if name == "rotary_positions" else -1,
                                  np.int32)
        else:
            media[name] = np.zeros((rows, *np.shape(value)), np.asarray(value).dtype)
    for r, request in enumerate(requests):
        if request is None:
            continue
        length = len(request.prompt)
        for name in media:
            if name in SLOTTED:
                media[name][r, width - length:] = request.media[name]
            else:
                media[name][r] = request.media[name]
    return media


def _check_memory(model, params, slots: int, capacity: int) -> None:
    """Refuse slots whose resident state (`row_bytes` each: a cache of `capacity` positions, vocabulary-wide
    rows) would not fit beside the weights in `memory()`, before any of it is allocated."""
    per_slot = row_bytes(model, capacity, 0)
    free, available, where = memory_beside(params)
    if slots * per_slot <= free:
        return
    gib = lambda count: f"{count / 2**30:,.1f} GiB"  # noqa: E731
    raise ValueError(f"{slots} slots of {capacity} positions would hold {gib(slots * per_slot)} ({per_slot:,} bytes a "
                     f"slot), more than the {gib(free)} the weights leave of {where} ({gib(available)}): serve at "
                     f"most {max(free, 0) // per_slot} slots (dew serve --slots) or fewer positions (--capacity)")


def _share_padding(counts: dict[int, int], batches: Callable[[int, int], list[int]]) -> dict[int, int]:
    """Which prompts to admit in the padding rows of a wider width's last admission: `counts` holds the
    prompts at each width, `batches(width, count)` the row counts of the admissions that take them. A
    width's last admission moves up whole into the next wider width's last one where that one's padding
    rows hold it: the same rows prefilled, in one call fewer. {width: (the wider width, prompts moved)}."""
    counts, moved = dict(counts), {}
    widths = sorted(width for width, count in counts.items() if count)
    for width, wider in zip(widths, widths[1:]):
        last = counts[width] - sum(batches(width, counts[width])[:-1])
        if last <= sum(batches(wider, counts[wider])) - counts[wider]:
            counts[width], counts[wider] = counts[width] - last, counts[wider] + last
            moved[width] = wider, last
    return moved


def _widths(capacity: int) -> tuple[int, ...]:
    """The prompt widths: 16, 32, 64, then 96, 128, 192, 256, 384 ... (each at most 1.5 times the one
    before, so a prompt pays for at most a third of its width in padding), then `capacity`."""
    sizes = [PROMPT_BUCKET]
    while sizes[-1] < capacity:
        step = sizes[-1] if sizes[-1] < 64 else 2 ** (sizes[-1].bit_length() - 1) // 2  # 64 -> 96 -> 128 -> 192
        sizes.append(min(sizes[-1] + step, capacity))
    return tuple(sizes)


def _ladder(first: int, last: int) -> tuple[int, ...]:
    """first, 2 first, 4 first ... while below `last`, then `last`."""
    sizes = [first]
    while sizes[-1] < last:
        sizes.append(min(sizes[-1] * 2, last))
    return tuple(sizes)


def _state_sharding(params) -> jax.sharding.Sharding:
    """Where the slots' state lives: replicated over the mesh `params` are placed on (as the compiled calls
    return it, so the first call does not compile once more for another placement), else on their device."""
    sharding = jax.tree_util.tree_leaves(params)[0].sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return SingleDeviceSharding(min(sharding.device_set, key=lambda device: device.id))


def _in_background(make: Callable[[], object], name: str) -> concurrent.futures.Future:
    """`make()` run on a daemon thread named `name`; the future holds its result, or the error it raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(make())
        except BaseException as error:  # noqa: BLE001 - handed to whoever takes the result
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _seed_key(seed: int) -> np.ndarray:
    """The uint32 key data of `jax.random.key(seed)`, as `generate` derives a request's key."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)))
