"""Recipes: configs on the command line (`dew.recipes.lm`, `dew train`), and the commands built on run
directories (`export`, `plot`). `dew.run_config` holds the parts every recipe's config shares (below the
objectives, which name them); the run directories themselves are `dew.runs`."""

from dew.lazy import lazy_names

__all__ = ["DataSpec", "ModelConfig", "OptimConfig", "TrainerConfig"]
# Imported when first used: `dew plot` reads run records without the training stack (jax, optax, Orbax).
__getattr__, __dir__ = lazy_names(__name__, {name: "dew.run_config" for name in __all__})
