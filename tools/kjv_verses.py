"""The shipped King James Bible as plain verses: each line's text without its reference.

    python tools/kjv_verses.py --out data/kjv-verses.txt

data/kjv.txt.xz (Debian's bible-kjv-text) holds one verse a line, each led by its reference
("Ge1:3 And God said, Let there be light: and there was light."). A model trained on the
references spends capacity predicting book abbreviations and numbers and prints them inside its
prose; this writes the same verses without them, one a line, in order (atomically).
"""

from __future__ import annotations

import argparse
import lzma
import os
import re
from pathlib import Path

# A book abbreviation (possibly led by 1-3, as in "1Sm"), chapter:verse, one space.
REFERENCE = re.compile(r"[1-3]?[A-Za-z]+\d+:\d+ ")


def verses(text: str) -> list[str]:
    """The text of each line of `text` after its reference; a line without one is refused."""
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        reference = REFERENCE.match(line)
        if reference is None:
            raise ValueError(f"line {number} does not start with a verse reference such as 'Ge1:3 ': "
                             f"{line[:60]!r}")
        lines.append(line[reference.end():])
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, default=Path("data/kjv.txt.xz"))
    parser.add_argument("--out", type=Path, required=True, help="the plain-text file to write")
    args = parser.parse_args(argv)
    with lzma.open(args.input, "rt", encoding="utf-8") as stream:
        lines = verses(stream.read())
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(partial, args.out)
    print(f"wrote {args.out}: {len(lines)} verses")


if __name__ == "__main__":
    main()
