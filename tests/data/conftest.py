"""Fixtures for the data tests: a small corpus and a BPE tokenizer trained on it here, offline."""

import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

WORDS = "the cat sat on a mat and dog ran to café naïve 東京 over hill under tree in park".split()


def make_corpus(lines: int, seed: int = 0) -> str:
    """Lines of repeated words with indentation, tabs and blank lines; ends with a newline."""
    rng = random.Random(seed)
    text = []
    for _ in range(lines):
        indent = rng.choice(["", "", "", "  ", "\t", "\n"])
        text.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))))
    return "\n".join(text) + "\n"


@pytest.fixture(scope="session")
def corpus() -> str:
    return make_corpus(400)


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory, corpus) -> str:
    """A directory holding tokenizer.json: byte-level BPE whose merges cross spaces, not newlines.

    Its pieces end at each newline, so only a cut at a line end leaves the ids unchanged; a cut
    inside a line splits merges such as "ran tree ".
    """
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    directory = tmp_path_factory.mktemp("bpe")
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)
