"""Training: `Trainer`, `TrainState`, `MeshSpec` / `Layout`, `shard_batch`, and Orbax `Checkpoints`."""

from dew.lazy import lazy_names

__all__ = ["Checkpoints", "Layout", "MeshSpec", "TrainState", "Trainer", "TrainingInterrupted", "shard_batch"]
# Each name imported from its module when first used: a module that needs the mesh alone (loading a
# checkpoint to serve it) does not import the trainer's optax and Orbax.
__getattr__, __dir__ = lazy_names(__name__, {
    "Checkpoints": "dew.training.checkpoints", "Layout": "dew.training.mesh", "MeshSpec": "dew.training.mesh",
    "shard_batch": "dew.training.mesh", "TrainState": "dew.training.state", "Trainer": "dew.training.trainer",
    "TrainingInterrupted": "dew.training.trainer"})
