"""What a run shows while it trains: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Off a terminal, a long validation pass prints a line this often (seconds), so logs show it is alive.
PASS_LINE_SECONDS = 30.0
# The bar redraws this often: each step moves it anyway, and rich's default 10 Hz redraws take CPU time
# that a small machine's train step would otherwise have.
REFRESH_PER_SECOND = 2


def format_values(values: dict[str, float]) -> str:
    parts = []
    for name, value in values.items():
        if name.endswith("tokens_per_s"):
            parts.append(f"{name} {value:,.0f}")
        elif name == "mfu":  # a fraction of the machine's peak, read as a percentage
            parts.append(f"{name} {value:.1%}")
        elif name.endswith("_s"):  # durations in seconds: step_s, checkpoint_s, eval_s
            parts.append(f"{name} {value:.3f}")
        else:
            parts.append(f"{name} {value:.4g}")
    return " | ".join(parts)


class Reporter:
    """Prints one line per log event; on a terminal also a bar with the ETA and the latest loss, and
    a second bar while a validation pass runs (off a terminal, a line every `PASS_LINE_SECONDS`)."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.console = Console(file=sys.stdout)
        self.enabled = enabled
        self.progress = None
        self.pass_task = None
        self.pass_name, self.pass_started, self.pass_last_line = "", 0.0, 0.0
        if enabled and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=True, refresh_per_second=REFRESH_PER_SECOND,
            )
            self.task = self.progress.add_task("train", total=total, completed=start, loss="")
            self.progress.start()

    def advance(self, step: int, loss: float | None = None) -> None:
        if self.progress is not None:
            fields = {} if loss is None else {"loss": f"loss {loss:.4f}"}
            self.progress.update(self.task, completed=step, **fields)

    def line(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    # -- a pass over a split of unknown length (validation) -----------------------------------------
    def pass_begin(self, name: str) -> None:
        """Start showing a pass named `name` (e.g. "val"), counted in batches."""
        self.pass_name = name
        self.pass_started = self.pass_last_line = time.perf_counter()
        if self.progress is not None:
            self.pass_task = self.progress.add_task(name, total=None, loss="batches")

    def pass_advance(self, batches: int) -> None:
        """`batches` of the pass are scored."""
        if self.pass_task is not None:
            self.progress.update(self.pass_task, completed=batches)
        elif self.enabled and time.perf_counter() - self.pass_last_line >= PASS_LINE_SECONDS:
            self.pass_last_line = time.perf_counter()
            self.line(f"{self.pass_name}: {batches} batches scored in {self.pass_last_line - self.pass_started:.0f} s")

    def pass_end(self) -> None:
        if self.pass_task is not None:
            self.progress.remove_task(self.pass_task)
            self.pass_task = None

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
