"""Generation tasks over trained weights."""

from dew.inference.pipeline import pipeline
from dew.inference.text import TextGeneration

__all__ = ["TextGeneration", "pipeline"]
