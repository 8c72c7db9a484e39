"""Generation tasks over trained weights."""

from dew.diffusion.canvas import CanvasGeneration
from dew.inference.block import BlockGeneration
from dew.inference.masked import MaskedGeneration
from dew.inference.text import TextGeneration

__all__ = ["BlockGeneration", "CanvasGeneration", "MaskedGeneration", "TextGeneration"]
