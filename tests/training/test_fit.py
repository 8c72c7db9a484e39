"""Trainer.fit's reporting: divergence named with its step and checkpoint, time accounted per part,
validation lines that say which weights they scored, progress during a pass, and bounded run-ahead."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
import pytest

from dew import Trainer
from dew.objectives.lm import LMObjective
from dew.training import progress
from dew.training.checkpoints import Checkpoints
from dew.training.in_flight import InFlight
from dew.training.trainer import TrainingDiverged
from tests.training.test_trainer import SEQ, _stream


def _poisoned():
    """SGD whose third update (step 3) is NaN."""
    return optax.sgd(lambda count: jnp.where(count >= 2, jnp.nan, 0.1))


def test_divergence_names_the_step_and_that_no_checkpoint_was_written(tiny_model, tmp_path):
    trainer = Trainer(LMObjective(tiny_model, SEQ, ema_decay=None), _poisoned(), key=jax.random.key(3))
    with pytest.raises(TrainingDiverged, match=r"step 3 is not finite.*no checkpoint was written \(fit had no") as no_dir:
        trainer.fit(_stream(4), steps=10, verbose=False)
    assert isinstance(no_dir.value, FloatingPointError)
    assert no_dir.value.step == 3 and no_dir.value.last_checkpoint is None and no_dir.value.directory is None
    assert "intact" not in str(no_dir.value)
    with pytest.raises(TrainingDiverged, match=r"no checkpoint was written to .*run") as none_yet:
        trainer.fit(_stream(4), steps=10, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=5, verbose=False)
    assert none_yet.value.last_checkpoint is None and none_yet.value.directory.endswith("run")


def test_divergence_names_the_last_complete_checkpoint(tiny_model, tmp_path):
    trainer = Trainer(LMObjective(tiny_model, SEQ, ema_decay=None), _poisoned(), key=jax.random.key(3))
    with pytest.raises(TrainingDiverged, match=r"the last complete checkpoint is step 2 in ") as diverged:
        trainer.fit(_stream(4), steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=1, verbose=False)
    assert diverged.value.last_checkpoint == 2 and diverged.value.step == 3
    assert diverged.value.loss == diverged.value.loss  # the step's loss is finite; its update is not


def test_checkpoint_and_evaluation_time_are_logged_apart_from_the_step(tiny_model, tmp_path, monkeypatch):
    trainer = Trainer(LMObjective(tiny_model, SEQ), optax.sgd(0.1), key=jax.random.key(0))
    trainer.fit(_stream(4), steps=4, log_every=2, eval_every=4, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                verbose=False)  # compiles; the timed call below resumes at step 4
    pause, save = 0.6, Checkpoints.save

    def slow_save(self, state, position):
        time.sleep(pause)
        save(self, state, position)

    monkeypatch.setattr(Checkpoints, "save", slow_save)
    started = time.perf_counter()
    trainer.fit(_stream(4), steps=8, log_every=2, eval_every=4, checkpoint_dir=str(tmp_path), checkpoint_every=4,
                verbose=False)
    wall = time.perf_counter() - started
    logged = [row for row in trainer.history if "step_s" in row and row["step"] > 4]
    assert [row["step"] for row in logged] == [6, 8]
    assert "checkpoint_s" not in logged[0] and logged[1]["checkpoint_s"] >= pause
    # Two tiny steps take milliseconds; a window holding the save's pause would show half of it a step.
    assert logged[1]["step_s"] < pause / 2
    evaluation = [row for row in trainer.history if "eval_s" in row and row["step"] > 4]
    assert len(evaluation) == 1 and evaluation[0]["eval_s"] > 0
    # The parts are disjoint spans of the call, so they add up to no more than its wall time.
    accounted = sum(2 * row["step_s"] + row.get("checkpoint_s", 0.0) for row in logged) + evaluation[0]["eval_s"]
    assert accounted <= wall


@pytest.mark.parametrize("decay, label", [(0.9, "val (EMA weights, decay 0.9)"),
                                          (1.0, "val (the frozen EMA reference, ema_decay 1.0)"),
                                          (None, "val")])
def test_validation_lines_say_which_weights_they_scored(tiny_model, capsys, monkeypatch, decay, label):
    monkeypatch.setattr(progress, "PASS_LINE_SECONDS", 0.0)  # a progress line for every batch scored
    trainer = Trainer(LMObjective(tiny_model, SEQ, ema_decay=decay), optax.sgd(0.1), key=jax.random.key(0))
    trainer.fit(_stream(4), steps=1, eval_every=1)
    printed = capsys.readouterr().out
    assert f"step 1 | {label} | val/loss" in printed
    assert "val: 1 batches scored" in printed and "val: 2 batches scored" in printed  # the pass has two batches
    assert {"val/loss", "val/ce", "val/perplexity", "eval_s"} <= set(trainer.history[-1])


def test_a_terminal_shows_a_bar_while_a_pass_runs(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    reporter = progress.Reporter(10, 0)
    try:
        reporter.pass_begin("val")
        reporter.pass_advance(3)
        (task,) = [task for task in reporter.progress.tasks if task.description == "val"]
        assert task.completed == 3 and task.total is None
        reporter.pass_end()
        assert [task.description for task in reporter.progress.tasks] == ["train"]
    finally:
        reporter.close()


def test_in_flight_reads_in_order_and_bounds_the_run_ahead():
    read = []
    in_flight = InFlight(2, lambda tag, value: read.append((tag, int(value))))
    double = jax.jit(lambda x: 2 * x)
    for tag in range(5):
        in_flight.push(tag, double(jnp.asarray(tag)))
        assert len(in_flight) <= 2
    in_flight.drain()
    assert read == [(tag, 2 * tag) for tag in range(5)] and len(in_flight) == 0
