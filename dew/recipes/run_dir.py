"""A run directory: what a recipe run leaves behind, and how a rerun of the same command finds it.

    RUN/run.json                 the resolved config, package versions and tokenizer (written once)
    RUN/status.json              running, finished, interrupted or failed; the process and its host
    RUN/checkpoints/STEP/        Orbax checkpoints, the newest trainer.keep of them
    RUN/metrics.jsonl            one line per logged step and per evaluation
    RUN/samples.jsonl            the preview texts of each evaluation
    RUN/events.out.tfevents.*    TensorBoard (`tensorboard --logdir RUN`, or the directory of runs)
    RUN/wandb/                   Weights & Biases' files, when --trainer.wandb is set

run.json's `settings` is the command's config as JSON; `model` the model's resolved keywords;
`tokenizer`, `sampling`, `sample_tokens` and `ema_decay` what generation from the run needs.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
from pathlib import Path
from typing import Any

from dew.training.checkpoints import saved_steps
from dew.training.trackers import METRICS, read_jsonl

RUN_JSON, STATUS, CHECKPOINTS = "run.json", "status.json", "checkpoints"
FORMAT = 1

# What a rerun may change: these decide what is logged and kept, not what is trained.
MAY_CHANGE = ("trainer.run_dir", "trainer.log_every", "trainer.eval_every", "trainer.val_batch",
              "trainer.checkpoint_every", "trainer.keep", "trainer.wandb", "trainer.wandb_mode")
# The parts of run.json that decide what the run trains.
COMPARED = ("recipe", "settings", "model", "data")
_PACKAGES = ("dew-ml", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "tokenizers")


class RunMismatch(ValueError):
    """A run directory holds a run that the command does not describe."""


def versions() -> dict[str, str]:
    """Python's and the training stack's versions, as run.json records them."""
    found = {"python": platform.python_version()}
    for package in _PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def flatten(record: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": value} for every leaf of nested dicts (a list is one leaf)."""
    if not isinstance(record, dict) or not record:
        return {prefix: record}
    flat = {}
    for key, value in record.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return flat


def _flag(name: str) -> str:
    """`settings.optim.learning_rate` -> `--optim.learning-rate`; other parts keep their path."""
    if name.startswith("settings.model.config."):
        return f"--model.config's {name.removeprefix('settings.model.config.')}"
    if name.startswith("settings."):
        return "--" + name.removeprefix("settings.").replace("_", "-")
    return name


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, record: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunDirectory:
    """The run directory at `path` (see the module's docstring for its files)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def record(self) -> dict[str, Any] | None:
        """run.json, or None when the directory holds no run."""
        path = self.path / RUN_JSON
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def open(self, record: dict[str, Any]) -> list[str]:
        """Start a run described by `record`, or find the same run to resume.

        A new run writes run.json with the package versions and the time. An existing one must agree
        with `record` in every setting but those in MAY_CHANGE, else `RunMismatch` says what differs;
        returns notes on what differs harmlessly (package versions).
        """
        saved = self.record()
        if saved is None:
            if self.path.exists() and any(self.path.iterdir()):
                raise RunMismatch(
                    f"{self.path} is not empty and holds no {RUN_JSON}, so it is not a Dew run: pass "
                    f"--trainer.run-dir with a new or empty directory"
                )
            self.path.mkdir(parents=True, exist_ok=True)
            _write_json(self.path / RUN_JSON, {"format": FORMAT, **record, "versions": versions(), "created": _now()})
            return []
        ours, theirs = (flatten({key: run.get(key) for key in COMPARED}) for run in (record, saved))
        differing = [name for name in sorted(set(ours) | set(theirs))
                     if ours.get(name) != theirs.get(name) and name.removeprefix("settings.") not in MAY_CHANGE]
        # What the command says first; what follows from it (the resolved model) only when it says the same.
        differing = [name for name in differing if name.startswith("settings.")] or differing
        if differing:
            differences = [f"  {_flag(name)}: the run has {json.dumps(theirs.get(name))}, "
                           f"this command {json.dumps(ours.get(name))}" for name in differing]
            started = shlex.join(saved["command"]) if saved.get("command") else "(not recorded)"
            raise RunMismatch(
                f"{self.path} holds a run that this command does not describe:\n" + "\n".join(differences) +
                f"\nThe run was started with: {started}\nRerun that command to resume it, or start a new run "
                f"with --trainer.run-dir NEW_DIRECTORY (or delete {self.path} to start this one over)."
            )
        now = versions()
        return [f"{package} was {version} when the run started and is {now.get(package)} now"
                for package, version in saved.get("versions", {}).items() if now.get(package) != version]

    def set_status(self, state: str, step: int | None = None, message: str | None = None) -> None:
        """Record the run's state: running, finished, interrupted or failed."""
        _write_json(self.path / STATUS, {"state": state, "step": step, "message": message, "pid": os.getpid(),
                                         "host": socket.gethostname(), "updated": _now()})

    def status(self) -> dict[str, Any]:
        """status.json, with a `running` run whose process is gone on this host reported as `killed`."""
        path = self.path / STATUS
        status = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"state": "new"}
        if status["state"] == "running" and status.get("host") == socket.gethostname() and not _alive(status["pid"]):
            status = {**status, "state": "killed"}
        return status

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records, in the order written."""
        return read_jsonl(self.path / METRICS)

    def checkpoint_steps(self) -> list[int]:
        return saved_steps(self.checkpoints)

    def summary(self) -> dict[str, Any]:
        """The run at a glance: status, last logged step of how many, latest checkpoint, last losses."""
        record, metrics, saved = self.record() or {}, self.metrics(), self.checkpoint_steps()
        last = lambda key: next((entry[key] for entry in reversed(metrics) if key in entry), None)
        status = self.status()
        return {
            "run": str(self.path), "status": status["state"],
            "step": max([entry["step"] for entry in metrics[-1:]] + saved[-1:], default=0),
            "steps": record.get("settings", {}).get("trainer", {}).get("steps"),
            "checkpoint": saved[-1] if saved else None,
            "train/loss": last("train/loss"), "val/loss": last("val/loss"), "val/perplexity": last("val/perplexity"),
            "updated": status.get("updated"),
        }


def find_runs(directory: str | os.PathLike) -> list[RunDirectory]:
    """`directory` itself when it is a run, else every run below it, sorted by path."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    if (root / RUN_JSON).is_file():
        return [RunDirectory(root)]
    return [RunDirectory(path.parent) for path in sorted(root.rglob(RUN_JSON))]
