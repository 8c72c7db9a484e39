"""Orbax checkpoints of a `TrainState` plus the data position, written atomically.

Orbax writes each step into a temporary directory and renames it when complete, so a run that stops
mid-save (or fails on a non-finite loss) leaves its last good checkpoint whole. A checkpoint damaged
afterwards (a truncated file) is skipped for the newest one that reads, with a `CheckpointSkipped`
warning naming it and why; a resuming run also sets it aside as STEP.unreadable, so the step is
saved afresh when the run reaches it again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew.errors import ADVICE
from dew.training.held_output import HeldOutput
from dew.training.state import TrainState


UNREADABLE = ".unreadable"


class CheckpointSkipped(UserWarning):
    """The newest checkpoint could not be read, and an older one was used."""


class CheckpointMismatch(ValueError):
    """A checkpoint was written for another setting than the one restoring it."""


class UnreadableCheckpoint(OSError):
    """No checkpoint under a directory (or not the one asked for) can be read."""


class CheckpointNotSaved(OSError):
    """A checkpoint could not be written; `errno` is the system's reason when one was given."""

    def __init__(self, where: str, complete: list[int], code: int | None, reason: str):
        advice = ADVICE.get(code, "check that the directory can be written, then rerun the same command to resume")
        last = f"the last complete checkpoint is step {complete[-1]}" if complete else "no checkpoint is complete"
        super().__init__(f"checkpoint {where} could not be written ({reason}); {last}: {advice}")
        self.errno = code


def _errno(error: BaseException) -> int | None:
    """The system error number behind `error`: an OSError's, or the one TensorStore writes in its message."""
    while error is not None:
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno
        found = re.search(r"os_error_code='(\d+)'", str(error))
        if found:
            return int(found.group(1))
        error = error.__cause__ or error.__context__
    return None


def _reason(error: BaseException) -> str:
    """The first line of the innermost error behind `error`: where the storage layer says what is wrong."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:400] if lines else ''}"


def _interrupted(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt lies behind `error` (its causes and contexts)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _free_name(path: str) -> str:
    """`path`, or `path.N` for the first N not taken."""
    candidate, number = path, 1
    while os.path.exists(candidate):
        candidate, number = f"{path}.{number}", number + 1
    return candidate


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

    def write_note(self, name: str, record: dict) -> None:
        """Write `record` as JSON to `name` beside the checkpoints (process 0; whole or not at all): what a step
        ran with, such as the train step's memory plan. Orbax reads only its step directories."""
        if jax.process_index() != 0:
            return
        path = os.path.join(self.directory, name)
        with open(path + ".partial", "w", encoding="utf-8") as handle:
            handle.write(json.dumps(record, indent=2) + "\n")
        os.replace(path + ".partial", path)

    def save(self, state: TrainState, data_position: dict[str, Any] | None) -> None:
        """Write the checkpoint of `state.step`; a failure (a full disk, a directory that cannot be
        written) is a `CheckpointNotSaved` naming the step, the cause and the last complete checkpoint,
        and the partial files it left are removed."""
        step = int(jax.device_get(state.step))
        if step in self.manager.all_steps():
            return
        failure = None
        with HeldOutput() as held:
            try:
                self.manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"position": data_position})
                    ),
                )
                self.manager.wait_until_finished()
            except Exception as error:  # noqa: BLE001 - reported below with its cause
                code = _errno(error)
                failure = (code, os.strerror(code) if code is not None else _reason(error))
            if failure is not None:
                held.drop()
        if failure is not None:
            for name in os.listdir(self.directory):
                if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            raise CheckpointNotSaved(os.path.join(self.directory, str(step)), self.manager.all_steps(), *failure)

    def restore(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any] | None]:
        """The state at `step` placed like `like`, and the saved data position.

        Without `step`, the newest checkpoint that reads: each newer one that does not is renamed
        STEP.unreadable (kept for inspection, out of the run's way) with a `CheckpointSkipped` warning.
        """
        read = lambda candidate: self._restore(like, candidate)
        return self._read(step, read) if step is not None else self._newest_readable(read, set_aside=True)

    def _attempt(self, read, step: int):
        """(what `read(step)` returns, None), or (None, why it failed) when the checkpoint is damaged."""
        failure = None
        with HeldOutput() as held:
            try:
                return read(step), None
            except CheckpointMismatch:
                raise
            except Exception as error:  # noqa: BLE001 - any failure to read is damage, reported with its cause
                if _interrupted(error):  # Ctrl-C inside the storage layer's threads, wrapped: not damage
                    raise KeyboardInterrupt from error
                failure = _reason(error)
            held.drop()
        return None, failure

    def _read(self, step: int, read):
        restored, failure = self._attempt(read, step)
        if failure is not None:
            raise UnreadableCheckpoint(
                f"checkpoint {os.path.join(self.directory, str(step))} cannot be read ({failure}): it is "
                f"damaged; the complete checkpoints here are steps {self.manager.all_steps()}"
            )
        return restored

    def _newest_readable(self, read, set_aside: bool):
        """`read(step)` of the newest step it succeeds on, warning about (and maybe setting aside) the others."""
        failures = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            restored, failure = self._attempt(read, step)
            if failure is not None:
                failures.append((step, failure))
                continue
            # Several processes share the directory: the first one moves it.
            set_aside = set_aside and jax.process_index() == 0
            for skipped, reason in failures:
                where = os.path.join(self.directory, str(skipped))
                moved = ""
                if set_aside:
                    kept = _free_name(where + UNREADABLE)
                    os.replace(where, kept)
                    moved = f"; it is kept as {kept}"
                warnings.warn(f"skipped checkpoint {where}, which cannot be read ({reason}), for step {step}{moved}",
                              CheckpointSkipped, stacklevel=3)
            if failures and set_aside:
                self.manager.reload()
            return restored
        if not failures:
            raise FileNotFoundError(f"{self.directory} holds no complete checkpoint")
        raise UnreadableCheckpoint(
            f"no checkpoint under {self.directory} can be read: " +
            "; ".join(f"step {step}: {reason}" for step, reason in failures) +
            ": they are damaged, so the run starts over (move the directory aside), or restore them from a copy"
        )

    def _restore(self, like: TrainState, step: int) -> tuple[TrainState, dict[str, Any] | None]:
        saved = self.manager.item_metadata(step)["state"]
        saved_has_ema = bool(jax.tree_util.tree_leaves(saved["ema"])) if "ema" in saved else False
        if saved_has_ema != (like.ema is not None):
            raise CheckpointMismatch(
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
        """The saved state at `step` as a plain tree of arrays on this host, without a target to restore
        into. Without `step`, the newest checkpoint that reads (a skipped one warns, and stays where it is)."""
        read = lambda candidate: self.manager.restore(
            candidate, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
        if step is None:
            return self._newest_readable(read, set_aside=False)
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"{self.directory} holds no complete checkpoint at step {step}; "
                                    f"it holds steps {self.manager.all_steps()}")
        return self._read(step, read)

    def close(self) -> None:
        self.manager.close()
