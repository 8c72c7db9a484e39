"""How a command reports an exception: one line on stderr and an exit status, never a traceback
for a refusal or a fault of the environment.

    0    done
    1    the environment failed: a permission, a read-only or full disk, a missing optional
         package, a run directory another process holds, a run that diverged
    2    refused: the command asked for something wrong (a bad value, a missing input file)
    128 + N   stopped by signal N (SIGINT 130, SIGTERM 143) after saving what it could

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings

# The library's refusals of what it was asked: the fix is in the command.
REFUSALS = (ValueError, TypeError, NotImplementedError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            FileExistsError)
# What the machine or the run did: the fix is outside the command (FloatingPointError is a diverged run).
FAULTS = (OSError, ImportError, FloatingPointError)

ADVICE = {
    errno.EACCES: "check its permissions, or choose a directory this user can write",
    errno.EPERM: "check its permissions, or choose a directory this user can write",
    errno.EROFS: "the file system is read-only: choose a directory on a writable one",
    errno.ENOSPC: "the disk is full: free space (or choose another disk) and rerun the same command",
    errno.EDQUOT: "the disk quota is used up: free space and rerun the same command",
}


def describe(error: BaseException) -> str:
    """The error as the line a command prints after `error: `; an OSError raised by the system
    (errno, strerror, filename) reads as `PATH: PROBLEM: FIX`."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        advice = ADVICE.get(error.errno)
        return f"{os.fsdecode(error.filename)}: {error.strerror}" + (f": {advice}" if advice else "")
    if isinstance(error, OSError) and error.strerror and error.errno in ADVICE:
        return f"{error.strerror}: {ADVICE[error.errno]}"
    return str(error) or type(error).__name__


def exit_status(error: BaseException) -> int | None:
    """2 for a refusal, 1 for a fault of the environment, None for a bug (which should propagate)."""
    if isinstance(error, REFUSALS):
        return 2
    if isinstance(error, FAULTS):
        return 1
    return None


def report(error: BaseException) -> int:
    """Print `error: ...` for a refusal or a fault and return its exit status; re-raise a bug."""
    status = exit_status(error)
    if status is None:
        raise error
    print(f"error: {describe(error)}", file=sys.stderr)
    return status


def one_line_warnings() -> None:
    """Print warnings as `warning: MESSAGE`, one line each, as a command's other messages read."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show
