"""Generation tasks over trained weights."""

from dew.inference.canvas import CanvasGeneration
from dew.inference.masked import MaskedGeneration
from dew.inference.pipeline import pipeline
from dew.inference.text import TextGeneration

__all__ = ["CanvasGeneration", "MaskedGeneration", "TextGeneration", "pipeline"]
