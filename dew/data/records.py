"""Records held in memory as rows: reading them (JSON Lines, Parquet, `datasets`), and the batches a run reads
over the rows.

Preference pairs (`dew.data.preference_pairs`) and prompts (`dew.data.prompts`) are small enough to
tokenize whole at load; their rows are numpy arrays with one leading entry per record, every key
alike. Training reads them in a fresh seeded order each epoch, validation in file order. The train
iterator is a plain one: a resumed run replays it to the same next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.dataset import Batch, Partition
from dew.data.record_files import is_datasets_directory, records

Rows = Mapping[str, np.ndarray]


def read_records(path: str | Path, what: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) of each record of a file of `what` (named in errors): JSON Lines, Parquet or a `datasets`
    directory (`dew.data.record_files`), `where` naming the file and the line or row; refused by line when a
    line is not a JSON object."""
    path = Path(path)
    if not (path.is_file() or is_datasets_directory(path)):
        raise FileNotFoundError(f"{what} file {path} does not exist: give a JSON Lines file (one JSON object a line), "
                                "a Parquet file or a datasets directory")
    read = list(records(path, what))
    if not read:
        raise ValueError(f"{what} file {path} holds no record")
    return read


def count_rows(rows: Rows) -> int:
    return len(next(iter(rows.values())))


def shuffled_batches(rows: Rows, examples: int, seed: int) -> Callable[[Partition], Iterator[Batch]]:
    """An endless stream of `examples` rows a batch: each epoch a fresh permutation (from `seed` and the
    epoch), cut into whole batches (an epoch's last partial batch is dropped); each process keeps its
    share, rows `index::count` of the batch."""
    count = count_rows(rows)
    if count < examples:
        raise ValueError(f"{count} records do not fill one batch of {examples}: use a smaller batch, or add records")

    def batches(partition: Partition) -> Iterator[Batch]:
        epoch = 0
        while True:
            order = np.random.default_rng([seed, epoch]).permutation(count)
            for start in range(0, count - examples + 1, examples):
                chosen = order[start:start + examples][partition.index::partition.count]
                yield {key: value[chosen] for key, value in rows.items()}
            epoch += 1

    return batches


def ordered_batches(rows: Rows, examples: int) -> Callable[[Partition], Iterator[Batch]]:
    """One pass over the rows in file order, `examples` at a time (a last partial batch is dropped)."""
    count = count_rows(rows)
    if count < examples:
        raise ValueError(f"{count} validation records do not fill one validation batch of {examples}: use a smaller "
                         "--trainer.val-batch, or add validation records")

    def batches(partition: Partition) -> Iterator[Batch]:
        for start in range(0, count - examples + 1, examples):
            yield {key: value[start:start + examples][partition.index::partition.count] for key, value in rows.items()}

    return batches
