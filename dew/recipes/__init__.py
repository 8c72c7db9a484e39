"""Recipes: configs on the command line, and the run directories they train into.

`dew.recipes.lm` is the language-model recipe (`recipes/lm/train.py`, `dew train`); `config` holds
the parts every recipe's config shares and `run_dir` what a run leaves behind.
"""

from dew.recipes.config import DataSpec, ModelConfig, OptimConfig, TrainerConfig
from dew.recipes.run_dir import RunDirectory, RunMismatch, RunRecordError, find_runs
from dew.recipes.run_lock import RunLocked

__all__ = ["DataSpec", "ModelConfig", "OptimConfig", "RunDirectory", "RunLocked", "RunMismatch", "RunRecordError",
           "TrainerConfig", "find_runs"]
