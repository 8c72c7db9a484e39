"""The trainer's side of the objective protocol: effects summed over an accumulation window and applied
once after the update, the loss read through `reduce_loss`, parameters placed by their logical names."""

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

from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.objectives.base import Step
from dew.objectives.lm import LMObjective
from tests.compile_flags import devices_environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CountingObjective(LMObjective):
    """An LM objective whose loss also reports, as an effect, how often each id was a target, and
    whose `apply_effects` adds those counts into a `counts` collection outside the gradient."""

    def init(self, key, variables=None):
        variables = super().init(key, variables)
        return {**variables, "counts": {"targets": jnp.zeros((self.model.config.vocab_size,), jnp.float32)}}

    def loss(self, params, batch, step):
        stats, _ = super().loss(params, batch, step)
        targets = batch["text"][:, 1:].reshape(-1)
        counts = jnp.zeros((self.model.config.vocab_size,), jnp.float32).at[targets].add(1.0)
        # The loss reads the counts, so a micro-batch that saw updated ones would score differently.
        return stats, {"targets": counts + 0.0 * jnp.sum(params["counts"]["targets"])}

    def apply_effects(self, variables, effects):
        return {**variables, "counts": {"targets": variables["counts"]["targets"] + effects["targets"]}}


def _data(rows):
    return Dataset(train=lambda partition: iter([{"text": rows}] * 8), val=None, records=len(rows),
                   batch=len(rows))


def test_effects_add_over_the_window_and_apply_once():
    model = models.build("causal_transformer", vocab_size=32, emb_features=32, num_layers=1, num_heads=2,
                         max_seq_len=16)
    rows = np.random.default_rng(0).integers(0, 32, (4, 9)).astype(np.int32)
    expected = np.bincount(rows[:, 1:].reshape(-1), minlength=32).astype(np.float32)
    states = {}
    for accumulation in (1, 2, 4):
        trainer = Trainer(CountingObjective(model, 8, ema_decay=None), optax.sgd(0.1), key=jax.random.key(0))
        states[accumulation] = trainer.fit(_data(rows), steps=2, log_every=1, verbose=False, accumulation=accumulation)
        # Two steps on the same batch: each window's counts applied once, never per micro-batch twice.
        np.testing.assert_array_equal(np.asarray(states[accumulation].params["counts"]["targets"]), 2 * expected)


def test_the_trainer_logs_the_loss_that_reduce_loss_gives():
    model = models.build("causal_transformer", vocab_size=32, emb_features=32, num_layers=1, num_heads=2,
                         max_seq_len=16)
    rows = np.random.default_rng(1).integers(0, 32, (4, 9)).astype(np.int32)
    objective = LMObjective(model, 8, ema_decay=None, z_loss=1e-2)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0))
    state = trainer.fit(_data(rows), steps=1, log_every=1, verbose=False)
    # The model has no dropout, so the step's key (the loss's dropout rng) changes nothing here.
    step = Step(index=jnp.asarray(0), key=jax.random.key(0))
    stats, _ = objective.loss(state.params, {"text": jnp.asarray(rows)}, step)
    numerator, count = objective.reduce_loss(stats)
    logged = trainer.history[-1]
    # The same float32 sums, divided once on each side (float64 on the host): 4 ulps of a loss near 3.5.
    assert abs(logged["train/loss"] - float(numerator) / float(count)) <= 4 * 4 * np.finfo(np.float32).eps
    assert logged["train/loss"] > logged["train/ce"]  # the z-loss is a named term of the loss
    assert logged["train/z_loss"] == pytest.approx(logged["train/loss"] - logged["train/ce"], abs=1e-5)


MESH_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, optax
    from dew import Trainer, models
    from dew.data.dataset import Dataset
    from dew.objectives.lm import LMObjective
    from dew.sharding import Layout, MeshSpec

    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         mlp_features=64, max_seq_len=16, scan_layers=1)
    rows = np.random.default_rng(0).integers(0, 64, (4, 9)).astype(np.int32)
    data = Dataset(train=lambda partition: iter([{"text": rows}] * 8), val=None, records=4, batch=4)
    losses = {}
    for name, devices, spec in (("one", jax.devices()[:1], MeshSpec()), ("tensor", None, MeshSpec(data=2, tensor=2))):
        trainer = Trainer(LMObjective(model, 8), optax.adamw(1e-2), key=jax.random.key(0), mesh=spec,
                          layout=Layout(min_shard=0))
        if devices is not None:
            trainer.mesh = spec.build(devices)
        state = trainer.fit(data, steps=3, log_every=1, verbose=False)
        losses[name] = [row["train/loss"] for row in trainer.history]
    # The scanned run's stacked kernels are split by their names: up_proj [layers, embed, mlp] over
    # tensor on mlp; its EMA and Adam moments the same way.
    up = state.params["params"]["layers_0to1"]["mlp"]["up_proj"]["kernel"]
    assert tuple(up.sharding.spec) == (None, None, "tensor"), up.sharding.spec
    assert state.ema["params"]["layers_0to1"]["mlp"]["up_proj"]["kernel"].sharding == up.sharding
    moments = [leaf for leaf in jax.tree_util.tree_leaves(state.opt_state) if getattr(leaf, "shape", None) == up.shape]
    assert moments and all(leaf.sharding == up.sharding for leaf in moments)
    # Not bit-identical: the tensor axis sums the mlp products in two halves. fp32 losses near 4 over
    # 3 steps: 64 ulps.
    np.testing.assert_allclose(losses["tensor"], losses["one"], rtol=64 * np.finfo(np.float32).eps)
    print("ok", losses)
    """
)


@pytest.mark.slow
def test_parameters_are_placed_by_their_logical_names():
    env = devices_environment(4)
    done = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
