"""What the multimodal fixture scripts (tools/make_*_fixtures.py) share: a word-level tokenizer over the words
`token<i>` and a checkpoint's special tokens, and the command line that writes a fixture."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path


def word_level(vocab_size: int, specials: Mapping[str, int]):
    """A `tokenizers.Tokenizer` mapping each word `token<i>` to id i, and each of `specials` to its id, split at
    whitespace and read back with a space between words; ids the specials take have no `token<i>` word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"token{i}": i for i in range(vocab_size) if i not in specials.values()}
    vocab.update(specials)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # words read back with a space between them
    return backend


def main(write: Callable[[Path, int], Path], description: str) -> None:
    """`--out DIR --seed N`: write the fixture under DIR (tests/fixtures/hf by default) and print where."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/hf"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write(args.out, args.seed))
