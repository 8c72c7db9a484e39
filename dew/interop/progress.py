"""Progress of long checkpoint work (a load's tensors, a save's shards): a rich bar of bytes done on
stderr when stderr is a terminal, nothing otherwise (pipes, logs, tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


def _console() -> Console:
    return Console(stderr=True)


@contextlib.contextmanager
def byte_progress(description: str, total_bytes: int) -> Iterator[Callable[[int], None]]:
    """Yield `advance(nbytes)`, which moves a bar of `total_bytes` on a terminal and does nothing elsewhere.

    The bar is transient: it is gone once the work is done, leaving the terminal as it was.
    """
    console = _console()
    if not console.is_terminal:
        yield lambda nbytes: None
        return
    columns = (TextColumn(description), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total_bytes)
        yield lambda nbytes: progress.advance(task, nbytes)
