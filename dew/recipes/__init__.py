"""Recipes: configs on the command line (`dew.recipes.lm`, `dew train`), and the commands built on run
directories (`export`, `plot`). `dew.run_config` holds the parts every recipe's config shares (below the
objectives, which name them); the run directories themselves are `dew.runs`."""

from dew.run_config import DataSpec, ModelConfig, OptimConfig, TrainerConfig

__all__ = ["DataSpec", "ModelConfig", "OptimConfig", "TrainerConfig"]
