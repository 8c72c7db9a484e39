"""The quick start's preparation tools (tools/kjv_verses.py, tools/train_tokenizer.py) and the example
itself at test sizes, on a slice of the shipped corpus."""

from __future__ import annotations

import importlib.util
import lzma
import runpy
import sys
from pathlib import Path

import pytest

from dew.data import HFTokenizer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "kjv.txt.xz"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def verses_file(tmp_path_factory) -> Path:
    """The first ~2,000 verses of the corpus, references stripped by the tool, as the Makefile runs it."""
    root = tmp_path_factory.mktemp("quickstart")
    with lzma.open(CORPUS, "rt", encoding="utf-8") as stream:
        head = stream.read(250_000)
    source = root / "kjv-head.txt.xz"
    with lzma.open(source, "wt", encoding="utf-8") as stream:
        stream.write(head[: head.rindex("\n") + 1])
    out = root / "verses.txt"
    load_tool("kjv_verses").main(["--input", str(source), "--out", str(out)])
    return out


def test_verses_lose_their_references_and_nothing_else(verses_file):
    lines = verses_file.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "In the beginning God created the heaven and the earth."
    assert lines[2] == "And God said, Let there be light: and there was light."
    with lzma.open(CORPUS, "rt", encoding="utf-8") as stream:
        originals = [stream.readline().rstrip("\n") for _ in range(len(lines))]
    assert [original.split(" ", 1)[1] for original in originals] == lines
    assert not list(verses_file.parent.glob("*.partial"))


def test_a_line_without_a_reference_is_refused():
    with pytest.raises(ValueError, match=r"line 2 does not start with a verse reference.*'a stray line'"):
        load_tool("kjv_verses").verses("Ge1:1 In the beginning.\na stray line\n")


def test_the_tokenizer_is_the_same_file_each_time_and_encodes_every_byte(verses_file, tmp_path):
    tool = load_tool("train_tokenizer")
    for name in ("first", "second"):
        tool.main(["--input", str(verses_file), "--vocab-size", "600", "--out", str(tmp_path / name)])
    first, second = (tmp_path / name / "tokenizer.json" for name in ("first", "second"))
    assert first.read_bytes() == second.read_bytes()

    tokenizer = HFTokenizer(tmp_path / "first")
    assert tokenizer.vocab_size == 600
    assert tokenizer.eos_id == 0 and tokenizer.decode([0]) == "<|endoftext|>"
    text = "And God said, Let there be light.\nnaïve 東京 🙂 \x00\t{}"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # Common words of the corpus became single tokens, each led by its space.
    assert [tokenizer.decode([i]) for i in tokenizer.encode("And God said")] == ["And", " God", " said"]


def test_a_vocabulary_without_merges_is_refused(verses_file, tmp_path):
    with pytest.raises(ValueError, match="vocab_size is 257: a byte-level BPE needs more than 257 ids"):
        load_tool("train_tokenizer").main(["--input", str(verses_file), "--vocab-size", "257",
                                           "--out", str(tmp_path)])


@pytest.mark.slow
def test_the_example_trains_and_prints_both_continuations(verses_file, tmp_path, monkeypatch, capsys):
    load_tool("train_tokenizer").main(["--input", str(verses_file), "--vocab-size", "600",
                                       "--out", str(tmp_path / "bpe")])
    from dew.data.tokenize import tokenize_text

    tokenize_text(verses_file, tmp_path / "kjv", str(tmp_path / "bpe"), val_fraction=0.05, workers=1)
    monkeypatch.setattr(sys, "argv", [
        "quickstart.py", "--data", str(tmp_path / "kjv"), "--tokenizer", str(tmp_path / "bpe"),
        "--steps", "20", "--warmup", "4", "--batch", "4", "--seq-len", "32", "--width", "64",
        "--layers", "1", "--new-tokens", "8"])
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "trained 20 steps" in printed
    assert "validation perplexity " in printed
    for label in ("greedy", "sampled"):
        heading = next(line for line in printed.splitlines() if line.startswith(label))
        continuation = printed.split(heading + "\n", 1)[1]
        assert continuation.startswith("And God said")
