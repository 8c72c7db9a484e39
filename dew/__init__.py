"""Dew: train language models and generate from them, on JAX, Flax and optax."""

from dew import metrics, models
from dew.data.dataset import Dataset
from dew.runs import pipeline
from dew.training import Trainer

__all__ = ["Dataset", "Trainer", "metrics", "models", "pipeline"]
__version__ = "0.1.0"

