"""The recipe's --objective dpo: pairs from JSONL trained against the frozen starting weights, what the run
records, generation from its live weights, an exact resume, and its refusals."""

from __future__ import annotations

import json
import math
import signal

import jax
import numpy as np
import pytest

import dew
from dew.recipes.lm import main, parse, prepare, train
from dew.runs.run_dir import RunDirectory
from dew.training.checkpoints import Checkpoints
from tests.recipes.conftest import TINY_MODEL, recipe_args, terminate_at
from tests.recipes.test_resume import _assert_same_state
from tests.tolerances import LIBRARY_ULPS, ulp_bound


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    """Plain-text pairs: a question, the right answer chosen, a wrong one rejected."""
    path = tmp_path_factory.mktemp("dpo-data") / "pairs.jsonl"
    records = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
               for a in range(4) for b in range(4)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def dpo_args(pairs: str, run_dir, *extra: str, steps: int = 4) -> list[str]:
    """A tiny DPO run: batches of 4 pairs of at most 17 ids, evaluated and checkpointed every 2 steps."""
    return ["data:preference-pairs", "--data.path", pairs, "--data.val-path", pairs, "--data.seq-len", "16",
            "--model.config", json.dumps(TINY_MODEL), "--trainer.run-dir", str(run_dir), "--trainer.steps", str(steps),
            "--trainer.batch", "4", "--trainer.val-batch", "8", "--trainer.log-every", "1", "--trainer.eval-every", "2",
            "--trainer.checkpoint-every", "2", "--sample-tokens", "4", "--sample-prompt", "1+2=",
            "--objective", "dpo", "--dpo.beta", "0.5", "--optim.learning-rate", "0.003", *extra]


@pytest.fixture(scope="module")
def dpo_run(pairs, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    assert main(dpo_args(pairs, run_dir)) == 0
    return run_dir


def test_a_dpo_run_trains_and_records_itself(dpo_run):
    run = RunDirectory(dpo_run)
    record = run.record()
    assert record["settings"]["objective"] == "dpo" and record["settings"]["data"]["type"] == "PreferencePairs"
    assert record["settings"]["dpo"] == {"beta": 0.5, "label_smoothing": 0.0}
    assert record["settings"]["grpo"] is None
    assert record["generation"] == {"sampling": record["settings"]["sampling"], "max_new_tokens": 4, "ema": False}
    assert record["data"]["pairs"] == 16 and record["tokens_per_step"] == 2 * 4 * 16
    assert run.status()["state"] == "finished" and run.checkpoint_steps() == [2, 4]
    train = [m for m in run.metrics() if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    # The policy starts as the reference: every z is 0 and every pair's loss log 2 (fp32, one log-sigmoid).
    assert abs(train[0]["train/loss"] - math.log(2)) <= ulp_bound(LIBRARY_ULPS + 2, 1.0)
    assert {"train/reward_accuracy", "train/reward_margin", "train/chosen_reward"} <= set(train[0])
    evaluated = [m for m in run.metrics() if "val/loss" in m]
    assert [m["step"] for m in evaluated] == [2, 4] and "val/reward_accuracy" in evaluated[-1]
    samples = [json.loads(line) for line in (dpo_run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4] and all(s["text"].startswith("1+2=") for s in samples)


def test_the_reference_stays_frozen_and_generation_reads_the_live_weights(dpo_run):
    checkpoints = Checkpoints(dpo_run / "checkpoints")
    first, last = checkpoints.restore_tree(2), checkpoints.restore_tree(4)
    checkpoints.close()
    for a, b in zip(jax.tree_util.tree_leaves(first["ema"]), jax.tree_util.tree_leaves(last["ema"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the starting weights, never moved
    task = dew.pipeline(dpo_run)  # ema=True asks for an average, and a DPO run keeps none
    for ours, theirs in zip(jax.tree_util.tree_leaves(task.params), jax.tree_util.tree_leaves(last["params"])):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert task.max_new_tokens == 4 and task("1+2=").text[0].startswith("1+2=")


def test_a_stopped_dpo_run_resumes_exactly(pairs, tmp_path, monkeypatch):
    argv = dpo_args(pairs, tmp_path / "stopped", "--trainer.eval-every", "None", "--sample-tokens", "0",
                    "--data.val-path", "None", steps=6)
    straight = train(parse(dpo_args(pairs, tmp_path / "straight", "--trainer.eval-every", "None", "--sample-tokens",
                                    "0", "--data.val-path", "None", steps=6)), verbose=False)
    terminate_at(monkeypatch, 3)
    assert main(argv) == 128 + signal.SIGTERM
    monkeypatch.undo()
    assert RunDirectory(tmp_path / "stopped").checkpoint_steps() == [2, 3]
    _assert_same_state(prepare(parse(argv)).fit(verbose=False), straight)


@pytest.mark.parametrize("flags, message", [
    (["--ema-decay", "0.9"], "--ema-decay 0.9: --objective dpo keeps its frozen reference, the starting weights"),
    (["--balance-rate", "0.001"], "--balance-rate 0.001 shapes the autoregressive objective (--objective lm), and "
                                  "--objective dpo does not read it"),
    (["--no-token-accuracy"], "--objective dpo reports none: drop --no-token-accuracy"),
    (["--dpo.beta", "0"], "DPO beta is 0.0; it must be above 0"),
    (["--dpo.label-smoothing", "0.5"], "label_smoothing is 0.5; it is the assumed rate of flipped labels"),
    (["--data.seq-len", "3"], "line 1: chosen is 5 tokens, beyond seq_len + 1 = 4"),
    (["--data.val-path", "None"], "data:preference-pairs has no --data.val-path: pass a JSONL file of validation pairs"),
    (["--trainer.batch", "32"], "16 records do not fill one batch of 32"),
    (["--lora.rank", "4", "--pretrained", "x"], "LoRA runs of the recipe are built for --objective lm only"),
])
def test_dpo_refusals_write_nothing(pairs, tmp_path, capsys, flags, message):
    run_dir = tmp_path / "refused"
    try:
        code = main(dpo_args(pairs, run_dir) + flags)
    except SystemExit as exit:  # tyro reports a config's ValueError itself, in a box
        code = exit.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not run_dir.exists()


@pytest.mark.parametrize("flags, message", [
    (["--objective", "dpo"], "--objective dpo trains on data:preference-pairs, not data:token-windows (the data of "
                             "--objective lm or masked_diffusion or block_diffusion)"),
    (["--dpo.beta", "0.3"], "the --dpo.* flags (DPOSettings(beta=0.3, label_smoothing=0.0)) shape --objective dpo, "
                            "and this run's objective is lm"),
])
def test_dpo_flags_and_data_are_refused_elsewhere(token_dir, tmp_path, capsys, flags, message):
    try:
        code = main(recipe_args(token_dir, tmp_path / "refused") + flags)
    except SystemExit as exit:
        code = exit.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
