"""Tokenize text into the token files TokenWindows and PackedTokens read.

    python tools/tokenize_text.py --input data/corpus.txt --out data/corpus-byte --tokenizer byte

`--input` is a text file (.xz and .gz are decompressed) or a directory, whose *.txt, *.txt.xz and
*.txt.gz files are read in sorted order. `--out` receives train.bin, val.bin and meta.json; the
first `--val-fraction` of the tokens is the validation split.
"""

from __future__ import annotations

import argparse
import time

from dew.data.tokenize import tokenize_text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="text file or directory of text files")
    parser.add_argument("--out", required=True, help="directory for train.bin, val.bin, meta.json")
    parser.add_argument("--tokenizer", required=True,
                        help='"byte", a Hugging Face tokenizer name, or a tokenizer.json path')
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="share of the tokens, from the start, held out as val.bin")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizing processes (default: every core)")
    parser.add_argument("--eos-between-files", action="store_true",
                        help="put the tokenizer's EOS id between consecutive input files")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    meta = tokenize_text(args.input, args.out, args.tokenizer, args.val_fraction, args.workers,
                         eos_between_files=args.eos_between_files)
    seconds = time.perf_counter() - start
    tokens = meta["train_tokens"] + meta["val_tokens"]
    print(f"{args.out}: {tokens:,} tokens ({meta['val_tokens']:,} val, {meta['dtype']}, "
          f"{meta['tokenizer']}) in {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s")
    return meta


if __name__ == "__main__":
    main()
