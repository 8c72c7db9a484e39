"""Diffusion objectives: `MaskedDiffusionObjective` (MDLM's negative ELBO) and `BlockDiffusionObjective`
(DiffusionGemma's block loss, the public SFT recipe)."""

from dew.objectives.diffusion.block import BlockDiffusionObjective, BlockStatistics
from dew.objectives.diffusion.masked import MaskedDiffusionObjective, MaskedStatistics

__all__ = ["BlockDiffusionObjective", "BlockStatistics", "MaskedDiffusionObjective", "MaskedStatistics"]
