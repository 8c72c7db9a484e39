"""Trackers: where `Trainer.fit` records what it logs, evaluates and previews.

`JsonLines` appends to metrics.jsonl and samples.jsonl, `TensorBoard` writes event files (through
tensorboardX, which needs neither TensorFlow nor the TensorBoard server), and `WandB` logs to
Weights & Biases when `wandb` is installed. `start(step)` opens a tracker at the step a run starts
or resumes from, and drops what a stopped run recorded after its last checkpoint, so a resumed run
reads as one run.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from dew.files import write_atomically

METRICS, SAMPLES = "metrics.jsonl", "samples.jsonl"


class Tracker(Protocol):
    """What `Trainer.fit` calls: `start` once, then `scalars` per log line and evaluation, `texts`
    per preview. The owner calls `close`."""

    def start(self, step: int) -> None: ...

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def texts(self, step: int, name: str, texts: Sequence[str]) -> None: ...

    def close(self) -> None: ...


def read_jsonl(path: str | os.PathLike, warn_cut_short: bool = False) -> list[dict[str, Any]]:
    """The records of a .jsonl file ([] when it is missing). A last line cut short by a killed process is skipped
    (with a warning when `warn_cut_short`); any other line that is not UTF-8 text or not a JSON object is skipped
    with a warning naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.splitlines()
    records, foreign, cut_short = [], [], []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            # only a last line without its newline can be a write cut short; a whole line that does not read is not
            (foreign if number < len(lines) or data.endswith(b"\n") else cut_short).append(number)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            foreign.append(number)
    if foreign:
        shown = ", ".join(map(str, foreign[:5])) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        what = ("line {}, which is not a UTF-8 JSON record" if len(foreign) == 1
                else "lines {}, which are not UTF-8 JSON records")
        warnings.warn(f"{path}: skipped {what.format(shown)}: the file was edited or damaged; the other lines are read",
                      stacklevel=2)
    if cut_short and warn_cut_short:
        warnings.warn(f"{path}: skipped its last line, {cut_short[0]}, cut short: the process writing it stopped "
                      "mid-line (or is writing it now); the other lines are read", stacklevel=2)
    return records


def _keep_until(path: Path, step: int) -> None:
    """Rewrite `path` without the records after `step`, atomically."""
    if not path.is_file():
        return
    kept = [record for record in read_jsonl(path) if record.get("step", 0) <= step]
    write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))


class JsonLines:
    """`directory`/metrics.jsonl, one line per log event and per evaluation:
    `{"step", "time", "train/loss", ...}`; and samples.jsonl, `{"step", "time", "name", "text"}` per
    preview text. Lines are flushed as written."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._files: dict[str, Any] = {}

    def start(self, step: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for name in (METRICS, SAMPLES):
            _keep_until(self.directory / name, step)

    def _write(self, name: str, record: dict[str, Any]) -> None:
        if name not in self._files:
            self._files[name] = open(self.directory / name, "a", encoding="utf-8")
        self._files[name].write(json.dumps(record) + "\n")
        self._files[name].flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._write(METRICS, {"step": step, "time": time.time(), **{k: float(v) for k, v in values.items()}})

    def texts(self, step: int, name: str, texts: Sequence[str]) -> None:
        for text in texts:
            self._write(SAMPLES, {"step": step, "time": time.time(), "name": name, "text": text})

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files = {}


class TensorBoard:
    """TensorBoard event files in `directory`: every scalar under its own tag, previews as text.

    A resumed run's writer carries a purge step, so TensorBoard drops the events a stopped run wrote
    after its last checkpoint.
    """

    def __init__(self, directory: str | os.PathLike):
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise ImportError("TensorBoard event files need tensorboardX: pip install tensorboardX") from None
        self.directory = Path(directory)
        self.writer = None

    def start(self, step: int) -> None:
        from tensorboardX import SummaryWriter

        # Two writers opened within one second would otherwise share a file name.
        suffix = f".{os.getpid()}.{time.time_ns()}"
        # TensorBoard drops the events at and after the purge step: those a stopped run wrote past `step`.
        self.writer = SummaryWriter(str(self.directory), purge_step=step + 1 if step else None, filename_suffix=suffix)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, float(value), step)
        self.writer.flush()

    def texts(self, step: int, name: str, texts: Sequence[str]) -> None:
        for index, text in enumerate(texts):
            self.writer.add_text(f"{name}/{index}", text, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandB:
    """Weights & Biases, in `mode` "offline" (files under `directory`/wandb for `wandb sync`) or
    "online". `run_id` names the W&B run, so a resumed run continues it; `config` is recorded with it.
    """

    def __init__(self, directory: str | os.PathLike, project: str, *, run_id: str, mode: str = "offline",
                 config: Mapping[str, Any] | None = None):
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ImportError(
                f"--trainer.wandb {project} needs the wandb package: pip install wandb, or leave --trainer.wandb unset"
            ) from None
        if mode not in ("offline", "online"):
            raise ValueError(f"W&B mode is {mode!r}; use 'offline' or 'online'")
        self.directory, self.project, self.run_id, self.mode = Path(directory), project, run_id, mode
        self.config = dict(config or {})
        self.run = None

    def start(self, step: int) -> None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, dir=str(self.directory), mode=self.mode, id=self.run_id,
                              resume="allow", config=self.config)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({name: float(value) for name, value in values.items()}, step=step)

    def texts(self, step: int, name: str, texts: Sequence[str]) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=["step", "text"], data=[[step, text] for text in texts])}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
