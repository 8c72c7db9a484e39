"""A tiny trained run for the tests of run directories, generation and export from them."""

from __future__ import annotations

import json

import pytest

from dew.recipes.lm import main as train
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401 - the shared token files

ONE_LAYER = json.dumps({"emb_features": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "mlp_features": 64,
                        "max_seq_len": 64})


@pytest.fixture(scope="session")
def trained(token_dir, tmp_path_factory):  # noqa: F811
    """A byte-level run of one checkpoint (a 256-id head, no tokenizer.json); copy it before changing it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert train([*recipe_args(token_dir, run, steps=2), "--model.config", ONE_LAYER]) == 0
    return run
