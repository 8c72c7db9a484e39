"""`CanvasGeneration`: what a diffusion sampler returns, a refined span after each prompt.

A diffusion model writes every response position at once and refines them together, so there is no
per-token likelihood under an autoregressive sampler to report; what there is instead is how many
model evaluations refined each row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class CanvasGeneration:
    """Prompts and the spans refined after them.

    `tokens` is int32 `[rows, longest_prompt + max_new_tokens]`: each row's prompt, then its
    response, then `pad_id`. EOS is applied after refinement: a response is cut after its first EOS
    id, so `lengths` counts the prompt plus the response up to and including that EOS, `new_tokens`
    the response's part of it, and `terminated` says whether the row holds an EOS. `refinements`
    counts the model evaluations that refined each row (0 for a request of zero tokens). Rows are
    grouped by prompt: row `i * n + j` is continuation `j` of prompt `i`. There are no log-probs.
    """

    tokens: np.ndarray
    lengths: np.ndarray
    new_tokens: np.ndarray
    terminated: np.ndarray
    refinements: np.ndarray
    decode: Callable[[list[int]], str] | None = None

    def host(self) -> "CanvasGeneration":
        """The result on the host (it is built there already)."""
        return self

    @property
    def text(self) -> list[str]:
        """Each row decoded, prompt and response up to its length."""
        if self.decode is None:
            raise ValueError("this generation has no tokenizer bound; decode the ids in .tokens yourself")
        return [self.decode(list(row[:length])) for row, length in zip(self.tokens, self.lengths)]

    def continuations(self) -> list[list[int]]:
        """The response ids of each row, without the prompt and without padding."""
        return [list(row[length - count: length]) for row, length, count in
                zip(self.tokens, self.lengths, self.new_tokens)]


def assemble(prompts: Sequence[Sequence[int]], responses_BN: np.ndarray, refinements: int,
             eos_token_ids: Sequence[int], pad_id: int, decode=None) -> CanvasGeneration:
    """Lay out refined responses `[rows, N]` after their prompts (one per row) and apply EOS.

    A response keeps its ids up to and including its first EOS; the rest become `pad_id`.
    """
    rows, new = responses_BN.shape
    longest = max(len(prompt) for prompt in prompts)
    tokens = np.full((rows, longest + new), pad_id, np.int32)
    new_tokens = np.full((rows,), new, np.int32)
    terminated = np.zeros((rows,), bool)
    eos = np.asarray(tuple(eos_token_ids), np.int64)
    for row, (prompt, response) in enumerate(zip(prompts, responses_BN)):
        hits = np.flatnonzero(np.isin(response, eos)) if len(eos) else ()
        if len(hits):
            new_tokens[row], terminated[row] = hits[0] + 1, True
        kept = response[: new_tokens[row]]
        tokens[row, : len(prompt)] = prompt
        tokens[row, len(prompt): len(prompt) + len(kept)] = kept
    lengths = np.asarray([len(prompt) for prompt in prompts], np.int32) + new_tokens
    return CanvasGeneration(tokens=tokens, lengths=lengths, new_tokens=new_tokens, terminated=terminated,
                            refinements=np.full((rows,), refinements if new else 0, np.int32), decode=decode)
