"""Objectives without effects refuse any effect handed back, and reduce their loss as its Mean's totals."""

import jax.numpy as jnp
import pytest

from dew.objectives.base import Mean, MeanLossNoEffects
from dew.objectives.diffusion import MaskedDiffusionObjective
from dew.objectives.diffusion.block import BlockDiffusionObjective
from dew.objectives.grpo import GRPOObjective
from dew.objectives.preference import DPOObjective


@pytest.mark.parametrize("objective", [MaskedDiffusionObjective, BlockDiffusionObjective, DPOObjective, GRPOObjective])
def test_an_effect_is_refused_by_name_and_none_passes_the_variables_through(objective):
    bare = object.__new__(objective)  # the two methods read nothing the constructor sets
    variables = {"params": {"w": jnp.ones(2)}}
    assert bare.apply_effects(variables, {}) is variables
    with pytest.raises(ValueError, match=rf"{objective.__name__} produces no effects, got \['moe'\]"):
        bare.apply_effects(variables, {"moe": {}})


def test_reduce_loss_is_the_loss_means_totals():
    class Stats:
        loss = Mean(jnp.float32(6.0), jnp.float32(3.0))

    assert MeanLossNoEffects.reduce_loss(Stats()) == (6.0, 3.0)
