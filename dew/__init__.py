"""Dew: train language models and generate from them, on JAX, Flax and optax."""

from dew.lazy import lazy_names

__all__ = ["Dataset", "Trainer", "metrics", "models", "pipeline"]
__version__ = "0.1.0"
# The seed's top-level names, each imported when first used: `import dew` (and a server, which needs no
# trainer) does not pay for the training stack's imports (optax, Orbax, Grain).
__getattr__, __dir__ = lazy_names(__name__, {"Dataset": "dew.data.dataset", "Trainer": "dew.training",
                                             "metrics": "dew.metrics", "models": "dew.models",
                                             "pipeline": "dew.runs"})
