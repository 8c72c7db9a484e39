"""Trackers: metrics.jsonl and TensorBoard files read back (TensorBoard's own reader), a resumed
run's records replacing a stopped one's, W&B offline, and what `Trainer.fit` hands them."""

from __future__ import annotations

import jax
import optax
import pytest

from dew import Trainer
from dew.objectives.lm import LMObjective
from dew.training.trackers import METRICS, SAMPLES, JsonLines, TensorBoard, WandB, read_jsonl
from tests.training.test_trainer import SEQ, _stream


def _log(tracker, steps, value: float) -> None:
    for step in steps:
        tracker.scalars(step, {"train/loss": value, "train/perplexity": 2 * value})
        tracker.texts(step, "samples", [f"text {step}"])


def test_json_lines_restart_drops_what_followed_the_checkpoint(tmp_path):
    first = JsonLines(tmp_path)
    first.start(0)
    _log(first, range(1, 6), 1.0)
    first.close()
    with open(tmp_path / METRICS, "a") as file:
        file.write('{"step": 6, "train/lo')  # a line cut short by kill -9
    assert [record["step"] for record in read_jsonl(tmp_path / METRICS)] == [1, 2, 3, 4, 5]
    resumed = JsonLines(tmp_path)
    resumed.start(3)
    _log(resumed, range(4, 6), 0.5)
    resumed.close()
    records = read_jsonl(tmp_path / METRICS)
    assert [(r["step"], r["train/loss"]) for r in records] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5), (5, 0.5)]
    assert [r["text"] for r in read_jsonl(tmp_path / SAMPLES)] == [f"text {step}" for step in range(1, 6)]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_whole_last_line_that_does_not_read_is_damage_not_a_cut(tmp_path):
    """A last line that ends in its newline was written whole: garbage there is the file's damage, said as such
    (the warning for a line cut short is for one without its newline)."""
    (tmp_path / METRICS).write_text('{"step": 1}\nnot json at all\n')
    with pytest.warns(UserWarning, match=r"skipped line 2, which is not a UTF-8 JSON record: the file was edited"):
        assert read_jsonl(tmp_path / METRICS, warn_cut_short=True) == [{"step": 1}]


def test_tensorboard_events_parse_and_a_restart_purges_the_stopped_runs_tail(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoard(tmp_path)
    first.start(0)
    _log(first, range(1, 6), 1.0)
    first.close()
    resumed = TensorBoard(tmp_path)
    resumed.start(3)
    _log(resumed, range(4, 6), 0.5)
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"train/loss", "train/perplexity"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5), (5, 0.5)]
    texts = events.Tensors("samples/0/text_summary")
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in texts][-1] == (5, "text 5")


def test_wandb_logs_offline_under_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandB(tmp_path, "dew-tests", run_id="dew-test-run", config={"steps": 5})
    tracker.start(0)
    _log(tracker, range(1, 3), 1.0)
    tracker.close()
    assert list((tmp_path / "wandb").glob("offline-run-*-dew-test-run/run-dew-test-run.wandb"))


def test_a_missing_wandb_is_refused_by_name(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_wandb)
    with pytest.raises(ImportError, match="--trainer.wandb my-project needs the wandb package: pip install wandb"):
        WandB(tmp_path, "my-project", run_id="x")


class Recorder:
    """A tracker that keeps every call."""

    def __init__(self):
        self.calls = []

    def start(self, step):
        self.calls.append(("start", step))

    def scalars(self, step, values):
        self.calls.append(("val" if "val/loss" in values else "train", step))

    def texts(self, step, name, texts):
        self.calls.append((name, step))

    def close(self):
        self.calls.append(("close",))


def test_fit_hands_trackers_each_log_evaluation_and_preview(tiny_model, tmp_path):
    from dew.objectives.lm import Samples

    objective = LMObjective(tiny_model, SEQ, samples=Samples(prompt=[1, 2], max_new_tokens=2))
    recorder, trainer = Recorder(), Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
    trainer.fit(_stream(4), steps=4, log_every=2, eval_every=3, checkpoint_dir=str(tmp_path), verbose=False,
                trackers=[recorder])
    assert recorder.calls == [("start", 0), ("train", 2), ("val", 3), ("samples", 3), ("train", 4), ("val", 4),
                              ("samples", 4)]
    resumed = Recorder()
    trainer.fit(_stream(4), steps=6, log_every=2, checkpoint_dir=str(tmp_path), verbose=False, trackers=[resumed])
    assert resumed.calls == [("start", 4), ("train", 6)]  # the caller closes its trackers
