"""Orbax checkpoints of a `TrainState` plus the data position, written atomically.

Orbax writes each step into a temporary directory and renames it when complete, so a run that stops
mid-save (or fails on a non-finite loss) leaves its last good checkpoint whole.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew.training.state import TrainState


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints under `directory`, ascending ([] when there is none)."""
    if not os.path.isdir(directory):
        return []
    return sorted(ocp.utils.checkpoint_steps(directory))


class Checkpoints:
    """The checkpoints under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3):
        if keep is not None and keep < 1:
            raise ValueError(f"keep is {keep}; keep at least one checkpoint, or None for all")
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
        )

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, data_position: dict[str, Any] | None) -> None:
        step = int(jax.device_get(state.step))
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"position": data_position})
            ),
        )
        self.manager.wait_until_finished()

    def restore(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any] | None]:
        """The state at `step` (default the latest) placed like `like`, and the saved data position."""
        step = self.latest() if step is None else step
        saved = self.manager.item_metadata(step)["state"]
        saved_has_ema = bool(jax.tree_util.tree_leaves(saved["ema"])) if "ema" in saved else False
        if saved_has_ema != (like.ema is not None):
            raise ValueError(
                f"the checkpoint at {self.directory} step {step} was written "
                f"{'with' if saved_has_ema else 'without'} an EMA copy, and this objective has ema_decay "
                f"{'set' if like.ema is not None else 'None'}: a checkpoint restores only into the same setting"
            )
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
        )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()),
        )
        return restored["state"], restored["data"]["position"]

    def restore_tree(self, step: int | None = None) -> dict[str, Any]:
        """The saved state as a plain tree of arrays on this host, without a target to restore into."""
        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory} holds no complete checkpoint")
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return restored["state"]

    def close(self) -> None:
        self.manager.close()
