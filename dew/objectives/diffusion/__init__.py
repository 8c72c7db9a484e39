"""Diffusion objectives: `MaskedDiffusionObjective` (MDLM's negative ELBO)."""

from dew.objectives.diffusion.masked import MaskedDiffusionObjective, MaskedStatistics

__all__ = ["MaskedDiffusionObjective", "MaskedStatistics"]
