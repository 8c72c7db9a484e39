"""LMObjective's router terms: each loss and the bias step by hand, accumulation equal to one batch for
every term, a window of no counted target, routing reports and replay, refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.nn.moe import RouterRecord
from dew.objectives.lm import LMObjective
from dew.objectives.lm.routing import RouterTerms, bias_steps
from tests.compiled import compiled
from tests.tolerances import ulp_bound

SEQ, EXPERTS, TOP_K = 8, 4, 2
MOE = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=2, mlp_features=32, max_seq_len=16,
           mixture=dict(experts=EXPERTS, top_k=TOP_K, bias=True))


@pytest.fixture(scope="module")
def moe_model():
    return models.build("causal_transformer", **MOE)


def _record(seed: int, layers=2, rows=3, seq=5):
    """A hand-made layer-stacked record: distinct experts per token, softmax scores, log-normalisers."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(layers * rows * seq)]).reshape(
        layers, rows, seq, TOP_K)
    logits = rng.normal(size=(layers, rows, seq, EXPERTS))
    scores = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    log_z = np.log(np.exp(logits).sum(-1))
    as_jax = lambda x, dtype=jnp.float32: jnp.asarray(x, dtype)
    return RouterRecord(as_jax(experts, jnp.int32), as_jax(np.zeros(experts.shape)), as_jax(scores), as_jax(log_z))


# Rows 0 and 1 partly padded, row 2 all padding: per-row token counts 3, 5 and 0.
ROUTED = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)


def _by_hand(record: RouterRecord, routed, alpha, z):
    """(sequence balance loss, Switch loss, z-loss) with loops, in float64, from the definitions."""
    experts, scores, log_z = (np.asarray(x, np.float64) for x in (record.experts, record.scores, record.log_z))
    layers, rows = experts.shape[:2]
    sequence = switch = z_loss = 0.0
    positions = routed.sum()
    counted_rows = sum(1 for b in range(rows) if routed[b].any())
    for layer in range(layers):
        for b in range(rows):
            tokens = routed[b].sum()
            if tokens == 0:
                continue
            for e in range(EXPERTS):
                count = sum((experts[layer, b, s] == e).sum() for s in range(5) if routed[b, s])
                mean_score = sum(scores[layer, b, s, e] for s in range(5) if routed[b, s]) / tokens
                sequence += alpha * (count * EXPERTS / (tokens * TOP_K)) * mean_score / counted_rows
        counts = [sum((experts[layer, b, s] == e).sum() for b in range(rows) for s in range(5) if routed[b, s])
                  for e in range(EXPERTS)]
        score_sums = [sum(scores[layer, b, s, e] for b in range(rows) for s in range(5) if routed[b, s])
                      for e in range(EXPERTS)]
        switch += alpha * EXPERTS * sum(c * p for c, p in zip(counts, score_sums)) / (positions ** 2 * TOP_K)
        z_loss += z * sum(log_z[layer, b, s] ** 2 for b in range(rows) for s in range(5) if routed[b, s]) / positions
    return sequence, switch, z_loss


def test_each_router_loss_by_hand():
    record = _record(0)
    expected = dict(zip(("sequence", "switch", "z"), _by_hand(record, ROUTED, alpha=0.01, z=0.001)))
    for seq_aux, name in ((True, "sequence"), (False, "switch")):
        terms = RouterTerms(EXPERTS, TOP_K, (0, 1), aux_loss_alpha=0.01, seq_aux=seq_aux, z_loss=0.001)
        stats = terms.statistics(record, jnp.asarray(ROUTED))
        assert float(stats.positions) == 8 and float(stats.rows) == 2
        _, named = terms.loss(stats, terms.totals(stats))
        # float32 sums of at most 40 terms of size <= 4 against float64: 64 ulps of the loss.
        assert float(named["balance_loss"]) == pytest.approx(expected[name], rel=ulp_bound(64))
        assert float(named["router_z_loss"]) == pytest.approx(expected["z"], rel=ulp_bound(64))
    # Balanced routing gives the balance losses' floor: alpha times the summed scores (1 per token).
    assert expected["sequence"] > 0.02 * 0.5 and expected["switch"] > 0.02 * 0.5


def test_the_bias_step_by_hand():
    # counts [3, 1, 0, 0] at rate 0.001: the mean is 1, so [-, 0, +, +].
    steps = bias_steps(jnp.asarray([[3, 1, 0, 0], [1, 1, 1, 1]]), 0.001)
    np.testing.assert_array_equal(steps, np.float32([[-0.001, 0, 0.001, 0.001], [0, 0, 0, 0]]))


def test_apply_effects_moves_each_layers_bias_once(moe_model):
    objective = LMObjective(moe_model, SEQ, balance_rate=0.5, ema_decay=None)
    variables = compiled(objective.init, jax.random.key(0))
    counts = jnp.asarray([[4, 0, 2, 2], [0, 0, 1, 7]], jnp.int32)
    moved = objective.apply_effects(variables, {"counts": counts})
    biases = np.asarray(moved["moe"]["layers_0"]["mlp"]["gate"]["e_score_correction_bias"]), np.asarray(
        moved["moe"]["layers_1"]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_array_equal(biases[0], [-0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(biases[1], [0.5, 0.5, 0.5, -0.5])


def _rows(seed: int, count: int) -> np.ndarray:
    """Rows of ids 1..63 with pad id 0: different padded tails, one row all padding after its first token."""
    rows = np.random.default_rng(seed).integers(1, 64, (count, SEQ + 1)).astype(np.int32)
    for i in range(count):
        rows[i, SEQ + 1 - 2 * (i % 4):] = 0
    rows[count - 1, 1:] = 0
    return rows


def _data(rows: np.ndarray) -> Dataset:
    return Dataset(train=lambda partition: iter([{"text": rows}] * 8), val=None, records=len(rows), batch=len(rows))


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))])


@pytest.mark.slow
@pytest.mark.parametrize("seq_aux", [True, False])
def test_accumulated_micro_batches_equal_one_batch_for_every_term(moe_model, seq_aux):
    # Every term on at once: the head's z-loss (token mass), the balance loss (rows, or the window's
    # pooled counts and score sums), the routers' z-loss (routed positions), the bias step (counts).
    objective = LMObjective(moe_model, SEQ, pad_id=0, ema_decay=None, z_loss=1e-3, aux_loss_alpha=0.1,
                            seq_aux=seq_aux, router_z_loss=0.01, balance_rate=0.01)
    rows = _rows(0, 8)  # micro-batches of 2 rows count 16, 12, 8 and 2 targets, and different rows and positions
    states, logged = {}, {}
    for accumulation in (1, 4):
        trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0))
        states[accumulation] = trainer.fit(_data(rows), steps=2, log_every=1, verbose=False,
                                           accumulation=accumulation)
        logged[accumulation] = trainer.history
    # The window's statistics are sums of integer counts and float32 terms: the losses agree to the
    # float32 roundings of sums of 64 terms in another order, 64 ulps of each. Observed: 9.1e-8 relative.
    for one, four in zip(logged[1], logged[4]):
        for name in ("train/loss", "train/ce", "train/balance_loss", "train/router_z_loss"):
            assert four[name] == pytest.approx(one[name], rel=ulp_bound(64)), name
        assert four["train/moe/layers_1/max_load"] == one["train/moe/layers_1/max_load"]  # integer counts
    # Parameters: four micro-batches' gradient sums and their scan against one sum over the 38 targets,
    # the same bound as the dense accumulation test (tests/training/test_trainer.py): 1e-6 after two
    # steps. Observed: 2.0e-8.
    np.testing.assert_allclose(_flat(states[4].params["params"]), _flat(states[1].params["params"]), atol=1e-6, rtol=0)
    # The bias moved by whole steps of the rate from integer counts: identical.
    np.testing.assert_array_equal(_flat(states[4].params["moe"]), _flat(states[1].params["moe"]))
    assert np.any(_flat(states[1].params["moe"]) != 0)


def test_a_window_of_no_counted_target_still_updates_with_a_router_loss(moe_model):
    rows = np.zeros((4, SEQ + 1), np.int32)
    rows[:, 0] = 5  # every target is padding; each row's first input is routed
    updates = {}
    for alpha in (None, 0.1):
        objective = LMObjective(moe_model, SEQ, pad_id=0, ema_decay=None, aux_loss_alpha=alpha)
        trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0))
        before = _flat(trainer.init_state().params["params"])
        state = trainer.fit(_data(rows), steps=1, verbose=False, accumulation=2)
        updates[alpha] = (int(state.updates), bool(np.any(_flat(state.params["params"]) != before)))
    assert updates == {None: (0, False), 0.1: (1, True)}


def test_token_scores_report_routing_and_replay_routes(moe_model):
    objective = LMObjective(moe_model, SEQ)
    variables = compiled(objective.init, jax.random.key(0))
    tokens = jnp.asarray(_rows(3, 2))
    scores = compiled(objective.token_scores, variables, tokens, routing=True)
    assert scores.routing.experts.shape == (2, SEQ, 2, TOP_K) and scores.routing.weights.shape == (2, SEQ, 2, TOP_K)
    # Replay every token's experts reversed in rank, and a different pick where covered.
    ids = np.zeros((2, SEQ + 1, 2, TOP_K), np.int32)
    ids[:, :SEQ] = np.asarray(scores.routing.experts)[..., ::-1]
    ids[0, 0, 0] = [(int(ids[0, 0, 0, 0]) + 1) % EXPERTS, int(ids[0, 0, 0, 0])]
    covered = np.ones((2, SEQ + 1), bool)
    covered[1] = False
    replayed = compiled(objective.token_scores, variables, tokens, routing=True, routes=(ids, covered))
    np.testing.assert_array_equal(replayed.routing.experts[0], ids[0, :SEQ])
    np.testing.assert_array_equal(replayed.routing.experts[1], scores.routing.experts[1])
    assert not np.allclose(replayed.losses[0, 0], scores.losses[0, 0])


@pytest.mark.parametrize("routes, message", [
    ((np.zeros((2, SEQ, 2, TOP_K), np.int32), None), r"routes ids have shape \(2, 8, 2, 2\); token_scores reads "
                                                      r"\[B, seq_len \+ 1, layers, top_k\] = \[2, 9, 2, 2\]"),
    ((np.full((2, SEQ + 1, 2, TOP_K), 4, np.int32), None), r"routes id 4 at \[row, token, layer, slot\] = \[0, 0, 0, 0\] "
                                                           r"is not one of this model's 4 experts"),
    ((np.zeros((2, SEQ + 1, 2, TOP_K), np.int32), np.ones((2, SEQ), bool)), r"routes covered has shape \(2, 8\)"),
])
def test_bad_routes_are_refused_by_name(moe_model, routes, message):
    objective = LMObjective(moe_model, SEQ)
    variables = compiled(objective.init, jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        objective.token_scores(variables, jnp.asarray(_rows(3, 2)), routes=routes)


def test_router_keywords_are_refused_where_they_cannot_act(moe_model, tiny_model):
    unbiased = models.build("causal_transformer", **{**MOE, "mixture": dict(experts=EXPERTS, top_k=TOP_K)})
    with pytest.raises(ValueError, match=r"balance_rate=0.001\) moves each router's balancing bias, and this model's "
                                         "mixture has bias=False"):
        LMObjective(unbiased, SEQ, balance_rate=0.001)
    with pytest.raises(ValueError, match=r"router_z_loss=0.1\) acts on the routers of a mixture of experts, and this "
                                         "model has none"):
        LMObjective(tiny_model, SEQ, router_z_loss=0.1)
    with pytest.raises(ValueError, match=r"aux_loss_alpha=-1.0\): use a value above 0"):
        LMObjective(moe_model, SEQ, aux_loss_alpha=-1.0)


def test_the_logs_report_each_layers_load(moe_model):
    objective = LMObjective(moe_model, SEQ, ema_decay=None, aux_loss_alpha=0.01)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
    trainer.fit(_data(_rows(4, 4)), steps=1, log_every=1, verbose=False)
    logged = trainer.history[-1]
    for layer in (0, 1):
        high, low = logged[f"train/moe/layers_{layer}/max_load"], logged[f"train/moe/layers_{layer}/min_load"]
        # Loads are slots over an even share: they average 1, so the most loaded is >= 1 >= the least.
        assert high >= 1.0 >= low >= 0.0
    assert logged["train/loss"] == pytest.approx(logged["train/ce"] + logged["train/balance_loss"], rel=ulp_bound(8))
