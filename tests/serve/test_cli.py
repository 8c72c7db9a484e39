"""`dew serve` refusals: one error line and its exit status before anything loads."""

from __future__ import annotations

import importlib.util

from dew.cli import main


def test_a_missing_source_is_refused_in_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "no-such-run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-run" in err and err.count("\n") == 1


def test_without_the_serve_extra_the_error_names_it(monkeypatch, capsys):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else found(name, *a))
    assert main(["serve", "anything"]) == 1
    assert capsys.readouterr().err == "error: dew serve needs uvicorn: pip install 'dew-ml[serve]'\n"
