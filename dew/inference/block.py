"""`BlockGeneration`: a DiffusionGemma model bound to its weights, block process, tokenizer and budget."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from dew.data.inputs import ModelInputs
from dew.diffusion.block import MEDIA_CONDITIONING, MEDIA_FIELDS, BlockProcess
from dew.diffusion.canvas import CanvasGeneration
from dew.inference.masked import AUTOREGRESSIVE_CONTROLS
from dew.inference.text import encode_prompts


@dataclasses.dataclass(frozen=True)
class BlockGeneration:
    """Generate from a DiffusionGemma `model` with `variables` canvas by canvas: `task(inputs,
    max_new_tokens=None, *, key=None, seed=0, process=None)` returns a `CanvasGeneration`.

    `inputs` is a `ModelInputs` (from the checkpoint's processor: its `attention_mask` marks each row's
    tokens, padding before them; with images, their `pixel_values` and the fields that place them, which run
    at the prompt's prefill only), a string or list of strings (encoded with `tokenizer`), a list of ids
    or a list of such lists. `process` (a `dew.diffusion.block.BlockProcess`) replaces the checkpoint's
    defaults for one call; `max_new_tokens` defaults to the task's budget. EOS ids end a row after the
    canvas that holds one; its response is cut after the first and padded with `pad_id`.
    Autoregressive sampling, beam and logits controls are refused by name.
    """

    model: Any
    variables: Any
    process: BlockProcess
    tokenizer: Any = None
    max_new_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    def __call__(self, inputs, max_new_tokens: int | None = None, *, key: jax.Array | None = None, seed: int = 0,
                 process: BlockProcess | None = None, **controls) -> CanvasGeneration:
        for name, value in controls.items():
            if name not in AUTOREGRESSIVE_CONTROLS:
                raise TypeError(f"BlockGeneration got an unexpected keyword {name}={value!r}; it takes key, seed and "
                                "process (a BlockProcess)")
            raise ValueError(f"{name}={value!r} is an autoregressive {AUTOREGRESSIVE_CONTROLS[name]} control, and "
                             "DiffusionGemma refines whole canvases: pass process=BlockProcess(...) to change its "
                             f"sampler; drop {name}")
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if budget is None:
            raise ValueError("this task has no default budget: pass max_new_tokens")
        process = self.process if process is None else process
        if not isinstance(process, BlockProcess):
            raise TypeError(f"process is {type(process).__name__}; pass a dew.diffusion.block.BlockProcess")
        key = jax.random.key(seed) if key is None else key
        decode = None if self.tokenizer is None else self.tokenizer.decode
        return process.generate(self.model, self.variables, self.prompts(inputs), budget, key=key,
                                eos_token_ids=self.eos_token_ids, pad_id=self.pad_id, decode=decode,
                                media=self.media(inputs))

    def prompts(self, inputs) -> list[list[int]]:
        """Each row's prompt ids, from any input the call takes."""
        if not isinstance(inputs, ModelInputs):
            return encode_prompts(self.tokenizer, inputs)
        tokens = np.asarray(inputs.tokens)
        return [[int(t) for t in row[keep]] for row, keep in zip(tokens, _real(inputs))]

    def media(self, inputs) -> dict | None:
        """The images of a `ModelInputs` as `BlockProcess.generate` takes them (None without any): its conditioning,
        and each row's image fields over its real tokens. Fields DiffusionGemma does not read are refused by name,
        and so are positions other than each real token's count from its row's first (the encoder's own)."""
        if not isinstance(inputs, ModelInputs):
            return None
        unknown = sorted(set(inputs.token_fields) - {"attention_mask", "positions", *MEDIA_FIELDS})
        unknown += sorted(set(inputs.conditioning) - set(MEDIA_CONDITIONING))
        if unknown:
            raise ValueError(f"these inputs carry {unknown}, which DiffusionGemma does not read: it takes token ids, "
                             f"attention_mask and positions, and images ({list(MEDIA_FIELDS + MEDIA_CONDITIONING)}); "
                             "transformers' DiffusionGemma has no audio or video tower")
        real = _real(inputs)
        if "positions" in inputs.token_fields:
            positions = np.asarray(inputs.token_fields["positions"])
            for row, keep in enumerate(real):
                if not np.array_equal(positions[row][keep], np.arange(int(keep.sum()))):
                    raise ValueError(f"positions of row {row} are {positions[row][keep].tolist()}; DiffusionGemma's "
                                     "encoder counts each real token's position from its row's first: leave them out")
        fields = {name: np.asarray(inputs.token_fields[name]) for name in MEDIA_FIELDS if name in inputs.token_fields}
        if not inputs.conditioning:
            placed = sorted(name for name, values in fields.items() if (values[real] >= 0).any())
            if placed:
                raise ValueError(f"{placed} place images, and these inputs carry no pixel_values: pass the "
                                 "processor's whole output")
            return None
        missing = sorted(set(MEDIA_FIELDS + MEDIA_CONDITIONING) - set(fields) - set(inputs.conditioning))
        if missing:
            raise ValueError(f"these images come without {missing}: pass the processor's whole output")
        return {**{name: np.asarray(inputs.conditioning[name]) for name in MEDIA_CONDITIONING},
                **{name: [values[row][keep] for row, keep in enumerate(real)] for name, values in fields.items()}}

    def decode(self, generated: CanvasGeneration) -> list[str]:
        """Each row's response (without the prompt) as text, through the checkpoint's tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this task has no tokenizer: read the ids in generated.continuations()")
        return [self.tokenizer.decode(ids) for ids in generated.continuations()]


def _real(inputs: ModelInputs) -> np.ndarray:
    """Which slots of `inputs` hold a token, `[B, S]` (all of them without an `attention_mask`)."""
    tokens = np.asarray(inputs.tokens)
    return np.asarray(inputs.token_fields.get("attention_mask", np.ones(tokens.shape, bool)), bool)


def from_checkpoint(bundle) -> BlockGeneration:
    """A loaded DiffusionGemma checkpoint (a `dew.interop.Pretrained`) as a `BlockGeneration`: the block
    process its generation_config.json asks for, its tokenizer, budget, EOS and padding ids."""
    config = bundle.model.config
    process = BlockProcess.from_generation(bundle.generation_config, config.canvas_length, config.vocab_size,
                                           where=f"{bundle.directory}/generation_config.json")
    variables = {name: bundle.variables[name] for name in ("params", "constants")}
    return BlockGeneration(bundle.model, variables, process, tokenizer=bundle.tokenizer,
                           max_new_tokens=bundle.max_new_tokens, eos_token_ids=bundle.generation.eos_token_ids,
                           pad_id=bundle.generation.pad_id)


__all__ = ["BlockGeneration", "from_checkpoint"]
