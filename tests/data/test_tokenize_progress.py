"""`tokenize_text` shows its progress on a terminal and stays quiet in a pipe or a log."""

import io
import sys

import pytest

from dew.data.tokenize import tokenize_text


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("a line of text\n" * 1000, encoding="utf-8")  # 15,000 bytes
    return path


def test_progress_on_a_terminal(text, tmp_path, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    tokenize_text(text, tmp_path / "out", "byte", 0.0, 1, chunk_bytes=1000)
    shown = terminal.getvalue()
    assert "tokenizing" in shown and "15.0/15.0 kB" in shown and "15,000 tokens" in shown


def test_quiet_when_stderr_is_not_a_terminal(text, tmp_path, capsys):
    tokenize_text(text, tmp_path / "out", "byte", 0.0, 1)
    assert capsys.readouterr().err == ""
    tokenize_text(text, tmp_path / "shown", "byte", 0.0, 1, progress=True)  # asked for: shown anyway
    assert "15,000 tokens" in capsys.readouterr().err
