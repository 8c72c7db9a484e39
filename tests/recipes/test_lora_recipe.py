"""LoRA in the LM recipe: --pretrained DIR --lora.rank N trains only the adapters, resumes exactly, writes
them in PEFT's format when it finishes, and generates from the run with them merged; the refusals."""

from __future__ import annotations

import signal

import jax
import numpy as np
import pytest

import dew
from dew.interop import load_pretrained
from dew.interop.peft import load_peft
from dew.nn.lora import LoRA, LoRAModel, adapters
from dew.recipes.lm import ADAPTER, main, parse, prepare, train
from dew.runs.run_dir import RunDirectory
from dew.trees import overlay
from tests.recipes.conftest import recipe_args, terminate_at
from tests.recipes.test_chat_recipe import _exit_code
from tests.recipes.test_pretrained import checkpoint  # noqa: F401 - the tiny Llama fixture
from tests.training.test_trainer import _flat


def _args(token_dir, run_dir, checkpoint, *extra, steps: int = 4):
    args = recipe_args(token_dir, run_dir, "--pretrained", str(checkpoint), *extra, steps=steps)
    at = args.index("--model.config")
    return [*args[:at], "--model.config", '{"max_seq_len": 32}', *args[at + 2:]]


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.slow
def test_a_lora_run_trains_the_adapters_alone_resumes_exactly_and_exports_them(token_dir, tmp_path, checkpoint,
                                                                                monkeypatch):
    flags = ("--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "q_proj", "v_proj")
    argv = _args(token_dir, tmp_path / "straight", checkpoint, *flags)
    straight = train(parse(argv), verbose=False)

    # Only the adapters moved: every other leaf is the checkpoint's, bit for bit.
    base = load_pretrained(checkpoint, max_seq_len=32)
    model = LoRAModel(base.model, LoRA(4, 8.0, ("q_proj", "v_proj")))
    start = _leaves(model.stack_variables(base.variables))
    trained = _leaves(straight.params)
    assert {path for path in trained if "lora_" not in path} == set(start)
    for path, leaf in start.items():
        np.testing.assert_array_equal(trained[path], leaf, err_msg=path)
    assert _leaves(straight.ema) and all("lora_" in path for path in _leaves(straight.ema))
    trained_b = [leaf for path, leaf in trained.items() if path.endswith("['lora_B']")]
    assert len(trained_b) == 2 * 2 and all(np.any(leaf != 0) for leaf in trained_b)  # B starts at zero

    # Stopped by SIGTERM after step 2 and rerun, the run ends where the straight one does, bit for bit.
    stopped = tmp_path / "stopped"
    terminate_at(monkeypatch, 2)
    assert main(_args(token_dir, stopped, checkpoint, *flags)) == 128 + signal.SIGTERM
    monkeypatch.undo()
    assert not (stopped / ADAPTER).exists()  # written when the run finishes
    resumed = prepare(parse(_args(token_dir, stopped, checkpoint, *flags))).fit(verbose=False)
    for part in ("params", "ema", "opt_state"):
        np.testing.assert_array_equal(_flat(getattr(resumed, part)), _flat(getattr(straight, part)), err_msg=part)

    # The adapters in PEFT's format: the averaged ones (the run keeps an EMA of decay 0.999).
    averaged = overlay(resumed.params, resumed.ema)
    _, loaded = load_peft(stopped / ADAPTER, base.model, base.variables)
    ours, theirs = _leaves(adapters(averaged)), _leaves(adapters(loaded))
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 2 * 2  # layers x targets x (A, B)
    for path in ours:
        np.testing.assert_array_equal(theirs[path], ours[path], err_msg=path)

    # dew generate / dew.pipeline read the run with the adapters folded into the kernels.
    task = dew.pipeline(stopped)
    assert not any("lora_" in path for path in _leaves(task.params))
    merged = _leaves(model.merge(averaged))
    for path, leaf in _leaves(task.params).items():
        np.testing.assert_array_equal(leaf, merged[path], err_msg=path)
    assert RunDirectory(stopped).record()["settings"]["lora"] == {"rank": 4, "alpha": 8.0,
                                                                  "targets": ["q_proj", "v_proj"], "dropout": 0.0,
                                                                  "within": None}
    assert np.shape(task([[1, 2, 3]], max_new_tokens=2).host().tokens) == (1, 3 + 2)


@pytest.mark.parametrize("extra, message", [
    (("--pretrained", "CHECKPOINT", "--lora.rank", "4", "--lora.targets", "qkv_proj"),
     "LoRA targets ['qkv_proj'] match no linear of this model; its linears are"),
    (("--pretrained", "CHECKPOINT", "--lora.alpha", "8"),
     "--lora.alpha shape(s) LoRA adapters, and --lora.rank is unset, so there are none: add --lora.rank N"),
    (("--lora.rank", "4"), "--lora.rank 4 adapts a published checkpoint's linears and freezes the rest, and "
                           "--pretrained is unset"),
])
def test_bad_lora_flags_are_refused_by_name(token_dir, tmp_path, checkpoint, capsys, extra, message):
    extra = [str(checkpoint) if value == "CHECKPOINT" else value for value in extra]
    argv = recipe_args(token_dir, tmp_path / "run", *extra)
    if "--pretrained" in extra:
        at = argv.index("--model.config")
        argv[at + 1] = '{"max_seq_len": 32}'
    assert _exit_code(lambda: main(argv)) == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not (tmp_path / "run").exists()
