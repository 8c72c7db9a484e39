"""What a run shows while it trains: a rich progress bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def format_values(values: dict[str, float]) -> str:
    parts = []
    for name, value in values.items():
        if name.endswith("tokens_per_s"):
            parts.append(f"{name} {value:,.0f}")
        elif name.endswith("step_s"):
            parts.append(f"{name} {value:.3f}")
        else:
            parts.append(f"{name} {value:.4g}")
    return " | ".join(parts)


class Reporter:
    """Prints one line per log event; on a terminal also a bar with the ETA and the latest loss."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.console = Console(file=sys.stdout)
        self.enabled = enabled
        self.progress = None
        if enabled and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True,
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

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
