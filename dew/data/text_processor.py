"""`TextProcessor`: a checkpoint's text-only processor, strings to `ModelInputs` ready for generation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dew.data.inputs import ModelInputs


class TextProcessor:
    """Encode strings with `tokenizer` (no special tokens added: write them in the text, as a chat template
    does) into `ModelInputs`: int32 `tokens` `[rows, longest]` padded with `pad_id` before each shorter
    row's first token, and, when some row is padded, a boolean `attention_mask` marking the real ones (a
    batch with nothing to pad has none, so attention runs with causality as a flag)."""

    def __init__(self, tokenizer, pad_id: int = 0):
        self.tokenizer, self.pad_id = tokenizer, int(pad_id)

    def __call__(self, texts: str | Sequence[str]) -> ModelInputs:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts or not all(isinstance(text, str) for text in texts):
            raise TypeError("TextProcessor takes a string or a non-empty list of strings")
        encoded = [self.tokenizer.encode(text) for text in texts]
        empty = [row for row, ids in enumerate(encoded) if not ids]
        if empty:
            raise ValueError(f"text {empty[0]} encodes to no tokens; every row needs at least one")
        longest = max(len(ids) for ids in encoded)
        tokens = np.full((len(encoded), longest), self.pad_id, np.int32)
        mask = np.zeros((len(encoded), longest), bool)
        for row, ids in enumerate(encoded):
            tokens[row, longest - len(ids):], mask[row, longest - len(ids):] = ids, True
        return ModelInputs.of(tokens, attention_mask=None if mask.all() else mask)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


__all__ = ["TextProcessor"]
