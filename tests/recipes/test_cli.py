"""The `dew` command's dispatch, and `dew tokenize`."""

from __future__ import annotations

import json

from dew.cli import main as dew


def test_usage_lists_the_commands_and_an_unknown_one_is_refused(capsys):
    assert dew(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(name in usage for name in ("train", "tokenize", "plot", "runs"))
    assert dew(["fly"]) == 2
    assert "dew has no command 'fly'" in capsys.readouterr().err


def test_tokenize_writes_token_files_and_a_run_without_validation_must_say_so(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words of text\n" * 50)
    assert dew(["tokenize", "--input", str(corpus), "--out", str(tmp_path / "tokens"), "--tokenizer", "byte",
                "--val-fraction", "0", "--workers", "1"]) == 0
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["train_tokens"] == 1000 and meta["val_tokens"] == 0
    capsys.readouterr()
    assert dew(["train", "--data.path", str(tmp_path / "tokens"), "--data.seq-len", "16", "--trainer.batch", "4",
                "--trainer.run-dir", str(tmp_path / "run")]) == 2
    assert "--trainer.eval-every 500 asks for validation" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_tokenize_replaces_token_files_only_with_force_and_says_what_it_replaced(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words of text\n" * 50)
    command = ["tokenize", "--input", str(corpus), "--out", str(tmp_path / "tokens"), "--tokenizer", "byte",
               "--workers", "1"]
    assert dew([*command, "--val-fraction", "0"]) == 0
    capsys.readouterr()
    assert dew([*command, "--val-fraction", "0.1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {tmp_path / 'tokens'} already holds token files of 1,000 train and 0 val tokens")
    assert json.loads((tmp_path / "tokens" / "meta.json").read_text())["val_tokens"] == 0  # untouched
    assert dew([*command, "--val-fraction", "0.1", "--force"]) == 0
    assert "; they replace the token files of 1,000 train and 0 val tokens, tokenizer 'byte' it held" in (
        capsys.readouterr().out)
    assert json.loads((tmp_path / "tokens" / "meta.json").read_text())["val_tokens"] == 100
