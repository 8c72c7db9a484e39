"""Training: `Trainer`, `TrainState`, `MeshSpec` / `Layout`, `shard_batch`, and Orbax `Checkpoints`."""

from dew.training.checkpoints import Checkpoints
from dew.training.mesh import Layout, MeshSpec, shard_batch
from dew.training.state import TrainState
from dew.training.trainer import Trainer, TrainingInterrupted

__all__ = ["Checkpoints", "Layout", "MeshSpec", "TrainState", "Trainer", "TrainingInterrupted",
           "shard_batch"]
