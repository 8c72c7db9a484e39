"""The LM recipe end to end: the run directory it leaves, its TensorBoard files, `--help`, and each refusal."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dew.cli import main as dew
from dew.objectives.lm import LMRunConfig
from dew.recipes.lm import main, parse
from dew.runs.run_dir import RunDirectory
from tests.recipes.conftest import recipe_args
from tests.tolerances import ulp_bound


@pytest.fixture(scope="module")
def finished_run(token_dir, tmp_path_factory):
    """A 6-step run with evaluations at steps 3 and 6 and a 4-token preview at each."""
    run_dir = tmp_path_factory.mktemp("runs") / "finished"
    argv = recipe_args(token_dir, run_dir, "--trainer.log-every", "2", "--trainer.eval-every", "3",
                       "--sample-tokens", "4", "--sample-prompt", "line")
    assert main(argv) == 0
    return run_dir, argv


def test_a_run_leaves_its_directory(finished_run):
    run_dir, _ = finished_run
    run = RunDirectory(run_dir)
    record = run.record()
    assert record["recipe"] == "lm" and record["tokenizer"] == "byte"
    assert record["model"]["config"]["vocab_size"] == 256  # filled in from meta.json
    assert record["settings"]["data"]["type"] == "TokenWindows"
    assert record["generation"] == {"sampling": record["settings"]["sampling"], "max_new_tokens": 4, "ema": True}
    assert record["tokens_per_step"] == 4 * 16 and {"jax", "flax", "optax"} <= set(record["versions"])
    assert run.status()["state"] == "finished" and run.checkpoint_steps() == [2, 4, 6]
    metrics = run.metrics()
    assert [m["step"] for m in metrics if "train/loss" in m] == [2, 4, 6]
    assert [m["step"] for m in metrics if "val/perplexity" in m] == [3, 6]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [3, 6] and all(s["text"].startswith("line") for s in samples)


def test_tensorboard_reads_the_events(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = finished_run
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert {"train/loss", "train/perplexity", "val/loss", "val/perplexity", "tokens_per_s"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    logged = {m["step"]: m["val/perplexity"] for m in RunDirectory(run_dir).metrics() if "val/perplexity" in m}
    # TensorBoard stores float32: one rounding of the logged float64 value.
    assert {e.step: e.value for e in events.Scalars("val/perplexity")} == pytest.approx(logged, rel=ulp_bound(1))
    assert [e.step for e in events.Tensors("samples/0/text_summary")] == [3, 6]


def test_the_same_command_finds_the_finished_run_and_a_different_one_is_refused(finished_run, capsys):
    run_dir, argv = finished_run
    assert main(argv + ["--trainer.log-every", "3"]) == 0  # logging settings may change
    assert "nothing left to train" in capsys.readouterr().out
    assert main(argv + ["--optim.learning-rate", "0.01", "--data.seed", "3"]) == 2
    error = capsys.readouterr().err
    assert "--optim.learning-rate: the run has 0.0006, this command 0.01" in error
    assert "--data.seed: the run has 0, this command 3" in error
    assert "--trainer.run-dir NEW_DIRECTORY" in error and "--trainer.steps 6" in error


def test_dew_plot_writes_a_png_and_dew_runs_lists_the_run(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    out = tmp_path / "curves.png"
    assert dew(["plot", str(run_dir), str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    capsys.readouterr()
    assert dew(["runs", str(run_dir.parent)]) == 0
    table = capsys.readouterr().out
    assert "finished" in table and "6/6" in table
    assert dew(["plot", str(tmp_path), "--out", str(out)]) == 2
    assert "holds no run.json" in capsys.readouterr().err


def test_help_lists_the_data_subcommands_and_the_flags(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    for flag in ("data:token-windows", "data:packed-tokens", "--model.config", "--optim.learning-rate",
                 "--trainer.steps", "--trainer.checkpoint-every", "--ema-decay", "--no-token-accuracy"):
        assert flag in text


def test_the_guides_flags_parse():
    config = parse(["data:packed-tokens", "--data.path", "data/x", "--data.seq-len", "511", "--ema-decay", "None",
                    "--optim.learning-rate", "0.00015", "--no-token-accuracy", "--sample-tokens", "0",
                    "--model.config", '{"num_layers": 2, "dtype": "bfloat16"}'])
    assert config.data.seq_len == 511 and type(config.data).__name__ == "PackedTokens"
    assert config.ema_decay is None and config.optim.learning_rate == 0.00015 and not config.token_accuracy
    assert config.optim.weight_decay == 0.1 and config.optim.clip_grads == 1.0  # LMRunConfig's defaults
    assert config.model.config == {"num_layers": 2, "dtype": "bfloat16"}


def test_a_flag_given_on_both_sides_of_the_data_subcommand_takes_its_last_value():
    config = parse(["--ema-decay", "0.9", "--no-token-accuracy", "--sample-prompt", "In the", "--optim.b1", "-0.5",
                    "data:token-windows", "--data.path", "data/x", "--ema-decay", "0.5", "--token-accuracy",
                    "--sample-prompt=And God said", "--data.path", "data/y", "--optim.b1", "0.8"])
    assert config.ema_decay == 0.5 and config.token_accuracy and config.sample_prompt == "And God said"
    assert config.data.path == "data/y" and config.optim.b1 == 0.8
    once = parse(["--ema-decay", "0.9", "data:token-windows", "--data.path", "data/x"])
    assert once.ema_decay == 0.9 and type(once.data).__name__ == "TokenWindows"


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer", "gpt2"], "--tokenizer 'gpt2' is not the tokenizer 'byte' that wrote"),
    (["--pretrained", "Qwen/Qwen3-0.6B"], "decides the architecture, so --model.config may set only"),
    (["--objective", "block_diffusion"], "--objective block_diffusion fine-tunes a DiffusionGemma checkpoint"),
    (["--objective", "ar"], "objective is 'ar'; use one of"),
    (["--block-prompt-tokens", "128"], "block_prompt_tokens is 128, but it shapes only --objective block_diffusion"),
    (["--no-seq-aux"], "--no-seq-aux shapes the expert balance loss"),
    (["--balance-rate", "0.001"], "balance_rate=0.001) acts on the routers of a mixture of experts, and this model "
                                  "has none"),
    (["--mtp-weight", "0.3"], "no multi-token-prediction modules"),
    (["--model.config", '{"vocab_size": 100}'], "vocab_size 100 is below the vocab_size 256"),
    (["--model.config", '{"num_layer": 2}'], "causal_transformer: "),
    (["--model.config", "[2]"], "is not a JSON object"),
    (["--sample-tokens", "64"], "beyond the model's max_seq_len 64"),
    (["--optim.warmup-steps", "6"], "optim.warmup_steps 6 leaves no step of the 6"),
    (["--trainer.wandb-mode", "online"], "no W&B project is set"),
])
def test_refusals_name_the_value_and_write_nothing(token_dir, tmp_path, capsys, flags, message):
    run_dir = tmp_path / "refused"
    try:
        code = main(recipe_args(token_dir, run_dir) + flags)  # a repeated flag: the last one counts
    except SystemExit as exit:  # tyro reports a config's ValueError itself, in a box
        code = exit.code
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not run_dir.exists()


def test_lora_settings_are_checked_in_python_too():
    from dew.nn.lora import LoRA

    with pytest.raises(TypeError, match=r"lora is \{'rank': 8\}; give a dew.nn.lora.LoRA \(--lora.rank N"):
        LMRunConfig(lora={"rank": 8})
    with pytest.raises(ValueError, match="--lora.rank 8 adapts a published checkpoint's linears"):
        LMRunConfig(lora=LoRA(8))
    with pytest.raises(NotImplementedError, match="LoRA runs of the recipe are built for --objective lm only"):
        LMRunConfig(lora=LoRA(8), pretrained="some/checkpoint", objective="masked_diffusion")
    assert LMRunConfig(lora=LoRA(8), pretrained="some/checkpoint").lora == LoRA(8)


def test_block_diffusion_needs_a_checkpoint_in_python_too():
    with pytest.raises(ValueError, match="block_diffusion fine-tunes a DiffusionGemma checkpoint"):
        dataclasses.replace(LMRunConfig(), objective="block_diffusion")  # built: tests/recipes/test_block_diffusion.py


def test_a_non_run_directory_is_refused(token_dir, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(recipe_args(token_dir, tmp_path)) == 2
    assert "holds no run.json, so it is not a Dew run" in capsys.readouterr().err
