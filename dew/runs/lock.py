"""`RunLock`: one process at a time trains a run directory.

The lock is `flock` on RUN/run.lock, which the kernel releases when the process ends however it
ends (kill -9 included), so a dead process never keeps a run. The holder writes its pid, host and
start time into the file, for the message a second process gets.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK = "run.lock"


class RunLocked(BlockingIOError):
    """Another process holds the run directory (it is training it)."""


class RunLock:
    """The lock of the run directory `path`: `take()` creates the directory and holds it, `release()`
    lets it go."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = None

    def take(self) -> None:
        """Hold the directory (creating it), or raise `RunLocked` naming the process that holds it."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = open(self.path / LOCK, "a+", encoding="utf-8")
        except OSError as error:
            raise type(error)(
                f"cannot create the run directory's files in {self.path} ({error.strerror}: {error.filename}): "
                f"pass --trainer.run-dir with a directory this user can write"
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read()
            handle.close()
            raise RunLocked(_held_message(self.path, holder)) from None
        handle.truncate(0)
        since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


def _held_message(path: Path, holder: str) -> str:
    try:
        who = json.loads(holder)
        process = f"process {who['pid']} on {who['host']} (since {who['since']})"
        stop = f"stop it (kill {who['pid']} saves a checkpoint first)"
    except (json.JSONDecodeError, KeyError, TypeError):
        process, stop = "another process", "stop it"
    return (f"{path} is held by {process}, which is training it: wait for it to finish or {stop}, then rerun "
            f"this command; or pass another --trainer.run-dir")
