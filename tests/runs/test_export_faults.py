"""`dew export` of a run: the format an OUT ending in .gguf means, an OUT that is a file, the merges key a byte-level
GGUF vocabulary needs (written without gguf's warning), and Ctrl-C that leaves either a whole, reported export
(exit 0) or none (exit 130)."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from dew.cli import main as dew
from dew.interop import gguf_out

gguf = pytest.importorskip("gguf")


def test_an_out_ending_in_gguf_is_written_as_gguf_and_an_existing_one_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "a.gguf"
    out.write_text("an earlier file")
    assert dew(["export", str(trained), str(out)]) == 2
    assert capsys.readouterr().err == f"error: OUT {out} exists: pass --force to replace it (atomically), or choose " \
                                      "another file\n"
    assert dew(["export", str(trained), str(out), "--format", "safetensors"]) == 2
    assert capsys.readouterr().err.startswith(f"error: OUT {out} ends in .gguf, and --format safetensors writes a "
                                              "directory (a transformers checkpoint): drop --format")
    assert out.read_text() == "an earlier file"
    assert dew(["export", str(trained), str(out), "--force"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (f16): `llama-cli -m {out}`")
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"
    plain = tmp_path / "plain"
    plain.write_text("a file")
    assert dew(["export", str(trained), str(plain)]) == 2
    assert capsys.readouterr().err.startswith(f"error: OUT {plain} is a file, and a transformers checkpoint is a "
                                              "directory: name a new or empty directory, or pass --format gguf")


def test_a_byte_level_vocabulary_gets_its_empty_merges_and_no_warning(trained, tmp_path, caplog, capsys):
    out = tmp_path / "bytes.gguf"
    with caplog.at_level(logging.WARNING):
        assert dew(["export", str(trained), str(out)]) == 0
    assert [record.getMessage() for record in caplog.records] == []
    assert "merges" not in capsys.readouterr().err
    fields = gguf.GGUFReader(out).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and len(fields["tokenizer.ggml.tokens"].data) == 256
    merges = fields["tokenizer.ggml.merges"]  # llama.cpp refuses a "gpt2" vocabulary without the key
    assert merges.types == [gguf.GGUFValueType.ARRAY] and merges.data == []
    assert dew(["generate", str(out), "--prompt", "line", "--max-new-tokens", "3", "--top-k", "1"]) == 0
    assert capsys.readouterr().out.startswith("line")


def _interrupt_after(monkeypatch, module, name: str, when=lambda *args: True) -> None:
    """Send this process SIGINT as soon as `module.name` returns (when `when(*its arguments)`)."""
    original = getattr(module, name)

    def interrupted(*args, **kwargs):
        value = original(*args, **kwargs)
        if when(*args):
            os.kill(os.getpid(), signal.SIGINT)
        return value

    monkeypatch.setattr(module, name, interrupted)


def test_ctrl_c_once_the_file_is_in_place_reports_it_and_exits_0(trained, tmp_path, monkeypatch, capsys):
    out = tmp_path / "late.gguf"
    _interrupt_after(monkeypatch, gguf_out.os, "replace", lambda source, target: os.fspath(target) == os.fspath(out))
    assert dew(["export", str(trained), str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} (f16)")
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command's handler is gone


def test_ctrl_c_before_the_file_is_in_place_leaves_nothing_and_exits_130(trained, tmp_path, monkeypatch, capsys):
    out = tmp_path / "early.gguf"
    _interrupt_after(monkeypatch, gguf_out, "_check_read_back")
    assert dew(["export", str(trained), str(out)]) == 130
    assert capsys.readouterr().err == "error: interrupted (SIGINT)\n"
    assert list(tmp_path.iterdir()) == []
