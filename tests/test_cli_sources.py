"""What `dew generate` and `dew.pipeline` take as a source: a run, one of its checkpoints, a GGUF
file; the sampling flags; and `dew --version`."""

from __future__ import annotations

import importlib.metadata

import jax
import numpy as np
import pytest

import dew
from dew.cli import main as dew_command
from dew.inference import TextGeneration
from dew.recipes.lm import main as train
from dew.sampling import Sampling
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401 - the shared token files


@pytest.fixture(scope="module")
def run_of_two_checkpoints(token_dir, tmp_path_factory):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("sources") / "run"
    assert train(recipe_args(token_dir, run_dir, steps=4)) == 0  # checkpoints at steps 2 and 4
    return run_dir


def _leaves(task: TextGeneration) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(task.params)]


def test_a_checkpoint_directory_of_a_run_loads_that_step(run_of_two_checkpoints, capsys):
    run_dir = run_of_two_checkpoints
    at_2 = _leaves(dew.pipeline(run_dir / "checkpoints" / "2"))
    for ours, theirs in zip(at_2, _leaves(dew.pipeline(run_dir, step=2))):
        np.testing.assert_array_equal(ours, theirs)
    assert not all(np.array_equal(a, b) for a, b in zip(at_2, _leaves(dew.pipeline(run_dir / "checkpoints"))))
    assert dew_command(["generate", str(run_dir / "checkpoints" / "2"), "--prompt", "line", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("line")
    with pytest.raises(ValueError, match="is the checkpoint of step 2, and step=4 asks for another"):
        dew.pipeline(run_dir / "checkpoints" / "2", step=4)


def test_min_p_and_repetition_penalty_reach_the_sampling(run_of_two_checkpoints, monkeypatch, capsys):
    used = []
    call = TextGeneration.__call__

    def record(self, *args, **kwargs):
        used.append(self.sampling)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(TextGeneration, "__call__", record)
    assert dew_command(["generate", str(run_of_two_checkpoints), "--prompt", "line", "--max-new-tokens", "3",
                        "--min-p", "0.2", "--repetition-penalty", "1.3"]) == 0
    assert used[0].min_p == 0.2 and used[0].repetition_penalty == 1.3


def test_dew_generate_takes_a_gguf_file(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from tests.interop.conftest import torch_model
    from tests.interop.test_gguf import TOKENS, write_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where the file's tokenizer is written
    path = write_gguf(torch_model("llama", vocab_size=len(TOKENS), max_position_embeddings=32),
                      tmp_path / "tiny.Q8_0.gguf")
    # top-k 1 takes the most likely token whatever the file's sampling defaults: the output is the API's.
    expected = dew.pipeline(path).with_sampling(Sampling(top_k=1))("Hi", 3).text[0]
    assert dew_command(["generate", str(path), "--prompt", "Hi", "--max-new-tokens", "3", "--top-k", "1"]) == 0
    assert capsys.readouterr().out.strip() == expected and expected.startswith("Hi")


def test_version(capsys):
    assert dew_command(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dew {importlib.metadata.version('dew-ml')}"
