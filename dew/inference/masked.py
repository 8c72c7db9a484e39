"""`MaskedGeneration`: a masked-diffusion decoder bound to its weights, process, tokenizer and budget."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dew.diffusion.canvas import CanvasGeneration
from dew.inference.text import encode_prompts

# generation_config.json fields masked generation reads (the budget, EOS, padding) or that change nothing.
_SHARED_GENERATION = frozenset({"max_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id", "mask_token_id",
                                "transformers_version", "_from_model_config"})
# Controls native MDLM cannot follow, each with the values that ask for what it does anyway.
_NEUTRAL_GENERATION = {
    "temperature": (None, 1.0), "top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0),
    "typical_p": (None, 1.0), "repetition_penalty": (None, 1.0), "num_beams": (None, 1), "do_sample": (None, True),
    "use_cache": (None, False), "num_return_sequences": (None, 1),
}
# What an autoregressive task takes that unmasking has no use for, by kind, for the refusal.
_AUTOREGRESSIVE = {
    "sampling": "sampling", "temperature": "sampling", "top_k": "sampling", "top_p": "sampling",
    "min_p": "sampling", "repetition_penalty": "sampling", "do_sample": "sampling", "on_token": "streaming",
    "num_beams": "beam", "length_penalty": "beam", "early_stopping": "beam", "num_beam_groups": "beam",
    "logits_processor": "logits", "bad_words_ids": "logits", "suppress_tokens": "logits",
    "sequence_bias": "logits", "no_repeat_ngram_size": "logits", "guidance_scale": "logits",
}

AUTOREGRESSIVE_CONTROLS = _AUTOREGRESSIVE  # shared with block generation (dew.inference.block)


@dataclasses.dataclass(frozen=True)
class MaskedGeneration:
    """Generate from a masked-diffusion `model` with `params` by unmasking: `task(prompts, max_new_tokens,
    seed=0, n=1, steps=None)` returns a `CanvasGeneration`.

    It runs the native MDLM sampler of `process` (a `dew.diffusion.DiscreteProcess`; 64 model
    evaluations unless `steps` asks otherwise), not a checkpoint's own remasking recipe. Prompts are
    a string, a list of strings (encoded with `tokenizer`), a list of ids, a list of such lists, or
    a `ModelInputs`. `max_new_tokens` defaults to the task's own budget. `eos_token_ids` cut each
    response after its first EOS once refinement is done; `pad_id` fills what follows. Set them with
    `dataclasses.replace(task, eos_token_ids=(...))`.

    Autoregressive sampling, beam and logits controls are refused by name. There is no KV cache:
    `use_cache=False` is accepted, `use_cache=True` refused.
    """

    model: Any
    params: Any
    process: Any
    tokenizer: Any = None
    max_new_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        self.process.check_model(self.model)

    def encode(self, prompts) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts)

    def __call__(self, prompts, max_new_tokens: int | None = None, *, seed: int = 0, n: int = 1,
                 key: jax.Array | None = None, steps: int | None = None, use_cache: bool = False,
                 **controls) -> CanvasGeneration:
        for name, value in controls.items():
            if name not in _AUTOREGRESSIVE:
                raise TypeError(f"MaskedGeneration got an unexpected keyword {name}={value!r}; it takes seed, n, key, "
                                "steps and use_cache=False")
            raise ValueError(
                f"{name}={value!r} is an autoregressive {_AUTOREGRESSIVE[name]} control, and masked diffusion does "
                f"not decode token by token: it unmasks every position together with MDLM's sampler, whose one "
                f"setting is steps=; drop {name}"
            )
        if use_cache:
            raise ValueError("use_cache=True: masked diffusion keeps no KV cache (every evaluation reads the whole "
                             "canvas in both directions); leave use_cache unset or False")
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if budget is None:
            raise ValueError("this task has no default budget: pass max_new_tokens")
        key = jax.random.key(seed) if key is None else key
        decode = None if self.tokenizer is None else self.tokenizer.decode
        return self.process.generate(self.model, self.params, self.encode(prompts), budget, key=key, steps=steps,
                                     n=n, eos_token_ids=self.eos_token_ids, pad_id=self.pad_id, decode=decode)

    def with_sampling(self, sampling) -> "MaskedGeneration":
        """Refused: masked diffusion has no autoregressive sampling policy to replace."""
        raise ValueError(f"with_sampling({sampling}): masked diffusion does not sample token by token, so it has "
                         "no autoregressive policy to replace; pass steps= to the call to change its sampler")


def from_checkpoint(bundle, process) -> MaskedGeneration:
    """A loaded masked-diffusion checkpoint (a `dew.interop.Pretrained`) as a `MaskedGeneration` with native
    MDLM's `process`: the checkpoint's tokenizer, budget, EOS and padding ids.

    generation_config.json may hold the budget, EOS and padding metadata, and sampling controls at the
    values that ask for what MDLM does anyway (temperature 1, no filtering, one beam, no cache); any
    other control, a source's own remasking recipe among them (LLaDA's `remasking`, Dream's `alg`), is
    refused by name, since native MDLM would not follow it.
    """
    for name, value in (bundle.generation_config or {}).items():
        if name in _SHARED_GENERATION or value in _NEUTRAL_GENERATION.get(name, ()):
            continue
        why = (f"the values native MDLM follows are {list(_NEUTRAL_GENERATION[name])}" if name in _NEUTRAL_GENERATION
               else "Dew runs native MDLM's sampler, not a checkpoint's own remasking or decoding recipe")
        raise ValueError(f"{bundle.directory}/generation_config.json sets {name}={value!r}, which masked generation "
                         f"cannot follow: {why}; remove it to generate with MDLM (steps= sets its evaluations)")
    return MaskedGeneration(bundle.model, bundle.variables, process, tokenizer=bundle.tokenizer,
                            max_new_tokens=bundle.max_new_tokens, eos_token_ids=bundle.generation.eos_token_ids,
                            pad_id=bundle.generation.pad_id)
