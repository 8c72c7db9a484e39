"""LMObjective: target weights, statistics and refusals (the tiled loss itself: tests/nn/test_head.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.metrics import perplexity
from dew.objectives.base import Mean, Step
from dew.objectives.lm import LMObjective, LMStatistics, prompt_batch
from tests.tolerances import decoder_ulps, ulp_bound

STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))


def test_loss_at_initialisation_is_close_to_log_vocab(tiny_model, tiny_variables):
    objective = LMObjective(tiny_model, seq_len=16)
    tokens = np.random.default_rng(0).integers(0, 64, (4, 17)).astype(np.int32)
    stats, effects = objective.loss(tiny_variables, {"text": jnp.asarray(tokens)}, STEP)
    assert effects == {}
    # A property of the initialisation, not a rounding bound: its logits spread by sigma = 0.11 (at most
    # 0.15 in a row), so the mean CE is log 64 + sigma^2 / 2 (0.01) give or take the 64 targets' scatter
    # (3 sigma / 8 = 0.04). Observed: 0.025 above log 64.
    assert abs(float(stats.ce.value) - math.log(64)) < 0.05
    assert float(stats.ce.count) == 4 * 16


def test_padding_and_document_transitions_carry_no_weight(tiny_model, tiny_variables):
    objective = LMObjective(tiny_model, seq_len=7, pad_id=0)
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 0, 0], list(range(8))], jnp.int32)
    scores = objective.token_scores(tiny_variables, tokens, segment_ids=segments, positions=positions)
    # Row 0: targets 6,7 | 8 (transition) | 9,10 | 0,0 (padding) -> weights 1,1,0,1,1,0,0.
    np.testing.assert_array_equal(scores.weights[0], [1, 1, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(scores.weights[1], [1] * 7)
    # Changing a token that is only ever a zero-weight target leaves the loss unchanged.
    stats = objective.loss(tiny_variables, {"text": tokens, "text_segment_ids": segments, "text_positions": positions}, STEP)[0]
    changed = tokens.at[0, 7].set(33)
    again = objective.loss(tiny_variables, {"text": changed, "text_segment_ids": segments, "text_positions": positions}, STEP)[0]
    assert float(stats.loss.total) == float(again.loss.total)
    assert float(stats.loss.count) == 4 + 7


def test_z_loss_adds_the_squared_log_normaliser(tiny_model, tiny_variables):
    tokens = {"text": jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)), jnp.int32)}
    plain = LMObjective(tiny_model, seq_len=8).loss(tiny_variables, tokens, STEP)[0]
    with_z = LMObjective(tiny_model, seq_len=8, z_loss=1e-2).loss(tiny_variables, tokens, STEP)[0]
    scores = LMObjective(tiny_model, seq_len=8).token_scores(tiny_variables, tokens["text"])
    z_term = 1e-2 * float(jnp.sum(scores.lse**2))
    expected = float(plain.ce.total) + z_term
    # fp32: the z term's 16 squares summed in another order, scaled (17 roundings of its size), its
    # normalisers off by what a forward pass in another order gives (twice decoder_ulps for a square),
    # and the float32 sum with the CE total (one rounding of the value). Bound 5.5e-5; observed 1.2e-6.
    lse_ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=8, libraries=1)
    bound = ulp_bound(17 + 2 * lse_ulps, z_term) + ulp_bound(1, expected)
    np.testing.assert_allclose(float(with_z.loss.total), expected, atol=bound, rtol=0)
    assert float(with_z.ce.total) == float(plain.ce.total)


def test_perplexity_weighs_batches_by_counted_targets():
    metric = perplexity()
    small = LMStatistics(ce=Mean(jnp.asarray(2.0), jnp.asarray(1.0)), token_accuracy=None)
    large = LMStatistics(ce=Mean(jnp.asarray(30.0), jnp.asarray(10.0)), token_accuracy=None)
    empty = LMStatistics(ce=Mean(jnp.asarray(0.0), jnp.asarray(0.0)), token_accuracy=None)
    accumulated = metric.initial()
    for stats in (small, large, empty):
        accumulated = metric.merge(accumulated, metric.contribution(stats))
    # 32 nats over 11 targets, not the mean of the per-batch means (2 and 3).
    assert metric.finalize(accumulated) == math.exp(32 / 11)  # the same float64 sums and exp: exact
    with pytest.raises(ValueError, match="no counted target"):
        metric.finalize(metric.initial())


def test_bad_batches_are_refused_by_name(tiny_model):
    objective = LMObjective(tiny_model, seq_len=8)
    with pytest.raises(ValueError, match=r"token rows have shape \(2, 8\).*\[B, 9\]"):
        objective.check_batch({"text": np.zeros((2, 8), np.int32)})
    bad = np.zeros((2, 9), np.int32)
    bad[1, 4] = 70
    with pytest.raises(ValueError, match="token id 70 at row 1, column 4 is outside vocab_size 64"):
        objective.check_batch({"text": bad})
    with pytest.raises(KeyError, match="no 'text' entry"):
        objective.check_batch({"tokens": bad})


def test_bad_configuration_is_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match="seq_len 65 is longer than the model's max_seq_len 64"):
        LMObjective(tiny_model, seq_len=65)
    with pytest.raises(ValueError, match="mtp_weight=0.3.*no multi-token-prediction modules"):
        LMObjective(tiny_model, seq_len=8, mtp_weight=0.3)
    with pytest.raises(ValueError, match=r"balance_rate=0.01\) acts on the routers of a mixture of experts, and this "
                                         "model has none"):
        LMObjective(tiny_model, seq_len=8, balance_rate=0.01)
    with pytest.raises(ValueError, match=r"head_chunks is 0; give a count of vocabulary tiles of at least 1, or None"):
        LMObjective(tiny_model, seq_len=8, head_chunks=0)


def test_prompt_batch():
    np.testing.assert_array_equal(prompt_batch([1, 2, 3]), [[1, 2, 3]])
    np.testing.assert_array_equal(prompt_batch([[1, 2], [3, 4]]), [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"lengths \[1, 2\]"):
        prompt_batch([[1], [2, 3]])


def test_a_tiny_model_overfits_one_batch(tiny_model):
    objective = LMObjective(tiny_model, seq_len=16, ema_decay=None)
    tokens = {"text": jnp.asarray(np.random.default_rng(5).integers(0, 64, (4, 17)), jnp.int32)}
    params = objective.init(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss(p):
            total, count = objective.reduce_loss(objective.loss(p, tokens, STEP)[0])
            return total / count
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value

    for _ in range(150):
        params, opt_state, value = step(params, opt_state)
    assert float(value) < 0.05  # a training outcome, not a rounding bound: observed 0.0016
