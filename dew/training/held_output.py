"""`HeldOutput`: what Orbax's and TensorStore's threads print while a checkpoint is written or read,
held back so that a failure reads as the one line Dew says about it.

A failed save or read makes the storage layer print hundreds of lines: absl log records of its
threads, tracebacks of callbacks into an event loop already closed, and, when the coroutines it
abandoned are collected, "Exception ignored" and "Task exception was never retrieved" reports.
Within `with HeldOutput() as held:` stderr and the `absl` and `asyncio` loggers are held; on
leaving, what was held is printed, unless `held.drop()` discarded it; after a drop, what the
storage layer's abandoned coroutines report when collected later (asyncio's "exception was never
retrieved", "coroutine ... was never awaited") is dropped too.
"""

from __future__ import annotations

import gc
import io
import logging
import sys
import time
import warnings

_LOGGERS = ("absl", "asyncio")
_STORAGE = ("orbax", "tensorstore")


def _from_storage(text: str) -> bool:
    return any(name in text for name in _STORAGE)


class _AbandonedReports(logging.Filter):
    """Drops asyncio's "Task (Future, _GatheringFuture) exception was never retrieved" for the storage
    layer's work."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        # asyncio names the object's class: Task, Future, _GatheringFuture ...
        if "exception was never retrieved" not in message.split("\n", 1)[0]:
            return True
        where = [message]
        traceback = record.exc_info[2] if record.exc_info else None
        while traceback is not None:
            where.append(traceback.tb_frame.f_code.co_filename)
            traceback = traceback.tb_next
        return not _from_storage(" ".join(where))


def _drop_abandoned_reports() -> None:
    """From now on in this process, drop what the storage layer's abandoned coroutines and tasks report
    when they are finally collected (possibly at exit, after any window a drop could wait for)."""
    if getattr(sys.unraisablehook, "dew_drops_storage_reports", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        code = getattr(unraisable.object, "cr_code", None)
        if code is not None and _from_storage(code.co_filename):
            return
        previous(unraisable)

    hook.dew_drops_storage_reports = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_AbandonedReports())
    # The writes jax's serialization had queued (`async_serialize_from_host.<locals>.write_fragment`)
    # warn when collected unawaited; only a failed storage operation leaves such coroutines behind.
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


class _Hold(logging.Filter):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


class HeldOutput:
    """A context holding stderr and the storage layer's log records; printed on exit unless dropped."""

    def __enter__(self) -> "HeldOutput":
        self.hold, self.printed, self.stderr = _Hold(), io.StringIO(), sys.stderr
        self.dropped = False
        for name in _LOGGERS:
            logging.getLogger(name).addFilter(self.hold)
        sys.stderr = self.printed
        return self

    def drop(self) -> None:
        """Discard what was held, after collecting what a failed operation abandoned (it reports when
        collected) and waiting, at most 2 s, until the storage layer's callbacks fall silent. Call it
        outside the `except` block of the failure, whose traceback keeps those objects alive."""
        _drop_abandoned_reports()
        gc.collect()
        for _ in range(20):
            heard = self.printed.tell()
            time.sleep(0.1)
            if self.printed.tell() == heard:
                break
        self.dropped = True

    def __exit__(self, kind, error, traceback) -> None:
        sys.stderr = self.stderr
        for name in _LOGGERS:
            logging.getLogger(name).removeFilter(self.hold)
        if self.dropped:
            return
        self.stderr.write(self.printed.getvalue())
        for record in self.hold.records:
            logging.getLogger(record.name).handle(record)
