"""Tokenizing records: `dew tokenize` over JSON Lines, Parquet and a datasets directory, against `datasets.map`
with the same tokenizer in batched mode, in one run.

    python -m benchmarks.tokenize_formats --tokenizer gpt2 --megabytes 8

The corpus is the shipped King James Bible (data/kjv.txt.xz), one chapter a document, repeated to about
`--megabytes` of text, written once in each form. Dew tokenizes each form into token files with its worker
processes (`--workers`, default every core); `datasets.map(batched=True)` maps the same `tokenizers.Tokenizer`'s
`encode_batch` over the saved dataset (1,000 records a batch, its default; the Rust tokenizer spreads a batch
over every core itself), once in one process and once with `num_proc` = the workers, writing its Arrow cache as
Dew writes its token files. Each side is timed once, wall clock, imports excluded; the ratio is Dew's tokens/s
over the peer's.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_model

KJV = Path(__file__).resolve().parents[1] / "data" / "kjv.txt.xz"


def chapters(megabytes: float) -> list[str]:
    """The Bible's chapters as documents (a verse a line), repeated to about `megabytes` of text."""
    text = lzma.decompress(KJV.read_bytes()).decode("utf-8")
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"(\w+?\d+):\d+ (.*)", line)
        if match:
            found.setdefault(match[1], []).append(match[2])
    documents = ["\n".join(verses) + "\n" for verses in found.values()]
    size = sum(map(len, documents))
    return documents * max(1, round(megabytes * 2**20 / size))


def write_forms(documents: list[str], directory: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": documents})
    forms = {"jsonl": directory / "corpus.jsonl", "parquet": directory / "corpus.parquet",
             "datasets": directory / "corpus-datasets"}
    forms["jsonl"].write_text("".join(json.dumps({"text": text}) + "\n" for text in documents), encoding="utf-8")
    pq.write_table(table, forms["parquet"])
    datasets.Dataset(table).save_to_disk(str(forms["datasets"]))
    return forms


def dew_tokens_per_second(source: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, int]:
    from dew.data.tokenize import tokenize_text

    started = time.perf_counter()
    meta = tokenize_text(source, out, tokenizer, 0.0, workers, progress=False, force=True)
    seconds = time.perf_counter() - started
    tokens = meta["train_tokens"] + meta["val_tokens"]
    return tokens / seconds, tokens


def map_tokens_per_second(saved: Path, tokenizer_file: Path, num_proc: int | None) -> tuple[float, int]:
    import datasets
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    dataset = datasets.load_from_disk(str(saved))

    def encode(batch):
        return {"input_ids": [encoding.ids for encoding in
                              tokenizer.encode_batch(batch["text"], add_special_tokens=False)]}

    started = time.perf_counter()
    mapped = dataset.map(encode, batched=True, remove_columns=["text"], num_proc=num_proc,
                         load_from_cache_file=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(ids) for batch in mapped.with_format("arrow").iter(10_000)
                 for ids in batch.column("input_ids").to_pylist())
    mapped.cleanup_cache_files()
    return tokens / seconds, tokens


def main(argv: list[str] | None = None) -> None:
    from dew.data.tokenizers import tokenizer_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="gpt2", help="a tokenizer name or path (`make gpt2-tokenizer`)")
    parser.add_argument("--megabytes", type=float, default=8.0, help="about how much text to tokenize")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="Dew's processes")
    args = parser.parse_args(argv)
    path = tokenizer_file(args.tokenizer)
    documents = chapters(args.megabytes)
    print(f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores; {len(documents):,} documents, "
          f"{sum(map(len, documents)) / 2**20:.1f} MiB of text, tokenizer {args.tokenizer}, Dew workers {args.workers}")
    with tempfile.TemporaryDirectory(prefix="dew-tokenize-formats-") as scratch:
        scratch = Path(scratch)
        forms = write_forms(documents, scratch)
        peers = {"datasets.map(batched=True)": map_tokens_per_second(forms["datasets"], path, None),
                 f"datasets.map(batched=True, num_proc={args.workers})":
                     map_tokens_per_second(forms["datasets"], path, args.workers)}
        ours = {form: dew_tokens_per_second(source, scratch / f"out-{form}", str(path.parent), args.workers)
                for form, source in forms.items()}
    for name, (rate, tokens) in peers.items():
        print(f"{name}: {rate:,.0f} tokens/s ({tokens:,} tokens)")
    for form, (rate, tokens) in ours.items():
        ratios = ", ".join(f"{rate / peer:.2f}x {name}" for name, (peer, _) in peers.items())
        print(f"dew tokenize {form}: {rate:,.0f} tokens/s ({tokens:,} tokens, EOS between documents): {ratios}")


if __name__ == "__main__":  # Dew's workers are spawned: they must not rerun this
    main()
