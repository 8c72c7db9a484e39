"""Trainer.fit with an on-policy objective: each step's batch is drawn from the live weights with a key of
its own per step (and per validation batch), and a batch of a new shape gets a step compiled for it."""

from __future__ import annotations

import jax
import numpy as np
import optax

from dew import Trainer
from dew.data.dataset import Dataset
from dew.objectives.lm import LMObjective

SEQ = 8


class DrawnRows(LMObjective):
    """Language modelling on rows drawn from a key, 4 rows at odd calls and 8 at even ones, noting the
    weights and key of each draw."""

    def __init__(self, model):
        super().__init__(model, SEQ, ema_decay=None, token_accuracy=False)
        self.draws: list[tuple[np.ndarray, float, dict]] = []

    def on_policy_batch(self, params, prompts, key):
        leaf = np.asarray(jax.tree_util.tree_leaves(params)[0])
        self.draws.append((np.asarray(jax.random.key_data(key)), float(np.abs(leaf).sum()), prompts))
        rows = 4 if len(self.draws) % 2 else 8
        ids = jax.random.randint(key, (rows, SEQ + 1), 1, self.model.config.vocab_size)
        return {"text": np.asarray(ids, np.int32)}


def _prompts() -> Dataset:
    def train(partition):
        step = 0
        while True:
            yield {"prompt": np.full((2, 3), step, np.int32)}
            step += 1

    def val(partition):
        for index in range(2):
            yield {"prompt": np.full((2, 3), -1 - index, np.int32)}

    return Dataset(train=train, val=val, records=10**6, batch=4)


def test_each_step_draws_from_the_live_weights_with_its_own_key(tiny_model):
    objective = DrawnRows(tiny_model)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    trainer.fit(_prompts(), steps=3, log_every=1, eval_every=3, verbose=False)
    # Steps 1-3, then the two validation batches of the evaluation at step 3.
    assert [int(draw[2]["prompt"][0, 0]) for draw in objective.draws] == [0, 1, 2, -1, -2]
    keys = [draw[0].tobytes() for draw in objective.draws]
    assert len(set(keys)) == 5
    weights = [draw[1] for draw in objective.draws]
    # Each step's draw sees the weights its predecessor left; the evaluation, those of the last step.
    assert len(set(weights[:4])) == 4 and weights[3] == weights[4]
    # Rows of 4 and of 8: one step compiled for each, and one evaluation per shape.
    assert sum(1 for signature in trainer._compiled if signature[0] != "eval") == 2
    assert [record["step"] for record in trainer.history if "train/loss" in record] == [1, 2, 3]
