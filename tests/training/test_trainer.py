"""Trainer: accumulation, EMA, exact resume, non-finite steps, and the 8-device mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data.dataset import Dataset
from dew.objectives.lm import LMObjective
from tests.compile_flags import devices_environment
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

SEQ = 16


def _rows(seed: int, count: int, pad_tail: bool = False) -> np.ndarray:
    rows = np.random.default_rng(seed).integers(1, 64, (count, SEQ + 1)).astype(np.int32)
    if pad_tail:  # rows with different numbers of padded targets (pad id 0)
        for i in range(count):
            rows[i, SEQ + 1 - 2 * i:] = 0
    return rows


def _stream(batch: int, pad_tail: bool = False) -> Dataset:
    """A deterministic plain-iterator dataset (no get_state: resume replays it)."""

    def train(partition):
        step = 0
        while True:
            yield {"text": _rows(step, batch, pad_tail)}
            step += 1

    def val(partition):
        for i in range(2):
            yield {"text": _rows(1000 + i, batch)}

    return Dataset(train=train, val=val, records=10**6, batch=batch)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))])


def test_accumulated_micro_batches_equal_one_batch(tiny_model):
    objective = LMObjective(tiny_model, SEQ, pad_id=0, ema_decay=None)
    data = _stream(8, pad_tail=True)  # the micro-batches count different numbers of targets
    one = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0)).fit(data, steps=2, verbose=False)
    four = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0)).fit(data, steps=2, accumulation=4, verbose=False)
    # Not bit-identical: four 32-token gradient sums and their scan against one 128-token sum. The worst
    # case, 80 ulps of lr x the per-token gradients' summed sizes a step, reaches 1.5e-6 at the largest
    # entries, above this 1e-6; kept, not loosened, until accumulation is made exact. Observed: 1.9e-8.
    np.testing.assert_allclose(_flat(four.params), _flat(one.params), atol=1e-6, rtol=0)
    assert int(four.updates) == int(one.updates) == 2


def test_ema_follows_the_updates_by_hand(tiny_model, tmp_path):
    decay = 0.75
    objective = LMObjective(tiny_model, SEQ, ema_decay=decay)
    trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(1))
    start = _flat(trainer.init_state().params)
    data = _stream(4)
    first = trainer.fit(data, steps=1, checkpoint_dir=str(tmp_path), verbose=False)
    p1, ema1 = _flat(first.params), _flat(first.ema)
    second = Trainer(objective, optax.sgd(0.5), key=jax.random.key(1)).fit(
        data, steps=2, checkpoint_dir=str(tmp_path), verbose=False)
    p2, ema2 = _flat(second.params), _flat(second.ema)
    # The same float32 formula on both sides, 3 roundings each (2 with a fused multiply-add) of terms of
    # size decay |ema| + (1 - decay) |p|: 3 ulps of that, per entry. Observed: 1 ulp (1.2e-7).
    for ema, (previous, params) in ((ema1, (start, p1)), (ema2, (ema1, p2))):
        assert_within(ema, decay * previous + (1 - decay) * params,
                      ulp_bound(3, decay * np.abs(previous) + (1 - decay) * np.abs(params)), "ema")
    assert not np.allclose(p2, ema2)


def test_without_ema_the_state_refuses_averaged(tiny_model):
    objective = LMObjective(tiny_model, SEQ, ema_decay=None)
    state = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).init_state()
    assert state.ema is None
    with pytest.raises(AttributeError, match="ema_decay=None"):
        state.averaged


def test_a_trainer_whose_key_changes_inits_from_the_new_key(tiny_model):
    """The state's shapes and its first values come from one trace of the init, made again when the key
    changes: the state then equals a fresh trainer's with that key, bit for bit."""
    first = lambda state: np.asarray(jax.tree_util.tree_leaves(state.params)[0])  # noqa: E731
    trainer = Trainer(LMObjective(tiny_model, 8), optax.adamw(1e-3), key=jax.random.key(0))
    before = trainer.init_state()
    trainer.key = jax.random.key_data(jax.random.key(1))
    after = trainer.init_state()
    fresh = Trainer(LMObjective(tiny_model, 8), optax.adamw(1e-3), key=jax.random.key(1)).init_state()
    assert not np.array_equal(first(before), first(after))
    jax.tree_util.tree_map(np.testing.assert_array_equal, after, fresh)


def test_resume_is_bit_identical(tiny_model, tmp_path):
    objective = LMObjective(tiny_model, SEQ)
    data = _stream(4)
    straight = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(2)).fit(data, steps=6, verbose=False)
    Trainer(objective, optax.adamw(1e-2), key=jax.random.key(2)).fit(
        data, steps=3, checkpoint_dir=str(tmp_path), verbose=False)
    resumed = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(2)).fit(
        data, steps=6, checkpoint_dir=str(tmp_path), verbose=False)
    np.testing.assert_array_equal(_flat(resumed.params), _flat(straight.params))
    np.testing.assert_array_equal(_flat(resumed.ema), _flat(straight.ema))
    np.testing.assert_array_equal(_flat(resumed.opt_state), _flat(straight.opt_state))
    assert int(resumed.step) == 6


def test_a_non_finite_step_stops_the_run_and_keeps_the_last_checkpoint(tiny_model, tmp_path):
    objective = LMObjective(tiny_model, SEQ, ema_decay=None)
    poisoned = optax.sgd(lambda count: jnp.where(count >= 2, jnp.nan, 0.1))
    trainer = Trainer(objective, poisoned, key=jax.random.key(3))
    with pytest.raises(FloatingPointError, match="step 3 is not finite"):
        trainer.fit(_stream(4), steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=1, verbose=False)
    from dew.training import Checkpoints

    checkpoints = Checkpoints(tmp_path)
    assert checkpoints.latest() == 2
    state, _ = checkpoints.restore(trainer.init_state())
    assert np.isfinite(_flat(state.params)).all()
    checkpoints.close()


def test_ctrl_c_while_a_checkpoint_is_read_is_an_interrupt_not_damage(tiny_model, tmp_path, monkeypatch):
    """The storage layer reads in threads and wraps a Ctrl-C in its own error: the restore stops as interrupted and
    sets no checkpoint aside as damaged."""
    from dew.training import Checkpoints

    trainer = Trainer(LMObjective(tiny_model, SEQ, ema_decay=None), optax.sgd(0.1), key=jax.random.key(3))
    trainer.fit(_stream(4), steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1, verbose=False)
    checkpoints = Checkpoints(tmp_path)

    def interrupted(like, step):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as error:
            raise RuntimeError("a reader thread stopped") from error

    monkeypatch.setattr(checkpoints, "_restore", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.restore(trainer.init_state())
    assert checkpoints.latest() == 2 and not [name for name in os.listdir(tmp_path) if "unreadable" in name]
    checkpoints.close()


def test_evaluation_reads_the_whole_validation_pass(tiny_model):
    from dew import metrics

    objective = LMObjective(tiny_model, SEQ)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(4))
    trainer.fit(_stream(4), steps=2, eval_every=2, metrics=(metrics.perplexity(),), verbose=False)
    evaluation = [row for row in trainer.history if "val/perplexity" in row]
    assert len(evaluation) == 1 and evaluation[0]["step"] == 2
    # Both exponentiate the same float64 mean (math.exp and numpy's exp): LIBRARY_ULPS of the result.
    np.testing.assert_allclose(evaluation[0]["val/perplexity"], np.exp(evaluation[0]["val/ce"]),
                               rtol=ulp_bound(LIBRARY_ULPS, dtype=np.float64), atol=0)
    logged = [row for row in trainer.history if "train/loss" in row]
    assert logged and {"train/ce", "train/perplexity", "train/token_accuracy", "tokens_per_s"} <= set(logged[0])


def test_batch_that_does_not_split_is_refused(tiny_model):
    trainer = Trainer(LMObjective(tiny_model, SEQ), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(ValueError, match="batch 6 does not split into 4 micro-batches"):
        trainer.fit(_stream(6), steps=1, accumulation=4, verbose=False)


MESH_SCRIPT = textwrap.dedent(
    """
    import jax, optax
    from dew import models, Trainer
    from dew.training import Layout, MeshSpec
    from dew.objectives.lm import LMObjective
    from tests import mesh_parity
    from tests.training.test_trainer import SEQ, _stream
    assert jax.device_count() == 8
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=64)
    objective = LMObjective(model, SEQ)
    RATE, ROWS = 0.1, 8
    runs = {"one": (jax.devices()[:1], MeshSpec(), Layout()),
            "data": (None, MeshSpec(data=8), Layout()),
            "fsdp": (None, MeshSpec(data=1, fsdp=8), Layout(min_shard=0)),
            "data x fsdp x tensor": (None, MeshSpec(data=2, fsdp=2, tensor=2), Layout(min_shard=0))}
    outcomes = {}
    for name, (devices, spec, layout) in runs.items():
        trainer = Trainer(objective, mesh_parity.recording(optax.sgd(RATE)), key=jax.random.key(0), mesh=spec,
                          layout=layout)
        if devices is not None:
            trainer.mesh = spec.build(devices)
        state = trainer.fit(_stream(ROWS), steps=3, log_every=1, verbose=False)
        outcomes[name] = mesh_parity.outcome(trainer.history, state)
        up = state.params["params"]["layers_0"]["mlp"]["up_proj"]["kernel"]
        held = {shard.data.shape for shard in up.addressable_shards}
        assert held == {{"one": (32, 64), "data": (32, 64), "fsdp": (4, 64)}.get(name, (16, 32))}, (name, held)
    # Bounds (tests/mesh_parity.py): 73 ulps of the loss, 95 of a gradient leaf's largest entry. Observed on every
    # mesh: losses 1 ulp apart, first gradients 4.7 ulps, parameters 7.5e-9.
    ulps = mesh_parity.step_ulps(model.config, SEQ, ROWS)
    for name in ("data", "fsdp", "data x fsdp x tensor"):
        mesh_parity.assert_like_one_device(outcomes["one"], outcomes[name], rate=RATE, ulps=ulps, what=name)
    print("ok", ulps)
    """
)


@pytest.mark.slow
def test_eight_device_mesh_matches_one_device():
    """Data parallel, fully sharded, and data x fsdp x tensor on 8 devices train like one device to rounding
    (`tests.mesh_parity`: no mesh gives one device's bits, each sums rows or products in another order):
    losses, first gradients and parameters after 3 SGD steps, each within the roundings the step makes; the
    up projection split as each mesh says."""
    env = devices_environment(8)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


class _Recorder:
    """Wraps a Grain iterator, keeping every batch it hands out (and its checkpointable state)."""

    def __init__(self, iterator, seen: list):
        self.iterator, self.seen = iterator, seen

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        self.seen.append(batch["text"].copy())
        return batch

    def get_state(self):
        return self.iterator.get_state()

    def set_state(self, state):
        self.iterator.set_state(state)


def test_resume_from_token_windows_reads_the_same_batches(tiny_model, tmp_path):
    import dataclasses

    from dew.data import TokenWindows
    from dew.data.tokenize import tokenize_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    tokenize_text(str(corpus), str(tmp_path / "tokens"), "byte", val_fraction=0.1, workers=1)
    model = dataclasses.replace(tiny_model, config=dataclasses.replace(tiny_model.config, vocab_size=256))
    objective = LMObjective(model, SEQ)
    windows = TokenWindows(str(tmp_path / "tokens"), SEQ).load(batch=4)

    def recorded(seen):
        return dataclasses.replace(windows, train=lambda partition: _Recorder(windows.train(partition), seen))

    straight_batches, resumed_batches = [], []
    straight = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(5)).fit(
        recorded(straight_batches), steps=6, verbose=False)
    Trainer(objective, optax.adamw(1e-2), key=jax.random.key(5)).fit(
        recorded(resumed_batches), steps=3, checkpoint_dir=str(tmp_path / "run"), verbose=False)
    resumed = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(5)).fit(
        recorded(resumed_batches), steps=6, checkpoint_dir=str(tmp_path / "run"), verbose=False)
    assert len(resumed_batches) == len(straight_batches) == 6
    for ours, theirs in zip(resumed_batches, straight_batches):
        np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(_flat(resumed.params), _flat(straight.params))


def test_trainable_filter_freezes_the_rest(tiny_model):
    objective = LMObjective(tiny_model, SEQ, ema_decay=None, trainable=r"/mlp/")
    trainer = Trainer(objective, optax.adamw(1e-2, weight_decay=0.1), key=jax.random.key(6))
    before = jax.device_get(trainer.init_state().params)
    after = jax.device_get(trainer.fit(_stream(4), steps=2, verbose=False).params)
    for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree_util.tree_leaves(after)):
        moved = not np.array_equal(old, new)
        assert moved == ("'mlp'" in jax.tree_util.keystr(path)), jax.tree_util.keystr(path)


class _SignalAt:
    """A tracker that sends this process `number` once step `step` is logged."""

    def __init__(self, number, step):
        self.number, self.step = number, step

    def start(self, step):
        pass

    def scalars(self, step, values):
        if step == self.step:
            os.kill(os.getpid(), self.number)

    def texts(self, step, name, texts):
        pass

    def close(self):
        pass


def test_sigint_checkpoints_the_step_and_stops_cleanly(tiny_model, tmp_path):
    import signal

    from dew.training import Checkpoints
    from dew.training.trainer import TrainingInterrupted

    objective = LMObjective(tiny_model, SEQ, ema_decay=None)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(7))
    # Python's default handler, set here: a job a non-interactive shell puts in the background starts
    # with SIGINT ignored, and fit must hand back whatever handler it found.
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(TrainingInterrupted, match="SIGINT stopped training at step 2") as stopped:
            trainer.fit(_stream(4), steps=10, log_every=1, checkpoint_dir=str(tmp_path), verbose=False,
                        trackers=[_SignalAt(signal.SIGINT, 2)])
        assert stopped.value.step == 2 and int(stopped.value.state.step) == 2
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        checkpoints = Checkpoints(tmp_path)
        assert checkpoints.latest() == 2
        checkpoints.close()
        # Without a checkpoint directory there is nothing to save: SIGINT interrupts as Python's default does.
        with pytest.raises(KeyboardInterrupt):
            trainer.fit(_stream(4), steps=10, log_every=1, verbose=False, trackers=[_SignalAt(signal.SIGINT, 2)])
    finally:
        signal.signal(signal.SIGINT, found)


def test_a_model_inputs_batch_trains_as_its_token_rows(tiny_model):
    """A batch entry may be a pytree (a `ModelInputs` under "text"): the step is compiled for its
    structure, placed and split into micro-batches leaf by leaf."""
    from dew.data.inputs import ModelInputs

    def stream(wrap):
        def train(partition):
            step = 0
            while True:
                rows = _rows(step, 4)
                yield {"text": wrap(rows)}
                step += 1

        return Dataset(train=train, val=None, records=10**6, batch=4)

    objective = LMObjective(tiny_model, SEQ, ema_decay=None)
    fit = lambda data: Trainer(objective, optax.sgd(0.5), key=jax.random.key(0)).fit(
        data, steps=2, accumulation=2, verbose=False)
    plain = fit(stream(lambda rows: rows))
    wrapped = fit(stream(lambda rows: ModelInputs.of(rows)))
    # The same rows and the same computation: bit-identical.
    np.testing.assert_array_equal(_flat(wrapped.params), _flat(plain.params))

    # With an attention mask among its token fields (the last three slots of each row are padding).
    def masked(rows):
        mask = np.ones_like(rows)
        mask[:, -3:] = 0
        return ModelInputs.of(rows, attention_mask=mask)

    trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0))
    state = trainer.fit(stream(masked), steps=1, verbose=False)
    assert int(state.updates) == 1 and len(trainer._compiled) == 1
