"""dew.training.memory: a train step that fits the device by itself. On the CPU, which reports no memory limit,
a device of a given size is stood in for (`memory.device_memory`); the estimates, the compiles and XLA's memory
analysis are the CPU's own."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.nn.stack import REMAT_POLICIES, remat_in_force
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective
from dew.training import memory
from dew.training.mesh import place_batch

SEQ, ROWS, VOCAB = 64, 8, 256


def _trainer(**fields):
    model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=64, num_layers=2, num_heads=4,
                         mlp_features=256, max_seq_len=SEQ, scan_layers=1, kernels="xla", **fields)
    return Trainer(LMObjective(model, SEQ, ema_decay=None), optax.adamw(1e-3), key=jax.random.key(0))


def _batch(trainer):
    rows = np.random.default_rng(0).integers(0, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)
    return place_batch(trainer.mesh, {"text": rows})


def _device(monkeypatch, size):
    monkeypatch.setattr(memory, "device_memory", lambda: (int(size), "Test device"))


def test_each_policy_keeps_less_for_the_backward_and_computes_the_same():
    """The named policies keep, from most to least: everything, every product, attention's side, nothing; and the
    loss and its gradients are the same under each (recomputing runs the same operations)."""
    trainer = _trainer()
    state, batch = trainer.init_state(), _batch(trainer)
    kept = {remat: trainer._residual_bytes(state, batch, 1, remat) for remat in ("none", "dots", "dots_no_mlp", "full")}
    assert kept["none"] > kept["dots"] > kept["dots_no_mlp"] > kept["full"] > 0
    objective = trainer.objective

    def loss(params):
        stats, _ = objective.loss({"params": params}, batch, Step(jnp.zeros((), jnp.int32), jax.random.key(0)))
        return objective.reduce_loss(stats)[0]

    results = {}
    for remat in REMAT_POLICIES:
        with remat_in_force(remat):
            results[remat] = jax.jit(jax.value_and_grad(loss))(state.params["params"])
    value, grads = results["none"]
    for remat, (other_value, other_grads) in results.items():
        # The same float32 operations, fused by XLA into other programs, whose sums may reassociate: a weight's
        # gradient sums 512 tokens' terms, each rounding at 2**-24 of the running sum, so 1e-5 of the gradient's
        # largest element bounds the difference (observed: 1.3e-6 of about 1).
        assert float(other_value) == pytest.approx(float(value), rel=1e-6), remat
        for a, b in zip(jax.tree_util.tree_leaves(other_grads), jax.tree_util.tree_leaves(grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_auto_takes_the_cheapest_remat_that_fits(monkeypatch):
    """Roomy: "none". Tight: the planner passes over what its estimate says cannot fit, compiles the first that
    does, and checks it with XLA's memory analysis; the plan says so in one line."""
    trainer = _trainer()
    state, batch = trainer.init_state(), _batch(trainer)
    _device(monkeypatch, 2**40)
    trainer.compile_step(state, batch)
    assert (trainer.memory_plan.remat, trainer.memory_plan.micro, trainer.memory_plan.tried) == ("none", 1, ())
    roomy = trainer.memory_plan.needed
    tight = _trainer()
    _device(monkeypatch, 0.85 * roomy)
    tight.compile_step(tight.init_state(), _batch(tight))
    plan = tight.memory_plan
    assert plan.remat != "none" and plan.chosen and plan.tried[0][0] == "none"
    assert plan.needed <= plan.available
    assert plan.line().startswith(f"memory: chose remat {plan.remat!r} with 1 micro-batch: the step takes ")


def test_an_explicit_remat_is_kept_and_what_cannot_fit_is_refused_before_compiling(monkeypatch):
    trainer = _trainer(remat="full")
    state, batch = trainer.init_state(), _batch(trainer)
    _device(monkeypatch, 2**40)
    trainer.compile_step(state, batch)
    assert trainer.memory_plan.remat == "full" and not trainer.memory_plan.chosen
    # smaller than the parameters and their optimizer state: nothing is compiled, and the error says what to do
    small = _trainer()
    monkeypatch.setattr(Trainer, "_compile", lambda *args: pytest.fail("compiled a step that cannot fit"))
    _device(monkeypatch, 2**20)
    with pytest.raises(memory.DoesNotFit, match=r"needs about .* GiB on one device \(the parameters, .*Test device "
                                                r"has 0.00 GiB: train fewer rows"):
        small.compile_step(small.init_state(), _batch(small))


def test_micro_batches_when_no_policy_fits_the_whole_batch(monkeypatch):
    """Past "full", the batch is split in 2, 4, ... micro-batches: the step then adds their gradients, as
    accumulation does."""
    trainer = _trainer()
    state, batch = trainer.init_state(), _batch(trainer)
    fixed = memory.shard_bytes(state) + memory.shard_bytes(state.params)
    full = trainer._residual_bytes(state, batch, 1, "full")
    # the fixed state fits; "full" over the whole batch does not by its estimate; a split does
    _device(monkeypatch, (fixed + full) / memory.ESTIMATE_SHARE * 1.02)
    monkeypatch.setattr(memory, "compiled_bytes", lambda compiled: 0)  # XLA's CPU analysis holds more
    trainer.compile_step(state, batch)
    assert trainer.memory_plan.remat == "full" and trainer.memory_plan.micro > 1


def test_fit_records_the_plan_in_the_checkpoints(tmp_path, monkeypatch, capsys):
    trainer = _trainer()
    _device(monkeypatch, 2**40)
    rows = np.random.default_rng(1).integers(0, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)

    def batches(partition):
        while True:
            yield {"text": rows}

    data = Dataset(train=batches, val=None, records=ROWS, batch=ROWS)
    trainer.fit(data, steps=1, checkpoint_dir=str(tmp_path / "checkpoints"))
    record = json.loads((tmp_path / "checkpoints" / "memory.json").read_text())
    assert record["remat"] == "none" and record["available"] == 2**40
    assert "memory: chose remat 'none'" in capsys.readouterr().out
