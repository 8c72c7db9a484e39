"""Generation tasks over trained weights."""

from dew.diffusion.canvas import CanvasGeneration
from dew.inference.masked import MaskedGeneration
from dew.inference.text import TextGeneration

__all__ = ["CanvasGeneration", "MaskedGeneration", "TextGeneration"]
