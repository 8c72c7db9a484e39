"""Tokenize text into the token files TokenWindows and PackedTokens read (the same as `dew tokenize`).

    python tools/tokenize_text.py --input data/corpus.txt --out data/corpus-byte --tokenizer byte

`--input` is a text file (.xz and .gz are decompressed) or a directory, whose *.txt, *.txt.xz and
*.txt.gz files are read in sorted order. `--out` receives train.bin, val.bin and meta.json; the
first `--val-fraction` of the tokens is the validation split. `--help` lists every flag.
"""

from __future__ import annotations

import sys

from dew.cli import main as dew_main


def main(argv: list[str] | None = None) -> int:
    return dew_main(["tokenize", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # the tokenizing workers are spawned: they must not rerun this
    sys.exit(main())
