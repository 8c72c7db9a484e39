"""The recipe's --objective masked_diffusion: what it trains and records, dew.pipeline over its run, refusals."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import dew
from dew.diffusion.discrete import MDLM, DiscreteProcess
from dew.inference import MaskedGeneration
from dew.recipes import lm
from dew.runs.run_dir import RunDirectory
from dew.training.checkpoints import Checkpoints
from tests.diffusion.test_checkpoints import DREAM
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401  (the fixture)

MASKED = ("--objective", "masked_diffusion")


@pytest.fixture(scope="module")
def masked_run(token_dir, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("masked") / "run"
    argv = recipe_args(token_dir, run, *MASKED, "--sample-tokens", "4", "--sample-prompt", "line",
                       "--trainer.eval-every", "3", steps=6)
    assert lm.main(argv) == 0
    return run


def test_the_run_trains_mdlm_and_records_the_mask(masked_run):
    run = RunDirectory(masked_run)
    record = run.record()
    # Byte files: 256 ids, the mask the 257th; the rows of --data.seq-len 16 hold 17 ids, read whole.
    assert record["model"]["config"]["vocab_size"] == 257 and record["model"]["config"]["causal"] is False
    assert record["generation"] == {"process": "mdlm", "mask_id": 256, "max_new_tokens": 4, "ema": True}
    assert record["settings"]["objective"] == "masked_diffusion" and record["tokens_per_step"] == 4 * 17
    metrics = run.metrics()
    train = [m for m in metrics if "train/loss" in m]
    assert len(train) == 6 and {"train/masked_accuracy", "train/masked_fraction"} <= set(train[-1])
    assert [m["step"] for m in metrics if "val/perplexity" in m] == [3, 6]
    samples = (masked_run / "samples.jsonl").read_text()
    assert samples.count("line") == 2  # one preview at each evaluation, from the prompt


def test_pipeline_rebuilds_native_mdlm_with_64_steps(masked_run):
    task = dew.pipeline(masked_run)
    assert isinstance(task, MaskedGeneration) and task.process == MDLM(mask_id=256)()
    assert task.process.sampler.steps == 64 and task.max_new_tokens == 4 and task.eos_token_ids == ()
    checkpoints = Checkpoints(masked_run / "checkpoints")
    saved = checkpoints.restore_tree()
    checkpoints.close()
    for ours, theirs in zip(jax.tree_util.tree_leaves(task.params), jax.tree_util.tree_leaves(saved["ema"])):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    result = task("line 3", seed=0)
    assert result.text[0].startswith("line 3") and list(result.refinements) == [64]
    assert int(result.new_tokens[0]) == 4 and (np.asarray(result.continuations()) < 256).all()
    live = dew.pipeline(masked_run, ema=False)
    for ours, theirs in zip(jax.tree_util.tree_leaves(live.params), jax.tree_util.tree_leaves(saved["params"])):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("flags, message", [
    (["--sampling.temperature", "0"], "--sampling sets an autoregressive policy"),
    (["--balance-rate", "0.001"], "--balance-rate 0.001 shapes the autoregressive objective"),
    (["--model.config", '{"vocab_size": 256}'], "vocab_size 256 leaves no id for the mask"),
    (["--model.config", '{"causal": true, "max_seq_len": 64}'], "the model is causal (causal=True)"),
    (["--model.config", '{"max_seq_len": 16}'], "seq_len 17 is longer than the model's max_seq_len 16"),
])
def test_refusals_name_the_value_and_write_nothing(token_dir, tmp_path, capsys, flags, message):  # noqa: F811
    run_dir = tmp_path / "refused"
    try:
        code = lm.main(recipe_args(token_dir, run_dir, *MASKED) + flags)
    except SystemExit as exit:  # tyro reports a config's ValueError itself, in a box
        code = exit.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not run_dir.exists()


def test_dew_generate_unmasks_from_a_masked_run(masked_run, capsys):
    from dew.cli import main

    capsys.readouterr()
    assert main(["generate", str(masked_run), "--prompt", "line 1", "--max-new-tokens", "4", "--n", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line[:10] for line in printed] == ["[0] line 1", "[1] line 1"]
    assert main(["generate", str(masked_run), "--prompt", "line 1", "--temperature", "0"]) == 2
    assert "--temperature sets autoregressive sampling" in capsys.readouterr().err


def test_dew_export_refuses_a_masked_run_in_one_line(masked_run, tmp_path, capsys):
    from dew.cli import main

    capsys.readouterr()
    assert main(["export", str(masked_run), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: {masked_run} is a masked-diffusion run (a bidirectional decoder unmasking id ")
    assert "dew export writes token-by-token decoders" in error and "\n" not in error
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def small_ids(tmp_path_factory):
    """Token files of ids below 100, which the tiny LLaDA and Dream checkpoints (mask ids 120, 126) read."""
    from dew.data.token_files import make_meta, write_meta

    root = tmp_path_factory.mktemp("small-ids")
    ids = (np.arange(6000) * 7 % 97).astype(np.uint8)
    ids[:600].tofile(root / "val.bin")
    ids[600:].tofile(root / "train.bin")
    write_meta(root, make_meta("byte", 100, 5400, 600, None))
    return str(root)


def test_a_masked_diffusion_checkpoint_continues_training(small_ids, tmp_path):
    run = tmp_path / "dream"
    args = recipe_args(small_ids, run, *MASKED, "--pretrained", str(DREAM), steps=2)
    args[args.index("--model.config") + 1] = '{"max_seq_len": 64}'
    assert lm.main(args) == 0
    record = RunDirectory(run).record()
    assert record["generation"] == {"process": "mdlm", "mask_id": 126, "logits_shift": 1, "max_new_tokens": 0,
                                    "ema": True}
    # The ids are below 100 but meta.json names the 256-id byte tokenizer: generation refuses it, and takes a
    # tokenizer of the run's 100 ids put in its directory.
    with pytest.raises(ValueError, match="holds 256 tokens, and the run trained on ids of a 100-token vocabulary"):
        dew.pipeline(run)
    from tokenizers import Tokenizer, models as tokenizer_models

    Tokenizer(tokenizer_models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0")).save(
        str(run / "tokenizer.json"))
    task = dew.pipeline(run)
    assert task.process == DiscreteProcess(126, logits_shift=1)  # Dream's mask id and alignment
    assert task([[1, 2, 3]], 4, steps=4).tokens.shape == (1, 7)


def test_a_causal_checkpoint_is_refused_for_masked_diffusion(small_ids, tmp_path, capsys):
    from dew import models
    from dew.interop.export import save_pretrained

    causal = models.build("causal_transformer", vocab_size=128, emb_features=32, num_layers=1, num_heads=4,
                          max_seq_len=64)
    directory = save_pretrained(causal, causal.init(jax.random.key(0), np.zeros((1, 4), np.int32)), tmp_path / "llama")
    args = recipe_args(small_ids, tmp_path / "run", *MASKED, "--pretrained", str(directory))
    args[args.index("--model.config") + 1] = '{"max_seq_len": 64}'
    assert lm.main(args) == 2
    assert "is a llama checkpoint, a causal decoder: --objective masked_diffusion continues" in capsys.readouterr().err
