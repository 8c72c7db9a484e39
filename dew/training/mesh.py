"""The mesh and parameter layout (they live in `dew.sharding`, and are importable here for existing
callers), and `shard_batch`, which places a training batch."""

from __future__ import annotations

import jax

from dew.data.inputs import ModelInputs, with_mask
from dew.sharding import BATCH_AXES, Layout, MeshSpec, Rules, batch_sharding, place_batch, replicated


def shard_batch(mesh, batch: dict) -> dict:
    """A training batch of this process's host rows as global arrays split over the batch axes
    (`place_batch`). On a process pool every `ModelInputs` entry carries an `attention_mask` on every
    process (`with_mask`: all true where a process had no padding), so the processes agree about a
    missing mask before anything is assembled without asking each other, and the step compiles once
    whichever processes' batches are padded. In one process a batch is placed as it is."""
    if jax.process_count() > 1:
        batch = {name: with_mask(rows) if isinstance(rows, ModelInputs) else rows for name, rows in batch.items()}
    return place_batch(mesh, batch)


__all__ = ["BATCH_AXES", "Layout", "MeshSpec", "Rules", "batch_sharding", "place_batch", "replicated", "shard_batch"]
