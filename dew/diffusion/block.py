"""`BlockProcess`: DiffusionGemma's block generation, one canvas after another.

Each canvas of `canvas_length` tokens starts as uniform draws from the vocabulary and is refined for at
most `max_steps` denoiser evaluations. At step n of N (counted down from N), the logits are divided by
the temperature `t_min + (t_max - t_min) n / N`; a token is drawn at every position, and the positions
whose entropies, taken in ascending order, keep the running sum minus its largest term within
`entropy_bound` accept their draw (the lowest-entropy position always does); every other position is
drawn afresh from the vocabulary. The tempered logits condition the next evaluation. A row stops refining
once its argmax canvas has not changed for `stability_threshold` steps and its mean entropy is below
`confidence_threshold`; a stopped row keeps its canvas. The argmax canvas is then the row's clean block:
it is committed to the prefix cache (the encoder reads it as text) and the next canvas follows. Rows stop
after a canvas holding an EOS id; generation stops when every row has. The last canvas is refined at full
width and the response cut to `max_new_tokens`, so the prompt plus the canvases, rounded up to whole
canvases, must fit in the model's `max_seq_len`. A prompt's images (`media`) are encoded once, in the call
that writes the prompt into the cache; committed canvases and every refinement read their keys and values
there.

Random draws: canvas `b` uses `jax.random.fold_in(key, b)`, split into the first canvas's key (`noise`)
and one key per step (split again into the draw's and the renoising's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.diffusion.canvas import CanvasGeneration, assemble
from dew.nn.diffusion_gemma import PrefixCache

F32 = jnp.float32
_PROMPT_BUCKET = 16
# generation_config.json fields of transformers' DiffusionGemmaGenerationConfig and the BlockProcess field each sets.
GENERATION_FIELDS = {"max_denoising_steps": "max_steps", "t_min": "t_min", "t_max": "t_max",
                     "stability_threshold": "stability_threshold", "confidence_threshold": "confidence_threshold"}
# What `generate`'s media hold: the conditioning of the prompts' rows, and per prompt one value a prompt id.
MEDIA_CONDITIONING = ("pixel_values", "image_position_ids")
MEDIA_FIELDS = ("image_indices", "image_groups")
# Fields the task reads elsewhere (budget, ids) or that change nothing Dew computes.
SHARED_GENERATION = frozenset({"max_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id", "transformers_version",
                               "_from_model_config", "_commit_hash", "return_dict_in_generate", "disable_compile",
                               "cache_implementation", "cache_config"})


def entropy(logits):
    """Entropy (nats, float32) of the categorical each row of `logits [..., V]` gives."""
    log_probs = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def uniform_canvas(key, rows: int, canvas_length: int, vocab_size: int):
    """int32 `[rows, canvas_length]` drawn uniformly from `[0, vocab_size)`."""
    return jax.random.randint(key, (rows, canvas_length), 0, vocab_size, jnp.int32)


def accepted(entropy_BC, bound: float):
    """Positions `[B, C]` that accept their draw: in ascending entropy order, those whose running sum minus
    the largest entropy so far (its own) stays within `bound`."""
    order_BC = jnp.argsort(entropy_BC, axis=-1, stable=True)
    sorted_BC = jnp.take_along_axis(entropy_BC, order_BC, axis=-1)
    keep_sorted = jnp.cumsum(sorted_BC, axis=-1) - sorted_BC <= bound
    rows = jnp.arange(entropy_BC.shape[0])[:, None]
    return jnp.zeros(entropy_BC.shape, bool).at[rows, order_BC].set(keep_sorted)


@dataclasses.dataclass(frozen=True)
class BlockProcess:
    """DiffusionGemma's block sampler (see the module): canvas length, vocabulary, the temperature's
    range `t_max` (first step) to `t_min`, the entropy bound, the step limit and the stopping thresholds.
    The defaults are transformers'; a checkpoint's generation_config.json sets its own (`from_generation`)."""

    canvas_length: int
    vocab_size: int
    t_max: float = 0.8
    t_min: float = 0.4
    entropy_bound: float = 0.1
    max_steps: int = 48
    stability_threshold: int = 1
    confidence_threshold: float = 0.005

    def __post_init__(self):
        for name in ("canvas_length", "vocab_size", "max_steps"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"BlockProcess {name} is {value!r}; it must be a whole number of at least 1")
        if not 0 <= self.t_min < self.t_max:
            raise ValueError(f"BlockProcess temperatures t_min {self.t_min} and t_max {self.t_max}: they need "
                             "0 <= t_min < t_max (the temperature falls from t_max at the first step to t_min)")
        if not self.entropy_bound > 0:
            raise ValueError(f"BlockProcess entropy_bound is {self.entropy_bound}; it must be above 0")
        if not isinstance(self.stability_threshold, (int, np.integer)) or self.stability_threshold < 0:
            raise ValueError(f"BlockProcess stability_threshold is {self.stability_threshold!r}; it counts steps, "
                             "a whole number >= 0 (0: stability is not required)")
        if not self.confidence_threshold > 0:
            raise ValueError(f"BlockProcess confidence_threshold is {self.confidence_threshold}; it must be above 0")

    @classmethod
    def from_generation(cls, generation: Mapping[str, Any] | None, canvas_length: int, vocab_size: int,
                        where: str = "generation_config.json") -> "BlockProcess":
        """The process a checkpoint's generation_config.json asks for (null fields keep the defaults);
        a field the block sampler cannot follow is refused by name."""
        settings = {}
        for name, value in (generation or {}).items():
            if name in SHARED_GENERATION:
                continue
            if name == "sampler_config":
                settings.update(_sampler(value, where))
            elif name in GENERATION_FIELDS:
                if value is not None:
                    settings[GENERATION_FIELDS[name]] = value
            else:
                raise ValueError(f"{where} sets {name}={value!r}, which DiffusionGemma's block sampler does not "
                                 f"follow: it reads {sorted(GENERATION_FIELDS)} and sampler_config; remove it")
        return cls(canvas_length, vocab_size, **settings)

    def noise(self, key, rows: int):
        """int32 `[rows, canvas_length]` drawn uniformly from the vocabulary (a canvas's first state)."""
        return uniform_canvas(key, rows, self.canvas_length, self.vocab_size)

    def refine(self, model, variables, cache: PrefixCache, key):
        """Refine one canvas after `cache` (see the module): the argmax canvas int32 `[B, C]` and the
        evaluations each row took. Compiled once per model and stability threshold: the other settings
        are traced, so a `process=` override does not compile again."""
        return _compiled(model, self.canvas_length, self.vocab_size, self.stability_threshold)[1](
            variables, cache, key, self._settings())

    def _settings(self) -> dict:
        return {name: jnp.asarray(getattr(self, name), jnp.int32 if name == "max_steps" else F32)
                for name in ("t_max", "t_min", "entropy_bound", "max_steps", "confidence_threshold")}

    def generate(self, model, variables, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, key,
                 eos_token_ids: Sequence[int] = (), pad_id: int = 0, decode=None,
                 media: Mapping[str, Any] | None = None) -> CanvasGeneration:
        """Generate `max_new_tokens` after each prompt (lists of ids, one row each; shorter ones are
        padded before their first token, and positions count from each row's first token).

        `media` gives the prompts' images, for a model with a vision tower: `pixel_values` and
        `image_position_ids` (a row per prompt, as the checkpoint's processor lays them out) and, per prompt,
        `image_indices` and `image_groups` (one value per prompt id: the soft token it reads and the image
        behind it, -1 for text; `DiffusionGemma.encode`)."""
        config = model.config
        if config.canvas_length != self.canvas_length or config.vocab_size != self.vocab_size:
            raise ValueError(f"BlockProcess canvas_length {self.canvas_length} and vocab_size {self.vocab_size} do "
                             f"not match the model's {config.canvas_length} and {config.vocab_size}: build it from "
                             "the model's")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens is {max_new_tokens!r}; it must be a whole number >= 0")
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token (DiffusionGemma's canvases follow a clean prefix)")
        ids = np.concatenate([np.asarray(prompt, np.int64) for prompt in prompts])
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt token id {int(ids.max() if ids.max() >= self.vocab_size else ids.min())} is "
                             f"outside the vocabulary [0, {self.vocab_size}): encode prompts with the model's tokenizer")
        rows, longest, C = len(prompts), max(len(p) for p in prompts), self.canvas_length
        _check_media(media, prompts, config)
        canvases = math.ceil(max_new_tokens / C)
        if longest + canvases * C > config.max_seq_len:
            raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones in whole canvases of {C} "
                             f"({canvases * C}) is {longest + canvases * C} positions, past the model's max_seq_len "
                             f"{config.max_seq_len}: shorten the prompt, ask for fewer tokens, or load with a larger "
                             "max_seq_len")
        responses = np.full((rows, canvases * C), pad_id, np.int32)
        evaluations = np.zeros((rows,), np.int32)
        if canvases:
            # prompts padded to a multiple of 16 and the cache to a power of two, so that calls of nearby
            # lengths share compiled code; positions count from each row's first token, so padding changes nothing
            width = -(-longest // _PROMPT_BUCKET) * _PROMPT_BUCKET
            tokens = np.full((rows, width), pad_id, np.int32)
            valid = np.zeros((rows, width), bool)
            for row, prompt in enumerate(prompts):
                tokens[row, width - len(prompt):], valid[row, width - len(prompt):] = prompt, True
            prefill = {}
            if media is not None:
                prefill = {name: jnp.asarray(media[name]) for name in MEDIA_CONDITIONING}
                for name in MEDIA_FIELDS:
                    field = np.full((rows, width), -1, np.int32)
                    for row, values in enumerate(media[name]):
                        field[row, width - len(values):] = values
                    prefill[name] = jnp.asarray(field)
            encode = _compiled(model, self.canvas_length, self.vocab_size, self.stability_threshold)[0]
            cache = PrefixCache.empty(config, rows, 1 << (width + (canvases - 1) * C - 1).bit_length())
            _, cache = encode(variables, jnp.asarray(tokens), jnp.asarray(valid), cache, 0, prefill)
            finished = np.zeros((rows,), bool)
            eos = np.asarray(tuple(eos_token_ids), np.int64)
            for block in range(canvases):
                best, used = self.refine(model, variables, cache, jax.random.fold_in(key, block))
                best = np.asarray(best)
                responses[~finished, block * C:(block + 1) * C] = best[~finished]
                evaluations += np.where(finished, 0, np.asarray(used))
                if len(eos):
                    finished |= np.isin(best, eos).any(axis=1)
                if finished.all() or block == canvases - 1:
                    break
                _, cache = encode(variables, jnp.asarray(best), jnp.ones((rows, C), bool), cache, width + block * C,
                                  {})
        result = assemble(prompts, responses[:, :max_new_tokens], 0, eos_token_ids, pad_id, decode)
        return dataclasses.replace(result, refinements=evaluations)


def _check_media(media: Mapping[str, Any] | None, prompts: Sequence[Sequence[int]], config) -> None:
    """Refuse media a model without a vision tower cannot read, or whose parts do not line up with the prompts."""
    if media is None:
        return
    if getattr(config, "vision", None) is None:
        raise ValueError("media were given, and this DiffusionGemma has no vision tower: leave them out")
    names = sorted(media)
    if names != sorted(MEDIA_CONDITIONING + MEDIA_FIELDS):
        raise ValueError(f"media hold {names}; block generation reads {sorted(MEDIA_CONDITIONING + MEDIA_FIELDS)}, as "
                         "the checkpoint's processor writes them")
    for name in MEDIA_CONDITIONING:
        if np.shape(media[name])[0] != len(prompts):
            raise ValueError(f"media {name} has {np.shape(media[name])[0]} row(s) for {len(prompts)} prompt(s): give "
                             "one row per prompt")
    for name in MEDIA_FIELDS:
        lengths = [len(values) for values in media[name]]
        if lengths != [len(prompt) for prompt in prompts]:
            raise ValueError(f"media {name} have lengths {lengths} for prompts of {[len(p) for p in prompts]} ids: "
                             "give one value per prompt id")


def _sampler(value, where: str) -> dict:
    """The entropy bound of transformers' `sampler_config` record (EntropyBoundSamplerConfig)."""
    if value is None:
        return {}
    fields = dict(value)
    kind = fields.pop("_cls_name", "EntropyBoundSamplerConfig")
    if kind != "EntropyBoundSamplerConfig" or set(fields) - {"entropy_bound"}:
        raise ValueError(f"{where} sets sampler_config={value!r}: Dew's block sampler is the entropy-bound one "
                         "(EntropyBoundSamplerConfig, whose one field is entropy_bound)")
    return {"entropy_bound": fields["entropy_bound"]} if fields.get("entropy_bound") is not None else {}


def _refine(model, variables, cache: PrefixCache, key, settings: dict, canvas_length: int, vocab_size: int,
            stability_threshold: int):
    """`BlockProcess.refine` with the numeric settings traced (see the module for the algorithm)."""
    B, C, V = cache.length_B.shape[0], canvas_length, vocab_size
    steps = settings["max_steps"]
    noise = lambda key: uniform_canvas(key, B, C, V)
    first_key, steps_key = jax.random.split(key)
    denoise = lambda *args: model.apply(variables, *args, method=model.denoise)
    start = dict(step=steps, canvas=noise(first_key), best=jnp.zeros((B, C), jnp.int32),
                 tempered=jnp.zeros((B, C, V), F32), history=jnp.full((max(stability_threshold, 1), B, C), -1, jnp.int32),
                 done=jnp.zeros((B,), bool), evaluations=jnp.zeros((B,), jnp.int32))

    def step(state):
        conditioned = jnp.broadcast_to(state["step"] < steps, (B,))
        logits = denoise(state["canvas"], cache, state["tempered"], conditioned)
        temperature = settings["t_min"] + (settings["t_max"] - settings["t_min"]) * (
            state["step"].astype(F32) / steps.astype(F32))
        tempered = logits / temperature
        draw_key, renoise_key = jax.random.split(jax.random.fold_in(steps_key, state["step"]))
        drawn = jax.random.categorical(draw_key, tempered, axis=-1).astype(jnp.int32)
        keep = accepted(entropy(tempered), settings["entropy_bound"])
        canvas = jnp.where(keep, drawn, noise(renoise_key))
        best = jnp.argmax(tempered, axis=-1).astype(jnp.int32)
        done = state["done"]
        best = jnp.where(done[:, None], state["best"], best)
        canvas = jnp.where(done[:, None], state["canvas"], canvas)
        tempered = jnp.where(done[:, None, None], state["tempered"], tempered)
        if stability_threshold == 0:
            stable, history = jnp.ones((B,), bool), state["history"]
        else:
            stable = jnp.all(state["history"] == best[None], axis=(0, 2))
            history = jnp.concatenate([state["history"][1:], best[None]], axis=0)
        confident = jnp.mean(entropy(tempered), axis=-1) < settings["confidence_threshold"]
        return dict(step=state["step"] - 1, canvas=canvas, best=best, tempered=tempered, history=history,
                    done=done | (stable & confident), evaluations=state["evaluations"] + (~done).astype(jnp.int32))

    going = lambda state: (state["step"] >= 1) & ~jnp.all(state["done"])
    final = jax.lax.while_loop(going, step, start)
    return final["best"], final["evaluations"]


_COMPILED: dict = {}


def _compiled(model, canvas_length: int, vocab_size: int, stability_threshold: int):
    """The jitted encoder call and canvas refinement for a model and the sampler's shapes (kept while the
    program runs)."""
    key = (model, canvas_length, vocab_size, stability_threshold)
    if key not in _COMPILED:
        encode = jax.jit(lambda variables, tokens, valid, cache, start, media: model.apply(
            variables, tokens, valid, cache, start, **media, method=model.encode))
        refine = jax.jit(lambda variables, cache, key, settings: _refine(
            model, variables, cache, key, settings, canvas_length, vocab_size, stability_threshold))
        _COMPILED[key] = (encode, refine)
    return _COMPILED[key]


__all__ = ["BlockProcess", "accepted", "entropy"]
