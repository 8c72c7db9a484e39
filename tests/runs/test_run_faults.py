"""Run directories that do not hold what generation needs (a tokenizer of another vocabulary, no run.json), a
refusal that prints no text before it, and `dew plot` over a damaged metrics.jsonl: each said by name."""

from __future__ import annotations

import json
import shutil

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from dew.cli import main as dew
from dew.runs import RunDirectory
from dew.training.trackers import METRICS


def _three_words(directory) -> None:
    """A word-level tokenizer.json of 3 tokens in `directory`."""
    tokenizer = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_both_sizes(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    _three_words(run)
    says = (f"{run / 'tokenizer.json'} holds 3 tokens, and the run trained on ids of a 256-token vocabulary "
            f"(run.json's data); the model's head scores 256 ids: it is not the tokenizer {run} was trained with")
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        RunDirectory(run).tokenizer()
    assert dew(["generate", str(run), "--prompt", "a b", "--max-new-tokens", "4"]) == 2
    shown = capsys.readouterr()
    assert shown.out == "" and shown.err.startswith(f"error: {says}")


def test_a_run_directory_without_run_json_is_named_as_one(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "run.json").unlink()
    assert dew(["generate", str(run), "--prompt", "line"]) == 2
    shown = capsys.readouterr()
    assert shown.out == "" and shown.err.startswith(
        f"error: {run} holds no run.json, though it holds a run's checkpoints, status.json, metrics.jsonl, run.lock: "
        "run.json records the model its checkpoints are read into; restore it from a backup")


def test_a_refused_generation_prints_no_text_before_the_error(trained, capsys):
    assert dew(["generate", str(trained), "--prompt", "the", "--max-new-tokens", "1000"]) == 2
    shown = capsys.readouterr()
    assert shown.out == "" and shown.err.startswith("error: the longest prompt (3 tokens) plus max_new_tokens 1000")
    assert dew(["generate", str(trained), "--prompt", "the", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the")  # the prompt, then what was generated


def test_plot_says_how_many_lines_it_skipped_and_from_which_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"recipe": "lm", "model": {"num_layers": 1}, "tokens_per_step": 64,
                                              "settings": {"trainer": {"steps": 3}}}))
    records = [json.dumps({"step": step, "train/loss": 3.0 / step, "train/perplexity": 20.0 / step})
               for step in (1, 2, 3)]
    lines = [records[0], "garbage, not JSON", records[1][:20], records[1], records[2], records[2][:15]]
    (run / METRICS).write_text("\n".join(lines))  # the last line cut short, with no newline after it
    assert dew(["plot", str(run), "--out", str(tmp_path / "curves.png")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {run / METRICS}: skipped lines 2, 3, which are not UTF-8 JSON records: the file was edited or "
        "damaged; the other lines are read",
        f"warning: {run / METRICS}: skipped its last line, 6, cut short: the process writing it stopped mid-line (or "
        "is writing it now); the other lines are read"]
    assert [entry["step"] for entry in RunDirectory(run).metrics()] == [1, 2, 3]
