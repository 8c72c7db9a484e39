"""dew.pipeline over a run directory the recipe leaves behind."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import dew
from dew.inference.text import printable
from dew.recipes import lm
from dew.sampling import Sampling
from dew.sharding import MESH_AXES
from dew.training.checkpoints import Checkpoints
from dew.training.mesh import Layout
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401  (the fixture)


def test_pipeline_from_a_run_reads_its_weights_tokenizer_and_sampling(token_dir, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    args = recipe_args(token_dir, run, "--sample-tokens", "5", "--sampling.temperature", "0", steps=4)
    assert lm.main(args) == 0
    task = dew.pipeline(run)
    assert task.max_new_tokens == 5 and task.sampling.greedy and task.tokenizer.name == "byte"
    checkpoints = Checkpoints(run / "checkpoints")
    saved = checkpoints.restore_tree()
    checkpoints.close()
    for ours, theirs in zip(jax.tree_util.tree_leaves(task.params), jax.tree_util.tree_leaves(saved["ema"])):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    live = dew.pipeline(run, ema=False)
    for ours, theirs in zip(jax.tree_util.tree_leaves(live.params), jax.tree_util.tree_leaves(saved["params"])):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    result = task("line 3", seed=0)
    assert result.text[0].startswith("line 3") and int(result.new_tokens[0]) == 5
    # placed once on the mesh, split as the Trainer splits them
    for leaf in jax.tree_util.tree_leaves(task.params):
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh.axis_names == MESH_AXES
    with pytest.raises(TypeError, match=r"only the placement options mesh= and layout=; got \['dtype'\]"):
        dew.pipeline(run, dtype="bfloat16")
    placed = dew.pipeline(run, layout=Layout(min_shard=2**40))
    assert placed("line 3", seed=0).text == result.text


def test_pipeline_refuses_a_run_without_checkpoints(tmp_path):
    (tmp_path / "run.json").write_text('{"model": {"name": "causal_transformer", "config": {"vocab_size": 8}}, '
                                       '"tokenizer": "byte"}')
    with pytest.raises(FileNotFoundError, match="has no checkpoint yet"):
        dew.pipeline(tmp_path)


def test_dew_generate_streams_the_continuation(token_dir, tmp_path, capsys):  # noqa: F811
    from dew.cli import main

    run = tmp_path / "run"
    assert lm.main(recipe_args(token_dir, run, steps=2)) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "line 1", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    expected = dew.pipeline(run).with_sampling(Sampling(temperature=0.0))("line 1", 6).text[0]
    assert printed == printable(expected) + "\n"  # control characters a tiny model emits are escaped
    assert main(["generate", str(run), "--prompt", "line 1", "--max-new-tokens", "3", "--n", "2"]) == 0
    assert capsys.readouterr().out.count("[") >= 2
