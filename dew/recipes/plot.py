"""`plot_runs`: the loss and perplexity of runs, train and validation, against steps and tokens, in one PNG."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from dew.runs.run_dir import RunDirectory

QUANTITIES = ("loss", "perplexity")
SPLITS = {"train": dict(linestyle="-"), "val": dict(linestyle="--", marker="o", markersize=3)}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'dew-ml[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display is needed or opened
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_runs(runs: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Draw every run in `runs` (run directories) onto one 2x2 figure and save it as `out`.

    Rows are the loss and the perplexity (log scale), columns the step and the tokens trained on
    (run.json's tokens_per_step times the step); a run has one colour, train a solid line and
    validation a dashed one with markers.
    """
    if not runs:
        raise ValueError("no run to plot: name at least one run directory")
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(len(QUANTITIES), 2, figsize=(12, 8), squeeze=False)
    drawn = 0
    for index, run in enumerate(runs):
        directory = RunDirectory(run)
        record = directory.record()
        if record is None:
            raise FileNotFoundError(f"{run} holds no run.json: name a directory a recipe trained into")
        metrics = directory.metrics()
        for row, quantity in enumerate(QUANTITIES):
            for split, style in SPLITS.items():
                points = [(entry["step"], entry[f"{split}/{quantity}"]) for entry in metrics
                          if f"{split}/{quantity}" in entry]
                if not points:
                    continue
                drawn += 1
                steps, values = zip(*points)
                for column, scale in enumerate((1, record["tokens_per_step"])):
                    axes[row][column].plot([step * scale for step in steps], values, color=f"C{index % 10}",
                                           label=f"{run} {split}", **style)
    if drawn == 0:
        raise ValueError(f"none of {[str(run) for run in runs]} has logged a loss yet (metrics.jsonl is empty)")
    for row, quantity in enumerate(QUANTITIES):
        for column, unit in enumerate(("step", "tokens")):
            axis = axes[row][column]
            axis.set_xlabel(unit)
            axis.set_ylabel(quantity)
            axis.grid(True, alpha=0.3)
            if quantity == "perplexity":
                axis.set_yscale("log")
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    pyplot.close(figure)
    return out
