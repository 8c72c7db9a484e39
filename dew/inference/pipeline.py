"""`dew.pipeline(source)`: a generation task from a run directory or a published checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from dew import models
from dew.inference.text import TextGeneration
from dew.sampling import Sampling


def pipeline(source: str | os.PathLike, *, ema: bool = True, step: int | None = None, **load) -> TextGeneration:
    """The decoder behind `source` as a `TextGeneration` task, with the source's sampling and budget.

    A run directory (it holds `run.json`) rebuilds the recorded model and tokenizer and reads the
    checkpoint at `step` (default the latest): the averaged weights when `ema` is set and the run
    keeps them, else the live ones. Anything else is a published checkpoint for
    `dew.interop.load_pretrained(source, **load)`. Either way the weights are placed once on the
    current device mesh, split as the Trainer splits them (`mesh=MeshSpec()`, `layout=Layout()`
    unless `load` names others; those two are the only options a run directory takes).
    """
    from dew.training.mesh import Layout, MeshSpec

    path = Path(source)
    if (path / "run.json").is_file():
        unknown = sorted(set(load) - {"mesh", "layout"})
        if unknown:
            raise TypeError(f"a run directory takes only the placement options mesh= and layout=; got {unknown}")
        return _from_run(path, ema=ema, step=step, mesh=load.get("mesh") or MeshSpec(),
                         layout=load.get("layout") or Layout())
    try:
        from dew.interop import load_pretrained
    except ImportError as error:
        raise ValueError(
            f"{source} is not a run directory (no run.json), and loading published checkpoints is not available: {error}"
        ) from None

    return load_pretrained(source, **{"mesh": MeshSpec(), "layout": Layout(), **load}).text_generation()


def _from_run(path: Path, *, ema: bool, step: int | None, mesh, layout) -> TextGeneration:
    from dew.recipes.run_dir import RunDirectory
    from dew.training.checkpoints import Checkpoints

    run = RunDirectory(path)
    record = run.record()
    model = models.build(record["model"]["name"], **record["model"]["config"])
    checkpoints = Checkpoints(path / "checkpoints", keep=None)
    try:
        if checkpoints.latest() is None:
            raise FileNotFoundError(f"{path} has no checkpoint yet: train it first (its run.json holds the command)")
        saved = checkpoints.restore_tree(step)
    finally:
        checkpoints.close()
    use_ema = ema and saved.get("ema") is not None
    params = saved["ema"] if use_ema else saved["params"]
    params = jax.device_put(params, layout.shardings(mesh.build(), params))
    generation = record.get("generation", {})
    sampling = Sampling(**generation.get("sampling", {}))
    budget = generation.get("max_new_tokens") or None
    return TextGeneration(model, params, tokenizer=run.tokenizer(), sampling=sampling, max_new_tokens=budget)
