"""The `Dataset` the trainer reads: a train stream, an optional validation pass, and their sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Partition:
    """The share of every global batch one process reads: process `index` of `count`."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"partition index {self.index} is outside 0..{self.count - 1}")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Batches for `Trainer.fit`.

    `train(partition)` returns an endless iterator of host batches (dicts of numpy arrays whose
    leading axis is this process's rows of the global batch). When that iterator has
    `get_state()` / `set_state(state)` (Grain's do), checkpoints record its position so a resumed
    run reads the same next batch. `val(partition)`, when given, returns a fresh iterator over one
    whole validation pass each time it is called. `records` counts the training examples and
    `batch` is the global batch size in rows.
    """

    train: Callable[[Partition], Iterator[Batch]]
    val: Callable[[Partition], Iterator[Batch]] | None
    records: int
    batch: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.batch < 1:
            raise ValueError(f"batch is {self.batch}: a dataset needs at least one row per batch")
