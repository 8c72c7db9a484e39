"""`dew runs` and `dew plot` read every run's metrics.jsonl: a line that is not UTF-8 is skipped with a
warning naming the file, and the other lines and runs are listed and drawn."""

from __future__ import annotations

import json

import pytest

from dew.cli import main as dew
from dew.training.trackers import METRICS, read_jsonl

DAMAGED = b'{"step": 2, "train/loss": 1.5, "note": "\xff\xfe"}'


def _record(step: int, split: str = "train") -> bytes:
    return json.dumps({"step": step, f"{split}/loss": 3.0 / step, f"{split}/perplexity": 20.0 / step}).encode()


def _run(directory, lines: list[bytes]):
    """A run directory as a recipe leaves it for these commands: run.json and metrics.jsonl."""
    directory.mkdir(parents=True)
    (directory / "run.json").write_text(json.dumps({"recipe": "lm", "model": {"num_layers": 1},
                                                    "tokens_per_step": 64, "settings": {"trainer": {"steps": 3}}}))
    (directory / METRICS).write_bytes(b"".join(line + b"\n" for line in lines))
    return directory


def test_a_line_that_is_not_utf8_is_skipped_naming_the_file_and_line(tmp_path):
    damaged = _run(tmp_path / "damaged", [_record(1), DAMAGED, b"[1, 2]", _record(3), b'{"step": 4, "tra'])
    # a kill stops a write before its newline: the cut line is the last, without one
    (damaged / METRICS).write_bytes((damaged / METRICS).read_bytes()[:-1])
    with pytest.warns(UserWarning) as said:
        records = read_jsonl(damaged / METRICS)
    assert [record["step"] for record in records] == [1, 3]  # the last line, cut short by a kill, is dropped quietly
    assert [str(warning.message) for warning in said] == [
        f"{damaged / METRICS}: skipped lines 2, 3, which are not UTF-8 JSON records: the file was edited or damaged; "
        "the other lines are read"]


def test_runs_and_plot_keep_working_over_a_damaged_metrics_file(tmp_path, capsys):
    clean = _run(tmp_path / "clean", [_record(1), _record(2), _record(2, "val"), _record(3)])
    damaged = _run(tmp_path / "damaged", [_record(1), DAMAGED, _record(3), _record(3, "val")])
    assert dew(["runs", str(tmp_path)]) == 0
    shown = capsys.readouterr()
    table = " ".join(shown.out.split())
    assert "clean │ new │ 3/3" in table and "damaged │ new │ 3/3" in table
    assert shown.err.splitlines() == [  # `dew` prints a warning as one line (dew.errors.one_line_warnings)
        f"warning: {damaged / METRICS}: skipped line 2, which is not a UTF-8 JSON record: the file was edited or "
        "damaged; the other lines are read"]
    out = tmp_path / "curves.png"
    assert dew(["plot", str(clean), str(damaged), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
