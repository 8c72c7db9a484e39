"""Diffusion language models: discrete masked processes (`dew.diffusion.discrete.MDLM`)."""

from dew.diffusion.discrete import MDLM, DiscreteProcess, LogLinear
from dew.diffusion.unmask import Unmask

__all__ = ["DiscreteProcess", "LogLinear", "MDLM", "Unmask"]
