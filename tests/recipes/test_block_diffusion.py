"""The recipe's --objective block_diffusion: one step fine-tuning the tiny DiffusionGemma, `dew.pipeline` of
the run, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dew
from dew.data.tokenize import tokenize_text
from dew.inference import BlockGeneration
from dew.inference.block import from_checkpoint as block_task
from dew.interop import load_pretrained
from dew.objectives.diffusion import BlockDiffusionObjective
from dew.recipes import lm
from dew.recipes.export import export_run
from dew.runs.run_dir import RunDirectory
from dew.training.checkpoints import Checkpoints

SOURCE = Path(__file__).parents[1] / "fixtures" / "hf" / "diffusion-gemma-sft"
BLOCK = ("--objective", "block_diffusion", "--pretrained", str(SOURCE), "--tokenizer", str(SOURCE))


@pytest.fixture(scope="module")
def block_tokens(tmp_path_factory) -> str:
    """Token files written with the checkpoint's own tokenizer (its words t3 ... t63)."""
    root = tmp_path_factory.mktemp("block-data")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(" ".join(f"t{3 + (i * 7 + j) % 61}" for j in range(12)) + "\n" for i in range(200)))
    tokenize_text(str(corpus), str(root / "tokens"), str(SOURCE), val_fraction=0.1, workers=1)
    return str(root / "tokens")


def block_args(tokens: str, run_dir, *extra: str, seq_len: int = 11) -> list[str]:
    """A one-step run: rows of 4 prompt ids and two canvases of the checkpoint's 4."""
    return ["data:token-windows", "--data.path", tokens, "--data.seq-len", str(seq_len), "--model.config",
            '{"max_seq_len": 32}', "--trainer.run-dir", str(run_dir), "--trainer.steps", "1", "--trainer.batch", "2",
            "--trainer.log-every", "1", "--trainer.eval-every", "None", "--trainer.checkpoint-every", "1",
            "--block-prompt-tokens", "4", "--sample-tokens", "0", "--ema-decay", "None", *BLOCK, *extra]


@pytest.mark.slow
def test_one_step_logs_both_terms(block_tokens, tmp_path):
    run = tmp_path / "run"
    assert lm.main(block_args(block_tokens, run)) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [entry for entry in logged if "train/canvas_ce" in entry]
    assert train and all(entry["train/encoder_ce"] > 0 for entry in train)
    assert not any("perplexity" in key for entry in logged for key in entry)
    record = RunDirectory(run).record()
    assert record["generation"]["process"] == "block" and record["model"]["name"] == "diffusion_gemma"
    # The run generates with the checkpoint's own sampler, EOS and budget, from the trained weights: the
    # same canvases, bit for bit, as a BlockGeneration built by hand over the restored step.
    task = dew.pipeline(run)
    source = load_pretrained(SOURCE, dtype="float32")
    expected = block_task(source)
    assert isinstance(task, BlockGeneration)
    assert (task.process, task.eos_token_ids, task.pad_id, task.max_new_tokens) == (
        expected.process, expected.eos_token_ids, expected.pad_id, expected.max_new_tokens)
    checkpoints = Checkpoints(run / "checkpoints", keep=None)
    try:
        trained = checkpoints.restore_tree(1)["params"]
    finally:
        checkpoints.close()
    by_hand = BlockGeneration(BlockDiffusionObjective(source.model, 4).model, trained, expected.process,
                              tokenizer=source.tokenizer, max_new_tokens=6, eos_token_ids=expected.eos_token_ids,
                              pad_id=expected.pad_id)
    prompts = ["t5 t9 t12", "t7 t30"]
    ours, theirs = task(prompts, 6, seed=3), by_hand(prompts, seed=3)
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    assert ours.continuations() == theirs.continuations() and any(ours.continuations())
    assert task.decode(ours) == by_hand.decode(theirs)
    # The trained weights moved from the checkpoint's, so the run is not generating from the source.
    with pytest.raises(ValueError, match="is a block-diffusion run .DiffusionGemma., and dew export writes"):
        export_run(run, tmp_path / "exported")
    start = BlockDiffusionObjective(source.model, 4, pretrained=source.variables).held_variables()
    assert np.abs(np.asarray(task.variables["params"]["embed_tokens"]["embedding"])
                  - np.asarray(start["params"]["embed_tokens"]["embedding"])).max() > 0


@pytest.mark.parametrize("change, message", [
    ({"seq_len": 12}, "rows of 13 ids, which must be --block-prompt-tokens 4 plus a whole number"),
    ({"extra": ("--sample-tokens", "4")}, "--sample-tokens 4: --objective block_diffusion has no"),
    ({"extra": ("--block-canvas-size", "3")}, "rows of 12 ids, which must be --block-prompt-tokens 4 plus"),
])
def test_refusals_write_nothing(block_tokens, tmp_path, capsys, change, message):
    args = block_args(block_tokens, tmp_path / "run", *change.get("extra", ()), seq_len=change.get("seq_len", 11))
    try:
        code = lm.main(args)
    except SystemExit as exit:  # tyro reports a config's ValueError itself, in a box
        code = exit.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not (tmp_path / "run").exists()


def test_packed_rows_and_missing_checkpoint_refused():
    from dew.data import PackedTokens
    from dew.objectives.lm import LMRunConfig

    with pytest.raises(ValueError, match="packed documents"):
        LMRunConfig(objective="block_diffusion", pretrained=str(SOURCE), sample_tokens=0,
                    data=PackedTokens(path="unused"))
    with pytest.raises(ValueError, match="pass --pretrained"):
        LMRunConfig(objective="block_diffusion", sample_tokens=0)


def test_the_registry_builds_diffusion_gemma_only_from_a_whole_config():
    """run.json names a block run's model diffusion_gemma; the registry refuses a config that lacks fields."""
    from dew import models

    with pytest.raises(TypeError, match=r"DiffusionGemmaConfig needs the fields \['emb_features', .*'max_seq_len'\]"):
        models.build("diffusion_gemma", vocab_size=256)
