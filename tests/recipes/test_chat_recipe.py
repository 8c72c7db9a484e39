"""The LM recipe on chat conversations: data:chat with --loss-role trains and records both; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dew.recipes.lm import main
from dew.runs.run_dir import RunDirectory
from tests.data.test_chat import SMOL, TALK, _tokenizer_dir, _write
from tests.recipes.conftest import TINY_MODEL, recipe_args


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    """(a tokenizer directory with a SmolLM2-shaped template, a JSONL file of conversations)."""
    root = tmp_path_factory.mktemp("chat-recipe")
    conversations = [TALK[:2], TALK, TALK[2:], TALK[:2]]
    return str(_tokenizer_dir(root / "tokenizer", SMOL)), _write(root / "talk.jsonl", conversations)


def _chat_args(chat_files, run_dir, *extra):
    tokenizer, talk = chat_files
    return ["data:chat", "--data.path", talk, "--data.seq-len", "127", "--tokenizer", tokenizer,
            "--model.config", json.dumps({**TINY_MODEL, "max_seq_len": 128}), "--trainer.run-dir", str(run_dir),
            "--trainer.steps", "2",
            "--trainer.batch", "2", "--trainer.log-every", "1", "--trainer.eval-every", "None",
            "--trainer.checkpoint-every", "2", "--sample-tokens", "0", *extra]


@pytest.mark.slow
def test_a_chat_run_trains_on_the_assistants_targets(chat_files, tmp_path):
    assert main(_chat_args(chat_files, tmp_path / "run", "--loss-role", "assistant")) == 0
    run = RunDirectory(tmp_path / "run")
    record = run.record()
    assert record["settings"]["loss_role"] == "assistant" and record["settings"]["data"]["type"] == "ChatData"
    assert record["data"]["assistant_tokens"] > 0 and record["data"]["template"].endswith("chat_template.jinja")
    assert run.status()["state"] == "finished"
    # The run keeps the template beside its tokenizer, so serving and exporting it need nothing outside it.
    template = Path(chat_files[0]) / "chat_template.jinja"
    assert (tmp_path / "run" / "chat_template.jinja").read_text() == template.read_text()
    assert [m["step"] for m in run.metrics() if "train/ce" in m] == [1, 2]


@pytest.mark.parametrize("extra, message", [
    (["--trainer.eval-every", "5"], "--trainer.eval-every 5 asks for validation, and data:chat has no --data.val-path"),
    (["--objective", "masked_diffusion"], "--objective masked_diffusion reads token rows whole"),
])
def test_chat_runs_refuse_what_they_cannot_do(chat_files, tmp_path, capsys, extra, message):
    assert _exit_code(lambda: main(_chat_args(chat_files, tmp_path / "run", *extra))) == 2
    assert message in " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert not (tmp_path / "run").exists()


def test_a_loss_role_needs_chat_rows(token_dir, tmp_path, capsys):
    assert _exit_code(lambda: main(recipe_args(token_dir, tmp_path / "run", "--loss-role", "assistant"))) == 2
    assert ("--loss-role assistant keeps the targets of one role, and data:token-windows rows carry no roles: train on "
            "data:chat") in " ".join(capsys.readouterr().err.replace("│", " ").split())


def _exit_code(run) -> int:
    try:
        return run()
    except SystemExit as exit:  # tyro reports a config's ValueError itself, in a box
        return exit.code


def test_run_json_records_the_chat_files_as_absolute_paths(chat_files, tmp_path, monkeypatch, tiny_model):
    """data:chat's path, template and val_path name files: run.json holds them absolute, so a rerun from
    another directory compares the same files."""
    from dew.data.chat_data import ChatData
    from dew.objectives.lm import LMObjective, LMRunConfig
    from dew.recipes.lm import _record

    tokenizer, talk = chat_files
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    (tmp_path / "talk.jsonl").write_text(open(talk).read())
    monkeypatch.chdir(tmp_path)
    config = LMRunConfig(data=ChatData(path="talk.jsonl", template="template.jinja", val_path="talk.jsonl"),
                         tokenizer=tokenizer)
    record = _record(config, LMObjective(tiny_model, 8), {"tokenizer": tokenizer}, None)
    data = record["settings"]["data"]
    assert (data["path"], data["template"], data["val_path"]) == (str(tmp_path / "talk.jsonl"),
                                                                  str(tmp_path / "template.jinja"),
                                                                  str(tmp_path / "talk.jsonl"))
    unset = _record(LMRunConfig(data=ChatData(path="talk.jsonl"), tokenizer=tokenizer), LMObjective(tiny_model, 8),
                    {"tokenizer": tokenizer}, None)["settings"]["data"]
    assert unset["template"] is None and unset["val_path"] is None
