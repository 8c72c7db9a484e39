"""Train a byte-level BPE tokenizer on a text corpus and save it where HFTokenizer finds it.

    python tools/train_tokenizer.py --input data/kjv-verses.txt --vocab-size 4096 --out data/tokenizers/kjv-bpe

`--input` is a text file (.xz and .gz are decompressed), a record file (JSON Lines, Parquet, a datasets
directory; `--field` names the text) or a directory of them, read as
tools/tokenize_text.py reads it. The tokenizer splits text as GPT-2 does (its pre-tokenizer
pattern, no prefix space) and starts from all 256 byte values, so every string encodes; its
vocabulary is `--vocab-size` ids: `<|endoftext|>` (id 0, the EOS token HFTokenizer looks for),
the 256 bytes and the most frequent merges. Training is deterministic: the same corpus and size
give a byte-identical tokenizer.json on every machine. Writes tokenizer.json and
tokenizer_config.json into `--out`, each atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dew.data.record_files import is_record_file, open_binary, texts
from dew.data.tokenize import DEFAULT_FIELD, input_files

ENDOFTEXT = "<|endoftext|>"
BYTES = 256


def corpus_lines(input: str | os.PathLike, field: str = DEFAULT_FIELD) -> Iterator[str]:
    """Every line of every input file, newline kept, in tools/tokenize_text.py's file order; a record file's
    records (JSON Lines, Parquet, datasets) give the lines of their `field`."""
    for path in input_files(input):
        if is_record_file(path):
            for batch in texts(path, field):
                for text in batch:
                    yield from text.splitlines(keepends=True)
            continue
        with open_binary(path) as stream:
            yield from stream.read().decode("utf-8").splitlines(keepends=True)


def train_bpe(lines: Iterator[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids trained on `lines`, with `<|endoftext|>` as id 0."""
    if vocab_size <= BYTES + 1:
        raise ValueError(f"vocab_size is {vocab_size}: a byte-level BPE needs more than {BYTES + 1} ids "
                         f"(the {BYTES} bytes and {ENDOFTEXT}) to learn any merge")
    tokenizer = Tokenizer(models.BPE())
    # GPT-2's pre-tokenizer: merges never cross a word, a space run or a newline, which is also
    # what lets tools/tokenize_text.py tokenize the corpus in chunks cut at line ends.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(ENDOFTEXT, special=True, normalized=False)],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="a text file (.xz, .gz too), a JSON Lines or Parquet file, a "
                        "datasets directory, or a directory of such files")
    parser.add_argument("--field", default=DEFAULT_FIELD, help="the string field of each record that holds its text")
    parser.add_argument("--vocab-size", type=int, default=4096, help="ids in the vocabulary, EOS included")
    parser.add_argument("--out", type=Path, required=True, help="directory for tokenizer.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tokenizer = train_bpe(corpus_lines(args.input, args.field), args.vocab_size)
    if tokenizer.get_vocab_size() != args.vocab_size:
        raise RuntimeError(
            f"training gave {tokenizer.get_vocab_size()} ids, not {args.vocab_size}: the corpus has too "
            f"few distinct pairs occurring twice for that many merges; ask for a smaller --vocab-size"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": ENDOFTEXT,
              "add_prefix_space": False}
    _write_atomically(args.out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    _write_atomically(args.out / "tokenizer.json", tokenizer.to_str(pretty=True))
    print(f"wrote {args.out / 'tokenizer.json'}: byte-level BPE, {tokenizer.get_vocab_size()} ids, "
          f"{ENDOFTEXT} = {tokenizer.token_to_id(ENDOFTEXT)}, in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
