"""The house's floors (pyproject.toml's [tool.importlinter] contract): each room of dew/ imports only rooms
below it, function-level imports included, so no cycle can hide inside a function."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(checkout: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=checkout, env=environment, capture_output=True, text=True,
                          timeout=120)


def test_every_import_goes_down_a_floor():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "dew", tmp_path / "dew", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "dew" / "nn" / "norms.py", "a") as source:
        source.write("\n\ndef _reaches_up():\n    from dew.recipes import lm  # noqa: F401\n")
    done = _lint(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "dew.nn is not allowed to import dew.recipes" in done.stdout
    assert "dew.nn.norms -> dew.recipes.lm" in done.stdout
