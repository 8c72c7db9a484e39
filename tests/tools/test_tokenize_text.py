import importlib.util
import pathlib

import numpy as np

from dew.data.token_files import open_split, read_meta

TOOL = pathlib.Path(__file__).parents[2] / "tools" / "tokenize_text.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("tokenize_text_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guides_byte_example(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A small corpus for a tokenizer demonstration.\n")
    out = tmp_path / "corpus-byte"
    load_tool().main(["--input", str(corpus), "--out", str(out), "--tokenizer", "byte",
                      "--val-fraction", "0.1", "--workers", "1"])
    assert read_meta(out) == {"tokenizer": "byte", "vocab_size": 256, "dtype": "uint8",
                              "train_tokens": 42, "val_tokens": 4, "eos_id": None}
    ids = np.concatenate([open_split(out, "val"), open_split(out, "train")])
    assert bytes(ids) == corpus.read_bytes()
    summary = capsys.readouterr().out
    assert summary.count("\n") == 1
    assert "46 tokens (4 val, uint8, byte)" in summary and "tokens/s" in summary
