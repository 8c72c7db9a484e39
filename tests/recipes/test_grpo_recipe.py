"""The recipe's --objective grpo: each step's completions drawn from the live policy for a batch of prompts,
scored by rewards chosen by name; what the run records, generation from it, an exact resume, refusals."""

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

NEWLINE = 10  # the byte that ends a completion: --sampling.eos-token-ids 10


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    """Sums to complete, each with its answer for exact_match."""
    path = tmp_path_factory.mktemp("grpo-data") / "prompts.jsonl"
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def grpo_args(prompts: str, run_dir, *extra: str, steps: int = 4) -> list[str]:
    """A tiny GRPO run: 2 prompts a step, 4 completions of at most 4 tokens each, rows of 13 ids."""
    return ["data:prompts", "--data.path", prompts, "--data.seq-len", "12", "--model.config", json.dumps(TINY_MODEL),
            "--trainer.run-dir", str(run_dir), "--trainer.steps", str(steps), "--trainer.batch", "8",
            "--trainer.log-every", "1", "--trainer.eval-every", "None", "--trainer.checkpoint-every", "2",
            "--sample-tokens", "0", "--objective", "grpo", "--grpo.rewards", "exact_match", "finished",
            "--grpo.group-size", "4", "--grpo.max-new-tokens", "4", "--sampling.eos-token-ids", str(NEWLINE),
            "--optim.learning-rate", "0.003", *extra]


@pytest.fixture(scope="module")
def grpo_run(prompts, tmp_path_factory):
    """Four steps with a KL to the frozen start, evaluated on the same prompts at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    assert main(grpo_args(prompts, run_dir, "--data.val-path", prompts, "--trainer.eval-every", "2",
                          "--trainer.val-batch", "16", "--grpo.kl-weight", "0.05", "--sample-tokens", "3",
                          "--sample-prompt", "1+1=")) == 0
    return run_dir


def test_a_grpo_run_trains_on_its_rollouts_and_records_itself(grpo_run):
    run = RunDirectory(grpo_run)
    record = run.record()
    assert record["settings"]["objective"] == "grpo" and record["settings"]["data"]["type"] == "Prompts"
    assert record["settings"]["grpo"] == {"rewards": ["exact_match", "finished"], "group_size": 4,
                                          "max_new_tokens": 4, "clip": 0.2, "kl_weight": 0.05,
                                          "answer_field": "answer"}
    sampling = {**record["settings"]["sampling"], "eos_token_ids": [NEWLINE]}
    assert record["generation"] == {"sampling": sampling, "max_new_tokens": 4, "ema": False}
    assert record["data"]["prompts"] == 16 and record["data"]["longest_prompt"] == 4
    assert run.status()["state"] == "finished" and run.checkpoint_steps() == [2, 4]
    train = [m for m in run.metrics() if "train/loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4]
    # Each completion's reward is exact_match plus finished: 0, 1 or 2.
    assert all(0.0 <= m["train/reward"] <= 2.0 and {"train/ratio", "train/clipped", "train/kl"} <= set(m)
               for m in train)
    # The first update's policy is the reference: the same computation on the same weights.
    assert train[0]["train/kl"] == 0.0
    evaluated = [m for m in run.metrics() if "val/reward" in m]
    assert [m["step"] for m in evaluated] == [2, 4] and all(math.isfinite(m["val/loss"]) for m in evaluated)
    samples = [json.loads(line) for line in (grpo_run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4] and all(s["text"].startswith("1+1=") for s in samples)


def test_generation_from_a_grpo_run_reads_the_live_policy(grpo_run):
    checkpoints = Checkpoints(grpo_run / "checkpoints")
    saved = checkpoints.restore_tree()
    checkpoints.close()
    task = dew.pipeline(grpo_run)
    for ours, theirs in zip(jax.tree_util.tree_leaves(task.params), jax.tree_util.tree_leaves(saved["params"])):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert task.sampling.eos_token_ids == (NEWLINE,) and task.max_new_tokens == 4
    completion = task("2+2=", seed=1).continuations()[0]
    assert 1 <= len(completion) <= 4 and NEWLINE not in completion[:-1]


def test_a_stopped_grpo_run_resumes_exactly(prompts, tmp_path, monkeypatch):
    """The rollouts of the resumed steps are drawn from the restored weights with the same keys (with the
    KL term, so the frozen reference is restored too)."""
    kl = ("--grpo.kl-weight", "0.05")
    straight = train(parse(grpo_args(prompts, tmp_path / "straight", *kl, steps=6)), verbose=False)
    argv = grpo_args(prompts, tmp_path / "stopped", *kl, steps=6)
    terminate_at(monkeypatch, 3)
    assert main(argv) == 128 + signal.SIGTERM
    monkeypatch.undo()
    assert RunDirectory(tmp_path / "stopped").checkpoint_steps() == [2, 3]
    _assert_same_state(prepare(parse(argv)).fit(verbose=False), straight)
    rewards = [m["train/reward"] for m in RunDirectory(tmp_path / "stopped").metrics() if "train/reward" in m]
    assert len(rewards) == 6


@pytest.mark.parametrize("flags, message", [
    (["--grpo.group-size", "8", "--grpo.rewards", "finished"], None),  # parses: a check of the others below
    (["--trainer.batch", "6"], "--trainer.batch 6 counts completions, 4 per prompt (--grpo.group-size): use a multiple "
                               "of 4"),
    (["--grpo.max-new-tokens", "10"], "the longest prompt of"),
    (["--grpo.rewards", "think_format", "--grpo.answer-field", "solution"],
     "--grpo.answer-field solution names the field ['exact_match'] compare with"),
    (["--grpo.answer-field", "solution"], "has no 'solution' field, which its rewards read"),
    (["--sampling.eos-token-ids"], "--grpo.rewards finished rewards a completion that ends with an EOS token, and "
                                   "tokenizer 'byte' has none"),
    (["--sampling.temperature", "0"], "GRPOObjective samples at temperature 0"),
    (["--ema-decay", "None"], "--ema-decay None: --objective grpo keeps no moving average"),
    (["--mtp-weight", "0.3"], "--mtp-weight 0.3 shapes the autoregressive objective (--objective lm), and "
                              "--objective grpo does not read it"),
    (["--trainer.eval-every", "2"], "data:prompts has no --data.val-path: pass a JSONL file of validation prompts"),
])
def test_grpo_refusals_write_nothing(prompts, tmp_path, capsys, flags, message):
    if message is None:
        config = parse(grpo_args(prompts, tmp_path / "unused") + flags)
        assert config.grpo.rewards == ("finished",) and config.grpo.group_size == 8
        return
    run_dir = tmp_path / "refused"
    try:
        code = main(grpo_args(prompts, run_dir) + flags)
    except SystemExit as exit:  # tyro reports a config's ValueError itself, in a box
        code = exit.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not run_dir.exists()


def test_grpo_needs_rewards_and_its_flags_are_refused_elsewhere(prompts, token_dir, tmp_path, capsys):
    argv = grpo_args(prompts, tmp_path / "refused")
    del argv[argv.index("--grpo.rewards"):argv.index("--grpo.group-size")]
    with pytest.raises(SystemExit):
        main(argv)
    assert "--objective grpo scores each completion with rewards chosen by name: add --grpo.rewards" in \
           " ".join(capsys.readouterr().err.replace("│", " ").split())
    with pytest.raises(SystemExit):
        main(recipe_args(token_dir, tmp_path / "refused", "--grpo.group-size", "4"))
    assert "the --grpo.* flags" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # tyro names the choices
        main(grpo_args(prompts, tmp_path / "refused", "--grpo.rewards", "accuracy"))
    assert "exact_match" in capsys.readouterr().err
