"""--pretrained: the recipe continues a local transformers checkpoint, which decides the architecture."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import dew
from dew.recipes import lm

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def _args(token_dir, run, checkpoint, model_config):
    return ["data:token-windows", "--data.path", token_dir, "--data.seq-len", "16", "--pretrained", str(checkpoint),
            "--model.config", json.dumps(model_config), "--trainer.run-dir", str(run), "--trainer.steps", "2",
            "--trainer.batch", "4", "--trainer.eval-every", "None", "--sample-tokens", "0", "--ema-decay", "1.0"]


def test_a_run_starts_from_the_checkpoint(token_dir, tmp_path, checkpoint):
    from dew.interop import load_pretrained

    run = tmp_path / "run"
    assert lm.main(_args(token_dir, run, checkpoint, {"max_seq_len": 32})) == 0
    record = json.loads((run / "run.json").read_text())
    assert record["pretrained"] == str(checkpoint) and record["model"]["config"]["max_seq_len"] == 32
    # An EMA of decay 1.0 keeps the starting weights: they are the checkpoint's, tensor for tensor.
    task = dew.pipeline(run)
    started = task.model.unstack_variables(task.params)
    source = load_pretrained(checkpoint).variables
    for ours, theirs in zip(jax.tree_util.tree_leaves(started), jax.tree_util.tree_leaves(source)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                   zip(jax.tree_util.tree_leaves(task.model.unstack_variables(dew.pipeline(run, ema=False).params)),
                       jax.tree_util.tree_leaves(source)))


def test_the_checkpoint_decides_the_architecture(token_dir, tmp_path, checkpoint, capsys):
    assert lm.main(_args(token_dir, tmp_path / "run", checkpoint, {"num_layers": 3})) == 2
    error = capsys.readouterr().err
    assert "may set only ['max_seq_len', 'dtype', 'attention_impl', 'scan_layers', 'remat', 'kernels'], not ['num_layers']" in error
    assert not (tmp_path / "run").exists()
