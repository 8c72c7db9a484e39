"""A run directory under faults and second thoughts: one process holds it, a refused command writes
nothing, a rerun compares resolved settings, a diverged run says where to continue from and
continues with an explicit, recorded change, and a corrupt newest checkpoint is skipped."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from dew.run_config import OptimConfig, TrainerConfig
from dew.recipes.lm import main, parse, prepare
from dew.runs.run_dir import RunDirectory
from tests.recipes.conftest import TINY_MODEL, recipe_args, terminate_at


def test_a_second_process_on_a_held_run_directory_is_refused_naming_the_holder(token_dir, tmp_path, capsys):
    argv = recipe_args(token_dir, tmp_path / "run", steps=2)
    holder = prepare(parse(argv))  # holds the directory's lock, as a training process does
    try:
        assert main(argv) == 1
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"error: {tmp_path / 'run'} is held by process {os.getpid()} on ")
        assert "\n" not in error and "kill" in error
    finally:
        holder.close()
    assert main(argv) == 0  # released: the same command trains


def test_a_refused_config_writes_nothing_and_the_corrected_command_starts_the_run(token_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = recipe_args(token_dir, run_dir, steps=2)
    assert main(argv + ["--trainer.batch", "3", "--trainer.accumulation", "2"]) == 2
    assert "--trainer.batch 3 does not split into --trainer.accumulation 2" in capsys.readouterr().err
    assert not run_dir.exists()
    assert main(argv) == 0


def test_a_rerun_compares_resolved_paths_and_the_built_model(token_dir, tmp_path, monkeypatch, capsys):
    # The same token files spelled ./tokens/ and tokens, from the directory above them or from
    # another one by an absolute path; and vocab_size spelled out at the value meta.json gives it.
    monkeypatch.chdir(os.path.dirname(token_dir))
    name = os.path.basename(token_dir)
    run_dir = tmp_path / "run"
    assert main(recipe_args(f"./{name}/", run_dir, steps=2)) == 0
    spelled = recipe_args(name, run_dir, steps=2)
    model = spelled.index("--model.config") + 1
    spelled[model] = json.dumps({**json.loads(spelled[model]), "vocab_size": 256})
    assert main(spelled) == 0
    monkeypatch.chdir(tmp_path)
    assert main(recipe_args(token_dir, run_dir, steps=2)) == 0
    assert capsys.readouterr().out.count("nothing left to train") == 2
    assert RunDirectory(run_dir).record()["settings"]["data"]["path"] == token_dir


@pytest.mark.parametrize("kwargs, message", [
    (dict(learning_rate=math.nan), "optim.learning_rate is nan; it must be a finite number"),
    (dict(learning_rate=math.inf), "optim.learning_rate is inf; it must be a finite number"),
    (dict(learning_rate=-1e-3), "optim.learning_rate is -0.001; it must be positive"),
    (dict(weight_decay=math.nan), "optim.weight_decay is nan"),
    (dict(b2=1.0), r"optim.b2 is 1.0; it must lie in \[0, 1\)"),
    (dict(eps=-1.0), "optim.eps is -1.0"),
])
def test_non_finite_and_meaningless_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_allow_changes_names_only_optimizer_settings():
    assert TrainerConfig(allow_changes=("optim.learning-rate",)).allow_changes == ("optim.learning_rate",)
    with pytest.raises(ValueError, match="a run may change only its optimizer settings"):
        TrainerConfig(allow_changes=("model.config",))


def test_a_diverged_run_names_its_last_good_checkpoint_and_continues_from_it_with_a_recorded_change(
        token_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # Warm-up from 0: step 1 applies a zero learning rate (and is saved); step 2's 2.5e24 overflows.
    argv = recipe_args(token_dir, run_dir, "--optim.learning-rate", "1e25", "--optim.warmup-steps", "4",
                       "--optim.clip-grads", "None", "--trainer.checkpoint-every", "1", steps=6)
    assert main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "Traceback" not in error
    assert f"the last good checkpoint is step 1 ({run_dir / 'checkpoints' / '1'})" in error
    assert "--trainer.allow-changes optim.learning-rate" in error
    status = RunDirectory(run_dir).status()
    assert status["state"] == "diverged" and status["step"] == 2 and status["checkpoint"] == 1

    assert main(argv) == 1  # the same command diverges again, from the same checkpoint
    capsys.readouterr()
    changed = argv + ["--optim.learning-rate", "0.001"]
    assert main(changed) == 2  # a changed setting needs the explicit flag
    assert "add --trainer.allow-changes optim.learning-rate" in capsys.readouterr().err
    assert main(changed + ["--trainer.allow-changes", "optim.learning-rate"]) == 0
    assert "changed optim.learning_rate 1e+25 -> 0.001, from step 1 on" in capsys.readouterr().out
    run = RunDirectory(run_dir)
    record = run.record()
    assert record["settings"]["optim"]["learning_rate"] == 0.001
    assert [(change["step"], change["settings"]) for change in record["changes"]] == [
        (1, {"optim.learning_rate": {"from": 1e25, "to": 0.001}})]
    assert run.status()["state"] == "finished" and run.checkpoint_steps()[-1] == 6
    assert main(changed) == 0  # the changed command is now the run's own
    assert main(argv) == 2  # and the first one is not


def test_a_rerun_on_replaced_token_files_is_refused_unless_allowed_and_the_change_is_recorded(
        token_dir, tmp_path, monkeypatch, capsys):
    tokens, run_dir = tmp_path / "tokens", tmp_path / "run"
    shutil.copytree(token_dir, tokens)
    argv = recipe_args(str(tokens), run_dir, steps=4)
    terminate_at(monkeypatch, 2)
    assert main(argv) == 128 + signal.SIGTERM  # checkpoint 2 of 4
    monkeypatch.undo()
    before = (run_dir / "run.json").read_text()
    old = json.loads(before)["data"]["fingerprint"]
    train_bin = tokens / "train.bin"
    train_bin.write_bytes(train_bin.read_bytes()[::-1])  # other data of the same size: meta.json still agrees
    capsys.readouterr()
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert f"--data.path {tokens}: its contents are not those the run trained on (their fingerprint was {old}" in error
    assert error.rstrip().endswith("add --trainer.allow-changes data.fingerprint.")
    assert (run_dir / "run.json").read_text() == before
    assert main(argv + ["--trainer.allow-changes", "data.fingerprint"]) == 0
    record = RunDirectory(run_dir).record()
    new = record["data"]["fingerprint"]
    assert f"changed data.fingerprint {old} -> {new}, from step 2 on" in capsys.readouterr().out
    assert [(change["step"], change["data"]) for change in record["changes"]] == [
        (2, {"fingerprint": {"from": old, "to": new}})]
    # A run.json from before runs recorded a fingerprint takes the data's as it is, and says so.
    del record["data"]["fingerprint"]
    (run_dir / "run.json").write_text(json.dumps(record))
    assert main(argv) == 0
    assert "recorded no fingerprint of the data (the run started before runs kept one)" in capsys.readouterr().out
    assert RunDirectory(run_dir).record()["data"]["fingerprint"] == new


def test_a_run_recorded_before_a_model_field_existed_resumes(token_dir, tmp_path, monkeypatch):
    """Fields DecoderConfig gained since the run started (here `kernels`, `recurrent`, `attn_output_gate`) read as their
    defaults, which compute what the run did: the same command resumes, and a new value of one is still a
    difference."""
    run_dir = tmp_path / "run"
    argv = recipe_args(token_dir, run_dir, steps=4)
    terminate_at(monkeypatch, 2)
    assert main(argv) == 128 + signal.SIGTERM  # checkpoint 2 of 4
    monkeypatch.undo()
    record = json.loads((run_dir / "run.json").read_text())
    for name in ("kernels", "recurrent", "attn_output_gate"):
        del record["model"]["config"][name]
    (run_dir / "run.json").write_text(json.dumps(record))
    xla = json.dumps({**TINY_MODEL, "kernels": "xla"})
    assert main([*argv, "--model.config", xla]) == 2
    assert main(argv) == 0
    assert RunDirectory(run_dir).checkpoint_steps()[-1] == 4


def _word_tokenizer(directory, words: list[str]):
    """A word-level tokenizer.json over `words` (ids in that order) plus an unknown token."""
    import tokenizers

    vocab = {word: index for index, word in enumerate(["[UNK]", " ", "\n", *words])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(" ", behavior="isolated")
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def word_run(tmp_path_factory):
    """A 2-step run on word-level token files, its tokenizer given by a relative path."""
    from dew.data.tokenize import tokenize_text

    root = tmp_path_factory.mktemp("word-run")
    words = "the quick brown fox jumps over lazy dog".split()
    _word_tokenizer(root / "tok", words)
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        tokenize_text("corpus.txt", "tokens", "tok", val_fraction=0.1, workers=1)
        argv = recipe_args("tokens", root / "run", "--tokenizer", "tok", steps=2)
        assert main(argv) == 0
    finally:
        os.chdir(cwd)
    return root, argv


def test_a_run_keeps_its_tokenizer_and_generates_from_any_directory(word_run, tmp_path, monkeypatch):
    import dew

    root, _ = word_run
    assert (root / "run" / "tokenizer.json").read_bytes() == (root / "tok" / "tokenizer.json").read_bytes()
    # Elsewhere, a different tokenizer.json at the same relative path must not be picked up.
    _word_tokenizer(tmp_path / "tok", ["dog", "lazy", "the"])
    monkeypatch.chdir(tmp_path)
    task = dew.pipeline(root / "run")
    assert task.tokenizer.path == root / "run" / "tokenizer.json"
    assert task.encode("the dog") == [[3, 1, 10]]
    assert task("the dog", 2).tokens.shape == (1, 5)


def test_a_rerun_whose_tokenizer_changed_at_the_same_path_is_refused(word_run, capsys):
    root, argv = word_run
    original = (root / "tok" / "tokenizer.json").read_bytes()
    _word_tokenizer(root / "tok", ["dog", "lazy", "the"])
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(argv) == 2
    finally:
        os.chdir(cwd)
        (root / "tok" / "tokenizer.json").write_bytes(original)
    assert f"is not the one {root / 'run'} was trained with" in capsys.readouterr().err


def _truncate_newest_checkpoint(run_dir) -> int:
    """Cut the largest data file of the newest checkpoint to 100 bytes, as a failing disk might."""
    step = RunDirectory(run_dir).checkpoint_steps()[-1]
    files = [path for path in (run_dir / "checkpoints" / str(step)).rglob("*") if path.is_file()]
    largest = max(files, key=lambda path: path.stat().st_size)
    os.truncate(largest, 100)
    return step


class _StopAtStep3:
    """A tracker that sends this process SIGTERM once step 3 is logged: the run saves step 3 and stops."""

    def start(self, step): ...

    def scalars(self, step, values):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    def texts(self, step, name, texts): ...

    def close(self): ...


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(token_dir, tmp_path, capsys):
    import dew
    from dew.training.checkpoints import CheckpointSkipped
    from dew.training.trainer import TrainingInterrupted

    run_dir = tmp_path / "run"
    argv = recipe_args(token_dir, run_dir)
    stopped = prepare(parse(argv))
    stopped.trackers.append(_StopAtStep3())
    with pytest.raises(TrainingInterrupted):
        stopped.fit(verbose=False)
    stopped.close()
    assert _truncate_newest_checkpoint(run_dir) == 3
    capsys.readouterr()

    assert main(argv) == 0  # resumes from step 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: skipped")]
    assert len(lines) == 1
    assert f"skipped checkpoint {run_dir / 'checkpoints' / '3'}, which cannot be read (" in lines[0]
    assert f"for step 2; it is kept as {run_dir / 'checkpoints' / '3.unreadable'}" in lines[0]
    run = RunDirectory(run_dir)
    assert run.checkpoint_steps() == [2, 4, 6] and (run_dir / "checkpoints" / "3.unreadable").is_dir()
    assert [entry["step"] for entry in run.metrics()] == [1, 2, 3, 4, 5, 6]

    _truncate_newest_checkpoint(run_dir)
    with pytest.warns(CheckpointSkipped, match=r"cannot be read \(.*\), for step 4$"):
        task = dew.pipeline(run_dir)
    assert task("line", 2).tokens.shape == (1, 6)
    assert run.checkpoint_steps() == [2, 4, 6]  # generation reads; it moves nothing


# -- faults of the environment, in real processes ------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dew(*args: str, cwd=None, timeout: float = 300) -> "subprocess.CompletedProcess":
    """`python -m dew.cli ARGS` in a fresh process importing this checkout, bounded in time."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "dew.cli", *args], cwd=cwd or ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _can_mount_privately() -> bool:
    """Whether this user may mount a tmpfs in a private mount namespace (root with CAP_SYS_ADMIN)."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(not _can_mount_privately(), reason="needs a private tmpfs mount (unshare -m)")


def _in_private_mount(script: str, timeout: float = 300) -> "subprocess.CompletedProcess":
    """Run a shell `script` in its own mount namespace: its mounts vanish with it."""
    import subprocess

    return subprocess.run(["unshare", "-m", "sh", "-ec", script], env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=timeout)


def _train_command(token_dir, run_dir, *extra: str, steps: int = 6) -> str:
    import shlex
    import sys

    return shlex.join([sys.executable, "-m", "dew.cli", "train", *recipe_args(token_dir, run_dir, *extra, steps=steps)])


@pytest.mark.slow
@needs_mount
def test_a_full_disk_while_checkpointing_is_one_line_and_status_says_failed(token_dir, tmp_path):
    # 950 kB hold run.json, the logs and the step-2 checkpoint (about 640 kB in whole 4 kB pages, `du -sk`; 700 kB
    # left too little room for Orbax's temporary files, and step 2 failed in one run under load) but not the
    # step-4 checkpoint beside it (the two take about 1,290 kB).
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    done = _in_private_mount(f"""
        mount -t tmpfs -o size=950k tmpfs {disk}
        set +e
        {_train_command(token_dir, disk / 'run')} > {tmp_path / 'out'} 2> {tmp_path / 'err'}
        echo "exit $?"
        set -e
        cp -r {disk / 'run'} {kept}
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit 1"
    error = (tmp_path / "err").read_text().strip()
    assert error == (f"error: checkpoint {disk / 'run' / 'checkpoints' / '4'} could not be written (No space left on "
                     "device); the last complete checkpoint is step 2: the disk is full: free space (or choose "
                     "another disk) and rerun the same command")
    status = json.loads((kept / "status.json").read_text())
    assert status["state"] == "failed" and status["checkpoint"] == 2 and "No space left" in status["message"]
    assert sorted(os.listdir(kept / "checkpoints")) == ["2"]  # the partial step 4 was removed


@pytest.mark.slow
@needs_mount
def test_a_read_only_run_directory_is_one_line(token_dir, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    done = _in_private_mount(f"""
        mount -t tmpfs -o size=2m tmpfs {disk}
        {_train_command(token_dir, disk / 'run', steps=2)} > /dev/null
        mount -o remount,ro {disk}
        set +e
        {_train_command(token_dir, disk / 'run', steps=2)}
        echo "exit $?"
        {_train_command(token_dir, disk / 'new', steps=2)}
        echo "exit $?"
    """)
    assert done.stdout.split() == ["exit", "1", "exit", "1"], done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"error: cannot create the run directory's files in {disk / 'run'} (Read-only file system: "
        f"{disk / 'run' / 'run.lock'}): pass --trainer.run-dir with a directory this user can write",
        f"error: cannot create the run directory's files in {disk / 'new'} (Read-only file system: "
        f"{disk / 'new'}): pass --trainer.run-dir with a directory this user can write",
    ]


def test_status_is_recorded_in_place_when_the_disk_is_full(tmp_path, monkeypatch):
    import errno

    from dew.runs import run_dir as run_dir_module

    run = RunDirectory(tmp_path)
    run.set_status("running", 3)

    def disk_full(path, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(path) + ".partial")

    monkeypatch.setattr(run_dir_module, "_write_json", disk_full)
    run.set_status("failed", 3, "checkpoint 4 could not be written")
    assert run.status()["state"] == "failed" and run.status()["message"] == "checkpoint 4 could not be written"


SECOND_SIGTERM = """
import json, os, signal, sys
from dew.recipes.lm import main
from dew.training.checkpoints import Checkpoints
from dew.training.trackers import JsonLines

write, save = JsonLines.scalars, Checkpoints.save

def first_at_step_3(self, step, values):
    write(self, step, values)
    if step == 3:
        os.kill(os.getpid(), signal.SIGTERM)

def second_while_saving(self, state, position):
    if int(state.step) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return save(self, state, position)

JsonLines.scalars, Checkpoints.save = first_at_step_3, second_while_saving
sys.exit(main(json.loads(sys.argv[1])))
"""


@pytest.mark.slow
def test_a_second_sigterm_while_saving_exits_143_in_one_line(token_dir, tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SECOND_SIGTERM, json.dumps(recipe_args(token_dir, run_dir))],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert done.stderr.strip() == ("error: SIGTERM stopped training at once (a second SIGTERM while saving: stopped "
                                   "without it); the last checkpoint is step 2: rerun the same command to resume")
    status = RunDirectory(run_dir).status()
    assert status["state"] == "interrupted" and status["checkpoint"] == 2


@pytest.fixture(scope="module")
def byte_run(token_dir, tmp_path_factory):
    """A finished 2-step run on the byte-level token files."""
    run_dir = tmp_path_factory.mktemp("byte-run") / "run"
    assert main(recipe_args(token_dir, run_dir, steps=2)) == 0
    return run_dir


def test_one_malformed_run_json_does_not_hide_the_other_runs(token_dir, byte_run, tmp_path, capsys):
    import shutil

    from dew.cli import main as dew

    shutil.copytree(byte_run, tmp_path / "good")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text('{"recipe": "lm", ')
    capsys.readouterr()
    assert dew(["runs", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "finished" in table and "unreadable" in table
    assert f"{tmp_path / 'bad' / 'run.json'} is not valid JSON (Expecting property name" in " ".join(table.split())
    for command in (["generate", str(tmp_path / "bad"), "--prompt", "x"], ["train", *recipe_args(token_dir, tmp_path / "bad")]):
        assert dew(command) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"error: {tmp_path / 'bad' / 'run.json'} is not valid JSON") and "\n" not in error


# -- what was silently accepted --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan),
                                    dict(min_p=math.nan), dict(repetition_penalty=math.inf)])
def test_non_finite_sampling_values_are_refused(kwargs):
    from dew.sampling import Sampling

    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"{name} is {value}"):
        Sampling(**kwargs)


@pytest.mark.parametrize("prompts", [[[1.0, 2.0]], [[1, 2.7]], [np.array([1.5, 2.0])], np.array([[1.0, 2.0]]),
                                     [[True, 2]]])
def test_float_token_ids_are_refused_not_truncated(tiny_model, tiny_variables, prompts):
    import jax

    from dew.sampling import generate

    with pytest.raises(ValueError, match=r"token ids are integers"):
        generate(tiny_model, tiny_variables, prompts, 2, key=jax.random.key(0))


def test_a_flat_list_of_float_ids_is_one_refused_row(tiny_model, tiny_variables):
    from dew.inference import TextGeneration

    with pytest.raises(ValueError, match=r"prompt 0 holds 1.5 \(float\)"):
        TextGeneration(tiny_model, tiny_variables)([1.5, 2.0], 2)


def test_control_characters_are_escaped_but_newlines_and_tabs_kept():
    from dew.inference.text import printable

    assert printable("a\x00b\x1b[31mc\nd\te\x7f\x9b\r") == "a\\x00b\\x1b[31mc\nd\te\\x7f\\x9b\\x0d"


def test_dew_generate_prints_no_raw_control_characters(byte_run, capsys):
    from dew.cli import main as dew

    assert dew(["generate", str(byte_run), "--prompt", "\x1b]0;title\x07red", "--max-new-tokens", "8",
                "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("\\x1b]0;title\\x07red")
    assert not any(ord(character) < 32 and character not in "\n\t" for character in out)


def test_pretrained_weights_refuse_token_files_of_another_tokenizer(token_dir, word_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import shutil

    from dew.data.tokenize import tokenize_text

    root, _ = word_run  # token files written with the word tokenizer at root/tok
    checkpoint = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(checkpoint)
    shutil.copy(root / "tok" / "tokenizer.json", checkpoint / "tokenizer.json")
    flags = ["--pretrained", str(checkpoint), "--model.config", "{}", "--ema-decay", "None"]

    same = prepare(parse(recipe_args(str(root / "tokens"), tmp_path / "same", "--tokenizer", str(root / "tok"), *flags)))
    same.close()
    assert same.notes == []

    assert main(recipe_args(token_dir, tmp_path / "bytes", *flags)) == 2
    error = capsys.readouterr().err
    assert f"the token files {token_dir} (meta.json: 'byte'), 256 ids, were written with another tokenizer than " \
           f"--pretrained {checkpoint}'s ({checkpoint / 'tokenizer.json'}, 11 tokens)" in error
    assert not (tmp_path / "bytes").exists()

    _word_tokenizer(tmp_path / "other", ["dog", "lazy", "the", "fox", "quick", "brown", "jumps", "over"])
    tokenize_text(str(root / "corpus.txt"), str(tmp_path / "other-tokens"), str(tmp_path / "other"), val_fraction=0.1,
                  workers=1)
    assert main(recipe_args(str(tmp_path / "other-tokens"), tmp_path / "other-run", "--tokenizer",
                            str(tmp_path / "other"), *flags)) == 2
    assert "were written with another tokenizer than --pretrained" in capsys.readouterr().err


def test_pretrained_multimodal_checkpoint_refused_by_the_recipe(token_dir, tmp_path, capsys):
    """The recipe's runs are text decoders' (run.json, dew.pipeline of a run): a Gemma 3 checkpoint is
    refused in one line that says where its training is built."""
    pytest.importorskip("transformers")
    fixture = Path(__file__).parents[1] / "fixtures" / "hf" / "gemma3-native-tiny"
    flags = ["--pretrained", str(fixture), "--model.config", "{}", "--ema-decay", "None"]
    assert main(recipe_args(token_dir, tmp_path / "run", *flags)) != 0
    error = capsys.readouterr().err
    assert "is a multimodal checkpoint (gemma3)" in error and "LMObjective" in error
    assert not (tmp_path / "run" / "checkpoints").exists()
