"""A run directory: what a recipe run leaves behind, and how a rerun of the same command finds it.

    RUN/run.json                 the resolved config, package versions and tokenizer (written when the
                                 run starts; again only when --trainer.allow-changes changes a setting)
    RUN/run.lock                 held (flock) by the one process training the run, with its pid
    RUN/tokenizer.json           the run's own copy of its tokenizer (and tokenizer_config.json and
                                 chat_template.jinja), so generation needs nothing outside the directory
    RUN/status.json              running, finished, interrupted, diverged or failed; the process and its host
    RUN/checkpoints/STEP/        Orbax checkpoints, the newest trainer.keep of them
    RUN/metrics.jsonl            one line per logged step and per evaluation
    RUN/samples.jsonl            the preview texts of each evaluation
    RUN/events.out.tfevents.*    TensorBoard (`tensorboard --logdir RUN`, or the directory of runs)
    RUN/wandb/                   Weights & Biases' files, when --trainer.wandb is set
    RUN/adapter/                 a LoRA run's adapters in PEFT's format, written when it finishes

run.json's `settings` is the command's config as JSON, its paths made absolute; `model` the model's
resolved keywords; `data` the data's shape (meta.json's record, seq_len) and its `fingerprint`, a
hash of its contents (`dew.data.token_files.fingerprint`, `dew.data.chat_data.rows_fingerprint`);
`tokenizer`, `generation` what generation from the run needs; `changes` what a rerun changed with
--trainer.allow-changes (settings, or the data's fingerprint), each with the step it took effect at.
"""

from __future__ import annotations

import datetime
import errno
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dew.data import load_tokenizer
from dew.data.tokenizers import BYTE, HFTokenizer
from dew.files import read_json, write_atomically
from dew.runs.lock import LOCK, RunLock
from dew.training.trackers import METRICS, read_jsonl

RUN_JSON, STATUS, CHECKPOINTS = "run.json", "status.json", "checkpoints"
TOKENIZER = "tokenizer.json"
# 2: settings' paths are absolute, so a rerun from another directory compares the same files; the
# run keeps a copy of its tokenizer. 3: `data` holds the data's fingerprint.
FORMAT = 3
# run.json's record of the data's contents: a rerun on other contents is refused unless
# --trainer.allow-changes names it. A run from before format 3 records none, and takes the data's
# fingerprint as it is at its next rerun.
FINGERPRINT = "data.fingerprint"

# What a rerun may change: these decide what is logged and kept, not what is trained.
MAY_CHANGE = ("trainer.run_dir", "trainer.log_every", "trainer.eval_every", "trainer.val_batch",
              "trainer.checkpoint_every", "trainer.keep", "trainer.wandb", "trainer.wandb_mode",
              "trainer.allow_changes")
# The parts of run.json that decide what the run trains. The model is compared as built (defaults
# filled in), not as --model.config spelled it.
COMPARED = ("recipe", "settings", "model", "data")
# Model fields added since runs were first recorded, with the value that computes what a run recorded
# without them did: a run.json that lacks one reads as that value, not as a difference.
ADDED_FIELDS = {"model.config.kernels": "auto", "model.config.recurrent": None, "model.config.attn_output_gate": False,
                "model.config.embedding_scale": 1.0, "model.config.residual_scale": 1.0,
                "model.config.logit_divisor": 1.0, "model.config.attention_chunk_size": None,
                "model.config.nope": None, "settings.lora.within": None}
_SPELLED = "settings.model.config."
# Settings that name files: recorded and compared as absolute paths (a hub name that is not a local
# path stays as is). A data source has only some of them (data:chat's template and val_path).
PATH_SETTINGS = ("data.path", "data.tokenizer", "data.template", "data.val_path", "tokenizer", "pretrained")
_PACKAGES = ("dew-ml", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "tokenizers")


class RunMismatch(ValueError):
    """A run directory holds a run that the command does not describe."""


class RunRecordError(ValueError):
    """run.json cannot be read: not JSON, or not a run's record."""


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


def resolve_path_setting(value: Any) -> Any:
    """A path setting as an absolute, normalised path when it names something on disk (else as given)."""
    if isinstance(value, str) and value and os.path.exists(value):
        return os.path.abspath(value)
    return value


def _compared(record: dict[str, Any]) -> dict[str, Any]:
    flat = flatten({key: record.get(key) for key in COMPARED})
    for name, value in ADDED_FIELDS.items():
        flat.setdefault(name, value)
    for name in PATH_SETTINGS:
        if f"settings.{name}" in flat:
            flat[f"settings.{name}"] = resolve_path_setting(flat[f"settings.{name}"])
    return {name: value for name, value in flat.items() if not name.startswith(_SPELLED)}


def _flag(name: str) -> str:
    """`settings.optim.learning_rate` -> `--optim.learning-rate`; `model.config.x` -> `--model.config's x`."""
    if name.startswith("model.config."):
        return f"--model.config's {name.removeprefix('model.config.')}"
    if name.startswith("settings."):
        return "--" + name.removeprefix("settings.").replace("_", "-")
    return name


def _short(name: str) -> str:
    """A run.json path as --trainer.allow-changes names it: `settings.optim.b1` -> `optim.b1`."""
    return name.removeprefix("settings.")


def _set(record: dict[str, Any], name: str, value: Any) -> None:
    """Set the value at the dotted path `name` of `record` (its parents exist)."""
    *parents, leaf = name.split(".")
    for part in parents:
        record = record[part]
    record[leaf] = value


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, record: dict[str, Any]) -> None:
    write_atomically(path, json.dumps(record, indent=2) + "\n")


def _read_json(path: Path, what: str) -> Any:
    """A JSON file's value, or RunRecordError naming the file, the problem and the fix."""
    value, problem = read_json(path)
    if problem is None:
        return value
    raise RunRecordError(f"{path} {problem}: it was edited or cut short; {what}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunDirectory:
    """The run directory at `path` (see the module's docstring for its files).

    `open` takes the directory's lock for this process; `close` (or the process's end, even by
    kill -9) releases it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = RunLock(self.path)

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def record(self) -> dict[str, Any] | None:
        """run.json, or None when the directory holds no run; RunRecordError when it cannot be read."""
        path = self.path / RUN_JSON
        if not path.is_file():
            return None
        fix = f"restore it from a backup, or move {self.path} aside and start the run again"
        record = _read_json(path, fix)
        if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
            raise RunRecordError(f"{path} is JSON but not a run's record (it has no model); {fix}")
        return record

    def open(self, record: dict[str, Any], allow_changes: Sequence[str] = (),
             keep: Mapping[str, Path] | None = None) -> list[str]:
        """Start a run described by `record`, or find the same run to resume; hold the directory.

        Refuses, writing nothing, a path that is not a directory or a directory holding something
        other than a run; then takes the lock (`RunLocked` names the process that has it). A new run
        writes run.json with the package versions and the time. An existing one must agree with
        `record` in every setting but those in MAY_CHANGE, and in its data's shape and fingerprint,
        but for what `allow_changes` names (RESUMABLE_CHANGES: optimizer settings such as
        "optim.learning_rate", or "data.fingerprint"), else `RunMismatch` says what differs. An
        allowed change is written into run.json and appended to its `changes` with the step of the
        checkpoint it continues from. `keep` maps file names to the files the
        run keeps a copy of (its tokenizer's): copied when missing, and a tokenizer.json that differs
        from the run's copy is refused. Returns notes on what differs harmlessly (package versions)
        and on the changes made.
        """
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"--trainer.run-dir {self.path} is a file: pass a directory (new or a run's)")
        if self.path.is_dir() and not (self.path / RUN_JSON).is_file() and any(
                entry.name != LOCK for entry in self.path.iterdir()):
            raise RunMismatch(
                f"{self.path} is not empty and holds no {RUN_JSON}, so it is not a Dew run: pass "
                f"--trainer.run-dir with a new or empty directory"
            )
        self._lock.take()
        try:
            saved = self.record()
            if saved is None:
                _write_json(self.path / RUN_JSON,
                            {"format": FORMAT, **record, "versions": versions(), "created": _now()})
                self._keep(keep or {})
                return []
            self._check_kept(keep or {})
            notes = self._compare(record, saved, allow_changes)
            self._keep(keep or {})
        except BaseException:
            self.close()
            raise
        now = versions()
        return [f"{package} was {version} when the run started and is {now.get(package)} now"
                for package, version in saved.get("versions", {}).items() if now.get(package) != version] + notes

    def _compare(self, record: dict[str, Any], saved: dict[str, Any], allow_changes: Sequence[str]) -> list[str]:
        """Refuse a record that differs from the run's beyond what may change; apply allowed changes."""
        ours, theirs = _compared(record), _compared(saved)
        unrecorded = FINGERPRINT in ours and FINGERPRINT not in theirs
        if unrecorded:
            theirs[FINGERPRINT] = ours[FINGERPRINT]
        differing = [name for name in sorted(set(ours) | set(theirs))
                     if ours.get(name) != theirs.get(name) and name.removeprefix("settings.") not in MAY_CHANGE]
        allowed = [name for name in differing if name.removeprefix("settings.") in allow_changes]
        differing = [name for name in differing if name not in allowed]
        # What the command says first; what follows from it (the built model) only when it says the same.
        differing = [name for name in differing if name.startswith("settings.")] or differing
        if differing:
            differences = [self._difference(name, theirs.get(name), ours.get(name), record) for name in differing]
            latest = saved.get("changes", [{}])[-1].get("command") or saved.get("command")
            started = shlex.join(latest) if latest else "(not recorded)"
            from dew.run_config import RESUMABLE_CHANGES  # optax, tyro and Grain load when a run is checked

            changeable = [name.removeprefix("settings.") for name in differing
                          if name.removeprefix("settings.") in RESUMABLE_CHANGES]
            continuing = (f"\nTo continue this run from its last checkpoint as this command describes it, add "
                          f"--trainer.allow-changes {' '.join(name.replace('_', '-') for name in changeable)}."
                          if len(changeable) == len(differing) else "")
            raise RunMismatch(
                f"{self.path} holds a run that this command does not describe:\n" + "\n".join(differences) +
                f"\nThe run was started with: {started}\nRerun that command to resume it, or start a new run "
                f"with --trainer.run-dir NEW_DIRECTORY (or delete {self.path} to start this one over)." + continuing
            )
        changed = {_short(name) for name in allowed}
        notes = [f"--trainer.allow-changes {name.replace('_', '-')}: the run already has this value"
                 for name in allow_changes if name not in changed]
        if unrecorded:
            _set(saved, FINGERPRINT, ours[FINGERPRINT])
            notes.append(f"{self.path / RUN_JSON} recorded no fingerprint of the data (the run started before runs "
                         f"kept one): it now records that of the data as it is, {ours[FINGERPRINT]}, which later "
                         "reruns must match")
        if allowed:
            notes.append(self._change(saved, record, allowed))
        if allowed or unrecorded:
            _write_json(self.path / RUN_JSON, saved)
        return notes

    @staticmethod
    def _difference(name: str, theirs: Any, ours: Any, record: dict[str, Any]) -> str:
        """One line of a refusal: what the run has and what the command has for `name`."""
        if name == FINGERPRINT:
            path = record.get("settings", {}).get("data", {}).get("path")
            return (f"  --data.path {path}: its contents are not those the run trained on (their fingerprint "
                    f"was {theirs}, now {ours}): the files were replaced or changed")
        return f"  {_flag(name)}: the run has {json.dumps(theirs)}, this command {json.dumps(ours)}"

    def _change(self, saved: dict[str, Any], record: dict[str, Any], names: list[str]) -> str:
        """Set `names`' (run.json paths: settings.optim.learning_rate, data.fingerprint) new values from
        `record` in `saved`, appending the change and the step it takes effect at to its `changes`."""
        values = {name: (flatten(saved).get(name), flatten(record).get(name)) for name in names}
        clip = values.get("settings.optim.clip_grads")
        if clip is not None and None in clip:
            raise RunMismatch(
                f"{self.path}: optim.clip_grads cannot change between {clip[0]} and {clip[1]} within a run (clipping "
                "adds a step to the optimizer, so the checkpoint's optimizer state no longer fits): change it "
                "between two norms, or start a new run"
            )
        saved_steps_ = self.checkpoint_steps()
        step = saved_steps_[-1] if saved_steps_ else 0
        if step >= saved["settings"]["trainer"]["steps"]:
            return f"the run finished at step {step}, so its settings stay as they were (nothing is left to train)"
        change: dict[str, Any] = {"step": step}
        for name, (old, new) in values.items():
            _set(saved, name, new)
            part, rest = name.split(".", 1)
            change.setdefault(part, {})[rest] = {"from": old, "to": new}
        change.update(command=record.get("command"), time=_now())
        saved["changes"] = [*saved.get("changes", []), change]
        listed = ", ".join(f"{_short(name)} {old} -> {new}" for name, (old, new) in values.items())
        return f"changed {listed}, from step {step} on (recorded in {self.path / RUN_JSON})"

    def _check_kept(self, keep: Mapping[str, Path]) -> None:
        copy = self.path / TOKENIZER
        if TOKENIZER in keep and copy.is_file() and copy.read_bytes() != keep[TOKENIZER].read_bytes():
            raise RunMismatch(
                f"the command's tokenizer {keep[TOKENIZER]} is not the one {self.path} was trained with (its copy "
                f"{copy} differs): pass --tokenizer {self.path}, or start a new run with --trainer.run-dir NEW_DIRECTORY"
            )

    def _keep(self, keep: Mapping[str, Path]) -> None:
        """Copy the files the run keeps (each written beside, then renamed into place)."""
        for name, source in keep.items():
            copy = self.path / name
            if not copy.is_file():
                partial = copy.with_name(name + ".partial")
                shutil.copyfile(source, partial)
                os.replace(partial, copy)

    def tokenizer(self):
        """The run's tokenizer: its own copy, else bytes; a run from before runs kept a copy loads it by
        the name run.json records, unless that name is a path relative to where the run was started. One whose
        vocabulary is not the one the run trained on (run.json's data) is refused, naming both sizes."""
        record = self.record() or {}
        if (self.path / TOKENIZER).is_file():
            tokenizer, source = HFTokenizer(self.path), str(self.path / TOKENIZER)
        else:
            name = record.get("tokenizer", BYTE)
            if name != BYTE and not os.path.isabs(name) and (os.sep in name or name.startswith(".")):
                raise FileNotFoundError(
                    f"{self.path} holds no {TOKENIZER}, and its run.json names the tokenizer {name!r}, a path "
                    f"relative to the directory the run was started in: copy that {TOKENIZER} into {self.path}/"
                )
            tokenizer, source = load_tokenizer(name), f"the tokenizer {name!r} (run.json's)"
        _check_vocabulary(tokenizer, source, record, self.path)
        return tokenizer

    def close(self) -> None:
        """Release the directory's lock (kept until then by `open`)."""
        self._lock.release()

    def set_status(self, state: str, step: int | None = None, message: str | None = None, **details: Any) -> None:
        """Record the run's state (running, finished, interrupted, diverged or failed) and `details`.

        On a full disk the new file cannot be written beside the old one, so the record is written
        over status.json in place (its block is already allocated): a run that stops for want of
        space still says so.
        """
        record = {"state": state, "step": step, "message": message, **details, "pid": os.getpid(),
                  "host": socket.gethostname(), "updated": _now()}
        path = self.path / STATUS
        try:
            _write_json(path, record)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT) or not path.is_file():
                raise
            path.with_name(path.name + ".partial").unlink(missing_ok=True)
            with open(path, "r+", encoding="utf-8") as handle:
                handle.write(json.dumps(record, indent=2) + "\n")
                handle.truncate()

    def status(self) -> dict[str, Any]:
        """status.json, with a `running` run whose process is gone on this host reported as `killed`;
        `unknown`, with the reason as its message, when status.json cannot be read."""
        path = self.path / STATUS
        if not path.is_file():
            return {"state": "new"}
        try:
            status = _read_json(path, "the next run of the command rewrites it")
        except RunRecordError as error:
            return {"state": "unknown", "message": str(error)}
        if not isinstance(status, dict) or "state" not in status:
            return {"state": "unknown", "message": f"{path} holds no state: the next run of the command rewrites it"}
        if status["state"] == "running" and status.get("host") == socket.gethostname() and not _alive(status["pid"]):
            status = {**status, "state": "killed",
                      "message": f"process {status['pid']} ended without recording why (killed, or the machine stopped)"}
        return status

    def metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records, in the order written; each line skipped (not a record, or a last one cut
        short) is named in a warning."""
        return read_jsonl(self.path / METRICS, warn_cut_short=True)

    def checkpoint_steps(self) -> list[int]:
        from dew.training.checkpoints import saved_steps  # Orbax loads when a run's checkpoints are read

        return saved_steps(self.checkpoints)

    def summary(self) -> dict[str, Any]:
        """The run at a glance: status and why, last logged step of how many, latest checkpoint, last losses."""
        metrics, saved, status = self.metrics(), self.checkpoint_steps(), self.status()
        try:
            record = self.record() or {}
        except RunRecordError as error:
            record, status = {}, {**status, "state": "unreadable", "message": str(error)}
        last = lambda key: next((entry[key] for entry in reversed(metrics) if key in entry), None)
        return {
            "run": str(self.path), "status": status["state"],
            "step": max([entry.get("step", 0) for entry in metrics[-1:]] + saved[-1:], default=0),
            "steps": record.get("settings", {}).get("trainer", {}).get("steps"),
            "checkpoint": saved[-1] if saved else None,
            "train/loss": last("train/loss"), "val/loss": last("val/loss"), "val/perplexity": last("val/perplexity"),
            "updated": status.get("updated"),
            "why": status.get("message") if status["state"] not in ("running", "finished") else None,
        }


def _check_vocabulary(tokenizer, source: str, record: dict[str, Any], path: Path) -> None:
    """Refuse a tokenizer whose vocabulary is not the one the run's ids mean: the run trained on ids of its data's
    vocabulary (run.json's data.vocab_size), and its model's head scores them all. A smaller tokenizer cannot
    decode the ids the model generates past its end (they would vanish from the text); a larger one encodes
    prompts into ids the model never learned, or has no embedding for."""
    head = record.get("model", {}).get("config", {}).get("vocab_size")
    trained = record.get("data", {}).get("vocab_size")
    expected = trained if isinstance(trained, int) else head
    if not isinstance(expected, int) or tokenizer.vocab_size == expected:
        return
    over = (f"the model's head scores {head:,} ids" if isinstance(head, int) else "")
    data = f"the run trained on ids of a {trained:,}-token vocabulary (run.json's data)" if isinstance(trained, int) else ""
    said = "; ".join(part for part in (data, over) if part)
    raise ValueError(f"{source} holds {tokenizer.vocab_size:,} tokens, and {said}: it is not the tokenizer {path} "
                     f"was trained with; put that run's {TOKENIZER} back in {path}/ (tokenize the data again with "
                     "another tokenizer and train a new run to use this one)")


def run_files_without_record(path: Path) -> list[str]:
    """The files of a run directory that `path` holds although it holds no run.json (its checkpoints, status,
    metrics, lock): [] when it holds run.json, or none of them."""
    if not path.is_dir() or (path / RUN_JSON).is_file():
        return []
    return [name for name in (CHECKPOINTS, STATUS, METRICS, LOCK) if (path / name).exists()]


def find_runs(directory: str | os.PathLike) -> list[RunDirectory]:
    """`directory` itself when it is a run, else every run below it, sorted by path."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    if (root / RUN_JSON).is_file():
        return [RunDirectory(root)]
    return [RunDirectory(path.parent) for path in sorted(root.rglob(RUN_JSON))]
