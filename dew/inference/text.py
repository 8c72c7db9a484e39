"""`TextGeneration`: a decoder bound to its weights, tokenizer, sampling policy and budget; and
`printable`, generated text made safe to print to a terminal."""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any

import jax
import numpy as np

from dew.data.inputs import ModelInputs
from dew.sampling import Generation, Sampling, generate


# C0 and C1 control characters and DEL, but for newline and tab: a model's bytes can hold escape
# sequences that would move the cursor, recolour or retitle a terminal.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with every control character but newline and tab written as its escape (`\\x1b`)."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
    """Prompts as rows of ids: a string or a list of strings (encoded with `tokenizer`), a list of ids,
    or a list of such lists. A `ModelInputs` passes through as it is."""
    if isinstance(prompts, ModelInputs):
        return prompts
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], str)):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this task has none, so pass token ids")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        return [tokenizer.encode(text) for text in texts]
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Number):
        return [list(prompts)]  # one row of ids (generate refuses any that is not an integer)
    return [list(row) if isinstance(row, (list, tuple)) else row for row in prompts]


@dataclasses.dataclass(frozen=True)
class TextGeneration:
    """Generate from `model` with `params`: `task(prompts, max_new_tokens, seed=0, n=1)`.

    Prompts are a string, a list of strings (encoded with `tokenizer`), a list of token ids, or a
    list of such lists. `max_new_tokens` defaults to the task's own budget when it has one. The
    result's `.text` decodes each row (prompt and continuation) when a tokenizer is bound.
    """

    model: Any
    params: Any
    tokenizer: Any = None
    sampling: Sampling = Sampling()
    max_new_tokens: int | None = None

    def encode(self, prompts) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts)

    def __call__(self, prompts, max_new_tokens: int | None = None, *, seed: int = 0, n: int = 1,
                 key: jax.Array | None = None, on_token=None) -> Generation:
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if budget is None:
            raise ValueError("this task has no default budget: pass max_new_tokens")
        key = jax.random.key(seed) if key is None else key
        decode = None if self.tokenizer is None else self.tokenizer.decode
        return generate(self.model, self.params, self.encode(prompts), budget, key=key, sampling=self.sampling,
                        n=n, decode=decode, on_token=on_token)

    def with_sampling(self, sampling: Sampling) -> "TextGeneration":
        return dataclasses.replace(self, sampling=sampling)
