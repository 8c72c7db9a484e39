"""Recipes: configs on the command line, and the run directories they train into.

`dew.recipes.lm` is the language-model recipe (`recipes/lm/train.py`, `dew train`); `config` holds
the parts every recipe's config shares and `run_dir` what a run leaves behind.
"""

from dew.recipes.config import DataSpec, ModelConfig, OptimConfig, TrainerConfig
from dew.recipes.run_dir import RunDirectory, RunMismatch, find_runs

__all__ = ["DataSpec", "ModelConfig", "OptimConfig", "RunDirectory", "RunMismatch", "TrainerConfig", "find_runs"]
