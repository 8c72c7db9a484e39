"""Fixtures for the recipe tests: byte-level token files and the flags of a tiny run over them."""

from __future__ import annotations

import json
import os
import signal

import pytest

from dew.data.tokenize import tokenize_text
from dew.training.trackers import JsonLines

TINY_MODEL = {"emb_features": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "mlp_features": 64,
              "max_seq_len": 64}


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory) -> str:
    """Byte-level token files: 16 kB of text, a tenth of it held out for validation."""
    root = tmp_path_factory.mktemp("recipe-data")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(300)))
    tokenize_text(str(corpus), str(root / "tokens"), "byte", val_fraction=0.1, workers=1)
    return str(root / "tokens")


def recipe_args(token_dir: str, run_dir, *extra: str, steps: int = 6) -> list[str]:
    """The command line of a tiny run: 16-token windows, batches of 4, no previews unless `extra` asks."""
    return ["data:token-windows", "--data.path", token_dir, "--data.seq-len", "16",
            "--model.config", json.dumps(TINY_MODEL), "--trainer.run-dir", str(run_dir),
            "--trainer.steps", str(steps), "--trainer.batch", "4", "--trainer.log-every", "1",
            "--trainer.eval-every", "None", "--trainer.checkpoint-every", "2", "--sample-tokens", "0", *extra]


def terminate_at(monkeypatch, stop_step: int) -> None:
    """Send this process SIGTERM once step `stop_step` is logged (as JsonLines writes it), as a user
    stopping the run then would; `monkeypatch.undo()` ends it."""
    write = JsonLines.scalars

    def scalars(self, step, values):
        write(self, step, values)
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(JsonLines, "scalars", scalars)
