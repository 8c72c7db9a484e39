"""`dew export RUN OUT`: a run trained from scratch, loaded by transformers with the logits Dew computes, its
tokenizer with the ids the run trained on, and the weights (EMA or live, any step) the flags choose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dew
from dew.cli import main
from dew.recipes import lm
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401  (the fixture)
from tests.tolerances import transformers_decoder_ulps, ulp_bound

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow  # trains a tiny run (about 10 s)

TEXT = "line 7: the quick brown fox"


@pytest.fixture(scope="module")
def run(token_dir, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("export") / "run"
    assert lm.main(recipe_args(token_dir, run, "--sample-tokens", "7", "--sampling.temperature", "0", steps=4)) == 0
    return run


def _logits(directory, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits.numpy()[0], model.config


@pytest.mark.parametrize("live, step", [(False, None), (True, 2)], ids=["ema-newest", "live-step-2"])
def test_transformers_loads_the_export_with_dews_logits(run, tmp_path, live, step, capsys):
    """fp32 logits of a 2-layer width-32 decoder over 27 tokens: transformers_decoder_ulps bounds the difference
    by about 1,310 ulps of the largest logit (6.3e-5 at 0.40 for the newest averaged weights); observed 1.2e-7.
    A wrong weight moves logits by their own size, far past the bound."""
    out = tmp_path / "exported"
    flags = (["--live"] if live else []) + ([] if step is None else ["--step", str(step)])
    assert main(["export", str(run), str(out), *flags]) == 0
    assert f"wrote {out} (llama)" in capsys.readouterr().out
    task = dew.pipeline(run, ema=not live, step=step)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert ids == task.tokenizer.encode(TEXT) and tokenizer.decode(ids) == TEXT
    theirs, config = _logits(out, ids)
    ours = np.asarray(task.model.apply(task.params, jnp.asarray([ids], jnp.int32)))[0]
    bound = ulp_bound(transformers_decoder_ulps(config, len(ids)), np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["do_sample"] is False and generation["max_new_tokens"] == 7


def test_live_and_averaged_weights_differ_and_a_bad_source_is_refused(run, tmp_path, capsys):
    assert main(["export", str(run), str(tmp_path / "ema")]) == 0
    assert main(["export", str(run), str(tmp_path / "live"), "--live"]) == 0
    ids = dew.pipeline(run).tokenizer.encode(TEXT)
    assert not np.allclose(_logits(tmp_path / "ema", ids)[0], _logits(tmp_path / "live", ids)[0])
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ema"), str(tmp_path / "again")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_export_onto_a_disk_that_refuses_the_write_is_one_line_and_exit_1(run, tmp_path):
    """A full disk (ENOSPC) and a file-size limit (EFBIG, set here with no special file system) fail safetensors'
    writer alike, with an error that is no OSError until Dew unwraps it."""
    out = tmp_path / "exported"
    root = str(Path(__file__).resolve().parents[2])
    limited = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); "
               "from dew.cli import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", limited, "export", str(run), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"})
    assert (done.returncode, done.stderr) == (1, f"error: {out}: File too large\n")
    assert list(out.iterdir()) == []  # nothing half-written is left


def test_an_export_never_goes_into_the_run_and_replaces_files_only_when_forced(run, tmp_path, capsys):
    before = sorted(path.name for path in run.iterdir())
    for out, says in ((run, f"OUT {run} is the run directory"),
                      (run / "checkpoints" / "4", f"OUT {run / 'checkpoints' / '4'} is inside {run}'s checkpoints")):
        assert main(["export", str(run), str(out), "--force"]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"error: {says}: an export there would write over the run's own files") and (
            "\n" not in error)
    assert sorted(path.name for path in run.iterdir()) == before
    assert main(["export", str(run), "", "--force"]) == 2
    assert "error: OUT is an empty path, which would write the export into the current directory" in (
        capsys.readouterr().err)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(run), str(out)]) == 2
    assert (f"error: OUT {out} is not empty (it holds notes.txt): pass --force to write the export there (nothing "
            "there would be replaced; the rest stays)") in capsys.readouterr().err
    assert main(["export", str(run), str(out), "--force"]) == 0
    assert "replaces" not in capsys.readouterr().out
    exported = "config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json"
    assert main(["export", str(run), str(out), "--live"]) == 2  # an earlier export counts as well
    assert f"(it would replace {exported}; the rest stays)" in capsys.readouterr().err
    assert main(["export", str(run), str(out), "--live", "--force"]) == 0
    assert f"; it replaces the {exported} that {out} held" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine"


def test_gguf_export_of_a_run_reads_back_with_its_logits_and_tokenizer(run, tmp_path, capsys):
    from dew.interop import load_pretrained

    out = tmp_path / "kjv.gguf"
    assert main(["export", str(run), str(out), "--format", "gguf", "--outtype", "f32"]) == 0
    assert f"wrote {out} (f32): `llama-cli -m {out}`" in capsys.readouterr().out
    task = dew.pipeline(run)
    bundle = load_pretrained(tmp_path, gguf_file=out.name)
    ids = task.tokenizer.encode(TEXT)
    assert bundle.tokenizer.encode(TEXT) == ids and bundle.tokenizer.decode(ids) == TEXT  # bytes as ids
    ours = np.asarray(task.model.apply(task.params, jnp.asarray([ids], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(bundle.model.apply(bundle.variables, jnp.asarray([ids]))), ours)
    assert main(["export", str(run), str(out), "--format", "gguf"]) == 2
    assert f"error: OUT {out} exists: pass --force" in capsys.readouterr().err
    assert main(["export", str(run), str(tmp_path), "--format", "gguf"]) == 2
    assert "is a directory: a GGUF export is one file" in capsys.readouterr().err
