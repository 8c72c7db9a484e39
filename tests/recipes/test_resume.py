"""Stopping a recipe run any way (SIGTERM, kill -9) and rerunning the same command ends where an
uninterrupted run ends, bit for bit, with one record per step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dew.recipes.lm import main, parse, prepare, train
from dew.runs.run_dir import RunDirectory
from tests.recipes.conftest import recipe_args, terminate_at
from tests.training.test_trainer import _flat


@pytest.fixture(scope="module")
def straight(token_dir, tmp_path_factory):
    """The final state of the 6-step run, trained without a stop."""
    return train(parse(recipe_args(token_dir, tmp_path_factory.mktemp("runs") / "straight")), verbose=False)


def _assert_same_state(state, expected):
    for part in ("params", "ema", "opt_state"):
        np.testing.assert_array_equal(_flat(getattr(state, part)), _flat(getattr(expected, part)), err_msg=part)
    assert int(state.step) == int(expected.step) == 6


def _steps(run: RunDirectory, key: str = "train/loss") -> list[int]:
    return [entry["step"] for entry in run.metrics() if key in entry]


def test_sigterm_checkpoints_and_the_rerun_matches_an_uninterrupted_run(token_dir, tmp_path, straight, monkeypatch):
    run_dir = tmp_path / "stopped"
    argv = recipe_args(token_dir, run_dir)
    terminate_at(monkeypatch, 3)
    assert main(argv) == 128 + signal.SIGTERM
    monkeypatch.undo()
    run = RunDirectory(run_dir)
    assert run.status()["state"] == "interrupted" and run.checkpoint_steps() == [2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the trainer put the handler back
    _assert_same_state(prepare(parse(argv)).fit(verbose=False), straight)
    assert _steps(run) == [1, 2, 3, 4, 5, 6]


KILLED_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    from dew.recipes.lm import parse, prepare

    class KillAtStep5:  # kill -9 once step 5 is logged: the last checkpoint is step 4's
        def start(self, step): pass
        def scalars(self, step, values):
            if step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
        def texts(self, step, name, texts): pass
        def close(self): pass

    run = prepare(parse(json.loads(sys.argv[1])))
    run.trackers.append(KillAtStep5())
    run.fit(verbose=False)
    """
)


@pytest.mark.slow
def test_after_kill_9_the_same_command_resumes_from_the_last_checkpoint(token_dir, tmp_path, straight):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "killed"
    argv = recipe_args(token_dir, run_dir)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, json.dumps(argv)], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run = RunDirectory(run_dir)
    assert run.status()["state"] == "killed" and run.checkpoint_steps() == [2, 4]
    assert _steps(run) == [1, 2, 3, 4, 5]

    assert main(argv) == 0
    _assert_same_state(prepare(parse(argv)).fit(verbose=False), straight)
    assert _steps(run) == [1, 2, 3, 4, 5, 6]  # step 5 of the killed run was dropped, not repeated
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
