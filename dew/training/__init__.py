"""Training: `Trainer`, `TrainState`, `MeshSpec` / `Layout`, and Orbax `Checkpoints`."""

from dew.training.checkpoints import Checkpoints
from dew.training.mesh import Layout, MeshSpec
from dew.training.state import TrainState
from dew.training.trainer import Trainer, TrainingInterrupted

__all__ = ["Checkpoints", "Layout", "MeshSpec", "TrainState", "Trainer", "TrainingInterrupted"]
