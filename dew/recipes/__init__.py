"""Recipes: configs on the command line, and the run directories they train into.

`dew.recipes.lm` is the language-model recipe (`recipes/lm/train.py`, `dew train`) and `run_dir`
what a run leaves behind; `dew.run_config` holds the parts every recipe's config shares (outside
this package, so objectives can name them without importing recipes).
"""

from dew.recipes.run_dir import RunDirectory, RunMismatch, RunRecordError, find_runs
from dew.recipes.run_lock import RunLocked
from dew.run_config import DataSpec, ModelConfig, OptimConfig, TrainerConfig

__all__ = ["DataSpec", "ModelConfig", "OptimConfig", "RunDirectory", "RunLocked", "RunMismatch", "RunRecordError",
           "TrainerConfig", "find_runs"]
