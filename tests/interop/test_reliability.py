"""Faults around published checkpoints: killed saves, mistyped paths, an unreachable Hub, cut GGUF files."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap

import pytest

from dew.interop import load_pretrained
from tests.interop.test_save import _KILLED_SAVE


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid-shards", "before-index"])
def test_next_save_removes_what_a_killed_save_left(point, llama_checkpoint, tmp_path):
    bundle = load_pretrained(llama_checkpoint[0])
    out = bundle.save(tmp_path / "export", max_shard_size="20KB")
    unrelated = {"model.fp16.safetensors": b"the user's own copy", "notes.txt": b"mine",
                 ".model.safetensors.notes.tmp": b"not a Dew staging name", ".config.json.tmp": b"nor this"}
    for name, content in unrelated.items():
        (out / name).write_bytes(content)
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(llama_checkpoint[0]), str(out),
                             point], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    exported = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    orphans = {path.name for path in out.iterdir()} - exported - set(unrelated) - {
        "model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json"}
    assert orphans  # the killed save's shards

    held = os.open(out, os.O_RDONLY)  # the lock a save running in another process holds: its files stay
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        bundle.save(out)
    finally:
        os.close(held)
    assert orphans <= {path.name for path in out.iterdir()}

    bundle.save(out)
    assert {path.name for path in out.iterdir()} == {
        "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        *unrelated}
    assert all((out / name).read_bytes() == content for name, content in unrelated.items())


def test_killed_staging_copies_are_removed(llama_checkpoint, tmp_path):
    """A save killed while writing model.safetensors or a config leaves hidden staging copies."""
    bundle = load_pretrained(llama_checkpoint[0])
    out = bundle.save(tmp_path / "export")
    staged = [".model.safetensors.0123abcd.tmp", ".config.json.89abcdef.tmp",
              ".model-0123abcd-00002-of-00003.safetensors.0123abcd.tmp", "model-0123abcd-00001-of-00003.safetensors"]
    for name in staged:
        (out / name).write_bytes(b"\0" * 1000)
    bundle.save(out)
    assert not any((out / name).exists() for name in staged)
    assert os.listdir(out) and load_pretrained(out).config == {**bundle.config, "dtype": "float32"}
