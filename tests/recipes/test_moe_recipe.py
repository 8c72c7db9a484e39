"""The recipe trains a mixture of experts with every router flag (--balance-rate, --aux-loss-alpha,
--no-seq-aux, --router-z-loss) and records the mixture in its run."""

from __future__ import annotations

import json
import math

import pytest

from dew.recipes.lm import main
from dew.runs.run_dir import RunDirectory
from tests.recipes.conftest import recipe_args


@pytest.mark.slow
def test_the_recipe_trains_a_mixture_with_every_router_flag(token_dir, tmp_path):
    model = {"emb_features": 32, "num_layers": 2, "num_heads": 4, "mlp_features": 32, "max_seq_len": 64,
             "mixture": {"experts": 4, "top_k": 2, "bias": True, "shared_features": 16}}
    argv = recipe_args(token_dir, tmp_path / "moe", "--balance-rate", "0.001", "--aux-loss-alpha", "0.01",
                       "--no-seq-aux", "--router-z-loss", "0.001", steps=2)
    argv[argv.index("--model.config") + 1] = json.dumps(model)
    assert main(argv) == 0
    run = RunDirectory(tmp_path / "moe")
    assert run.record()["model"]["config"]["mixture"]["experts"] == 4
    last = [m for m in run.metrics() if "train/loss" in m][-1]
    assert last["train/balance_loss"] > 0 and last["train/router_z_loss"] > 0
    assert math.isfinite(last["train/moe/layers_1/max_load"])
