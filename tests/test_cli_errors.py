"""The `dew` command over a table of bad inputs and faults, each in its own process from another
working directory: one `error:` line naming the problem, never a traceback, and the exit status
`dew.errors` documents (2 refused, 1 the environment). Argument errors that tyro catches while
parsing (an unknown flag, a value a config refuses) print tyro's own box and exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from dew.recipes.lm import main as train
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401 - the shared token files
from tests.recipes.test_reliability import _truncate_newest_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The table's model: the smallest the recipe builds (1 layer of width 32, byte vocabulary).
ONE_LAYER = json.dumps({"emb_features": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "mlp_features": 64,
                        "max_seq_len": 64})


def _tiny(token_dir, run_dir, *extra: str) -> list[str]:  # noqa: F811
    return [*recipe_args(token_dir, run_dir, *extra, steps=2), "--model.config", ONE_LAYER]


# (id, argv with {tokens} {corpus} {run} {work} {damaged} {locked} {blocked} {bad_json} {empty_run} filled in,
#  exit status, kind, what stderr says). kind: "error" one line, "box" tyro's box, "warning" a
#  warning line and exit 0.
CASES = [
    ("unknown-command", ["fly"], 2, "error", "dew has no command 'fly'"),
    ("runs-missing-directory", ["runs", "{work}/nothing"], 2, "error", "nothing is not a directory"),
    ("plot-missing-run", ["plot", "{work}", "--out", "{work}/curves.png"], 2, "error", "holds no run.json"),
    ("tokenize-missing-input", ["tokenize", "--input", "{work}/missing.txt", "--out", "{work}/tokens",
                                "--tokenizer", "byte"], 2, "error", "missing.txt"),
    ("tokenize-empty-out", ["tokenize", "--input", "{corpus}", "--out", "", "--tokenizer", "byte"], 2, "error",
     "out is an empty path, which would write the token files into the current directory"),
    ("export-into-the-run", ["export", "{run}", "{run}", "--force"], 2, "error",
     "OUT {run} is the run directory: an export there would write over the run's own files"),
    ("generate-missing-run", ["generate", "{work}/runs/sigg", "--prompt", "x"], 2, "error", "runs/sigg"),
    ("generate-missing-step", ["generate", "{run}/checkpoints/99", "--prompt", "x"], 2, "error",
     "holds no complete checkpoint at step 99; it holds steps [2]"),
    ("generate-nan-temperature", ["generate", "{run}", "--prompt", "x", "--temperature", "nan"], 2, "error",
     "temperature is nan; it must be a finite number"),
    ("generate-too-long", ["generate", "{run}", "--prompt", "x", "--max-new-tokens", "1000"], 2, "error",
     "beyond the model's max_seq_len 64"),
    ("generate-rows-beyond-memory", ["generate", "{run}", "--prompt", "x", "--max-new-tokens", "4", "--n",
                                     "1000000000"], 2, "error",
     "n 1,000,000,000 continuations of 1 prompt(s) are 1,000,000,000 rows, which would hold about"),
    ("generate-no-checkpoint", ["generate", "{empty_run}", "--prompt", "x"], 2, "error", "has no checkpoint yet"),
    ("generate-malformed-run-json", ["generate", "{bad_json}", "--prompt", "x"], 2, "error",
     "run.json is not valid JSON"),
    ("generate-damaged-checkpoint", ["generate", "{damaged}", "--prompt", "line", "--max-new-tokens", "2"], 0,
     "warning", "skipped checkpoint {damaged}/checkpoints/4, which cannot be read"),
    ("train-missing-data", ["train", *_tiny("{work}/no-tokens", "{work}/r1")], 2, "error", "no-tokens"),
    ("train-unknown-flag", ["train", *_tiny("{tokens}", "{work}/r2"), "--trainer.stepz", "3"], 2, "box",
     "--trainer.stepz"),
    ("train-nan-learning-rate", ["train", *_tiny("{tokens}", "{work}/r3"), "--optim.learning-rate", "nan"], 2,
     "box", "optim.learning_rate is nan; it must be a finite number"),
    ("train-batch-split", ["train", *_tiny("{tokens}", "{work}/r4"), "--trainer.batch", "3",
                           "--trainer.accumulation", "2"], 2, "error",
     "--trainer.batch 3 does not split into --trainer.accumulation 2"),
    ("train-other-tokenizer", ["train", *_tiny("{tokens}", "{work}/r5"), "--tokenizer", "gpt2"], 2, "error",
     "is not the tokenizer 'byte' that wrote"),
    ("train-val-batch-above-the-windows", ["train", *_tiny("{tokens}", "{work}/r6"), "--trainer.eval-every", "2",
                                           "--trainer.val-batch", "1000"], 2, "error",
     "val_batch 1000 (--trainer.val-batch) is more than the"),
    ("train-run-dir-under-a-file", ["train", *_tiny("{tokens}", "{blocked}/run")], 2, "error",
     "Not a directory"),
    ("train-held-run-dir", ["train", *_tiny("{tokens}", "{locked}")], 1, "error", "is held by process"),
    ("train-malformed-run-json", ["train", *_tiny("{tokens}", "{bad_json}")], 2, "error",
     "run.json is not valid JSON"),
    ("train-different-run", ["train", *_tiny("{tokens}", "{run}"), "--data.seed", "3"], 2, "error",
     "holds a run that this command does not describe"),
]


def _fill(text: str, places: dict) -> str:
    """`text` with each {name} of `places` replaced (str.format would read the JSON's braces)."""
    for name, value in places.items():
        text = text.replace("{" + name + "}", str(value))
    return text


@pytest.fixture(scope="module")
def places(token_dir, tmp_path_factory):  # noqa: F811
    """The table's directories: a trained run, a copy with a damaged newest checkpoint, a run held by
    another process, a malformed run.json, a run with no checkpoint and a path under a file."""
    work = tmp_path_factory.mktemp("cli-errors")
    run = work / "run"
    assert train([*_tiny(token_dir, run), "--trainer.checkpoint-every", "2"]) == 0  # checkpoint 2
    damaged = work / "damaged"
    assert train([*_tiny(token_dir, damaged), "--trainer.steps", "4"]) == 0  # checkpoints 2 and 4
    assert _truncate_newest_checkpoint(damaged) == 4
    bad_json = work / "bad-json"
    bad_json.mkdir()
    (bad_json / "run.json").write_text('{"recipe": "lm", ')
    empty_run = work / "empty-run"
    empty_run.mkdir()
    shutil.copy(run / "run.json", empty_run / "run.json")
    (work / "blocked").write_text("a file, not a directory")
    locked = work / "locked"
    locked.mkdir()
    holder = subprocess.Popen(  # holds the lock as a training process does, with its record
        [sys.executable, "-c", "import fcntl, json, os, sys, time\n"
         "handle = open(sys.argv[1], 'a+')\nfcntl.flock(handle, fcntl.LOCK_EX)\n"
         "handle.write(json.dumps({'pid': os.getpid(), 'host': 'here', 'since': 'now'}))\nhandle.flush()\n"
         "print('held', flush=True)\ntime.sleep(600)\n", str(locked / "run.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    corpus = os.path.join(os.path.dirname(token_dir), "corpus.txt")  # the text the token files hold
    yield {"work": work, "tokens": token_dir, "corpus": corpus, "run": run, "damaged": damaged, "bad_json": bad_json,
           "empty_run": empty_run, "blocked": work / "blocked", "locked": locked, "holder": holder.pid}
    holder.kill()
    holder.wait(timeout=30)


@pytest.fixture(scope="module")
def outcomes(places):
    """Every case of the table run once, a few at a time, each within 180 s, from the work directory."""
    env = {**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(places["work"] / "cache")}

    def run(case):
        argv = [_fill(argument, places) for argument in case[1]]
        return subprocess.run([sys.executable, "-m", "dew.cli", *argv], cwd=places["work"], env=env,
                              capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip([case[0] for case in CASES], pool.map(run, CASES)))


@pytest.mark.slow
@pytest.mark.parametrize("name, argv, status, kind, says", CASES, ids=[case[0] for case in CASES])
def test_a_bad_input_gets_one_line_and_its_exit_status(outcomes, places, name, argv, status, kind, says):
    done = outcomes[name]
    says = _fill(says, places)
    assert "Traceback" not in done.stderr and "\n  File " not in done.stderr, done.stderr[-3000:]
    assert done.returncode == status, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    if kind == "box":
        assert says in " ".join(done.stderr.replace("│", " ").split())
        return
    prefix = "error: " if kind == "error" else "warning: "
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1 and says in found[0], done.stderr[-3000:]
    if name == "train-held-run-dir":
        assert f"process {places['holder']} on here" in found[0]
    if name != "train-different-run":  # the one refusal that lists the differing settings below its line
        assert all(line.startswith(("error: ", "warning: ")) for line in lines), done.stderr[-3000:]


def test_the_commands_that_never_compile_never_import_jax(tmp_path):
    """`dew --help`, `--version`, a mistyped command, `tokenize`, `runs` and `plot` answer without importing
    jax (about a second of start-up each), nor turning on JAX's cache; `dew.pipeline` still imports on use."""
    script = (
        "import contextlib, io, sys\n"
        "from dew.cli import main\n"
        "work = sys.argv[1]\n"
        "calls = [['--help'], ['--version'], ['fly'], ['runs', work], ['plot', work, '--out', work + '/c.png'],\n"
        "         ['tokenize', '--input', work + '/missing.txt', '--out', work + '/t', '--tokenizer', 'byte']]\n"
        "codes = []\n"
        "for argv in calls:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        codes.append(main(argv))\n"
        "print(codes, 'jax' in sys.modules)\n"
        "from dew.runs import pipeline\n"
        "print(callable(pipeline), pipeline.__module__, 'jax' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[0, 0, 2, 0, 2, 2] False", "True dew.runs.generation True"], done.stdout
