"""Sampling policies and cached generation."""

from dew.sampling.generate import Generation, generate
from dew.sampling.sampling import Sampling

__all__ = ["Generation", "Sampling", "generate"]
