"""GRPOObjective: group advantages and the clipped, KL-penalised token losses by hand; a rollout's layout
(the sampler's recorded likelihoods equal the policy's at the snapshot); refusals; the reference step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.objectives.base import Step
from dew.objectives.grpo import ADVANTAGE_EPS, GRPOObjective, clipped_token_losses, group_advantages
from dew.sampling import Sampling
from dew.training.mesh import place_batch
from tests.tolerances import LIBRARY_ULPS, assert_within, decoder_ulps, ulp_bound

SEQ = 8
EOS = 2


def _reward(prompt, completion):
    return float(sum(completion) % 3)


def test_group_advantages_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], np.float32)
    advantages = group_advantages(rewards, 4)
    # Group one: mean 0.5, sample std sqrt(1/3); group two: all equal, so all zero.
    spread = math.sqrt(1 / 3) + ADVANTAGE_EPS
    np.testing.assert_allclose(advantages[:4], np.array([0.5, -0.5, -0.5, 0.5]) / spread, rtol=1e-6)
    np.testing.assert_array_equal(advantages[4:], 0.0)


def test_clipped_token_losses_by_hand():
    clip, weight = 0.2, 0.5
    new = jnp.log(jnp.asarray([[1.5, 0.5, 1.1, 0.7]]))  # ratios against a sampler at log 1 = 0
    sampled = jnp.zeros((1, 4))
    reference = jnp.log(jnp.asarray([[1.0, 1.0, 1.0, 1.0]]))
    losses, ratio, kl = clipped_token_losses(new, sampled, jnp.asarray([2.0]), clip, reference, weight)
    # A > 0: min(rho A, clip(rho) A) takes the clipped 1.2 * 2 above 1.2 and rho * 2 below 0.8.
    surrogate = np.array([1.2 * 2, 0.5 * 2, 1.1 * 2, 0.7 * 2])
    gap = -np.log([1.5, 0.5, 1.1, 0.7])
    expected = -surrogate + weight * (np.exp(gap) - gap - 1)
    # fp32: an exp and a log per ratio (LIBRARY_ULPS each) and a few roundings, of values up to 3.
    assert_within(losses[0], expected, ulp_bound(2 * LIBRARY_ULPS + 6, 3.0), "token losses")
    negative, _, _ = clipped_token_losses(new, sampled, jnp.asarray([-1.0]), clip)
    # A < 0: the minimum takes rho * A above 1.2 and the clipped 0.8 * A below 0.8.
    assert_within(negative[0], [1.5, 0.8, 1.1, 0.8], ulp_bound(LIBRARY_ULPS + 3, 1.5), "negative advantage")


@pytest.fixture(scope="module")
def rollout(tiny_model, tiny_variables):
    objective = GRPOObjective(tiny_model, SEQ, _reward, group_size=4, max_new_tokens=4,
                              sampling=Sampling(eos_token_ids=(EOS,)))
    prompts = [[5, 9, 12], [7, 1, 30, 4]]
    batch, rewards = objective.rollout(tiny_variables, prompts, jax.random.key(3))
    return objective, prompts, batch, rewards


@pytest.mark.slow
def test_a_rollout_records_the_policys_likelihoods_at_the_snapshot(rollout, tiny_variables, tiny_model):
    objective, prompts, batch, rewards = rollout
    objective.check_batch(batch)
    assert batch["text"].shape == (8, SEQ + 1) and batch["advantages"].shape == (8,)
    for row in range(8):
        prompt = prompts[row // 4]
        completion = batch["text"][row][batch["completion"][row] > 0].tolist()
        assert batch["text"][row][:len(prompt)].tolist() == prompt
        assert batch["completion"][row][:len(prompt)].sum() == 0 and 1 <= len(completion) <= 4
        assert EOS not in completion[:-1]
        assert rewards[row] == _reward(prompt, completion)
    np.testing.assert_allclose(batch["advantages"], group_advantages(rewards, 4))
    # The sampler's log-likelihood of each drawn token (cached decoding) against the objective's (the
    # chunked head over the whole row), fp32, same weights: the logits differ by what a forward pass in
    # another order gives (decoder_ulps, one library, of the largest logit), which moves a log-softmax
    # by at most twice that; its 64-term sum adds 66 roundings of 1. Bound 1.5e-5; observed 4.8e-7.
    mask = batch["completion"][:, 1:] > 0
    ours = np.asarray(jax.jit(objective.log_probs)(tiny_variables, jnp.asarray(batch["text"])))[mask]
    logit = float(np.abs(np.asarray(tiny_model.apply(tiny_variables, jnp.asarray(batch["text"])))).max())
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=SEQ + 1, libraries=1)
    bound = 2 * ulp_bound(ulps, logit) + ulp_bound(66, 1.0) + ulp_bound(2, math.log(64) + 2 * logit)
    assert_within(ours, batch["sampled_log_probs"][:, 1:][mask], bound, "log-likelihoods at the snapshot")
    # So every ratio is 1 within that, and the loss is minus the advantages' mean over completion tokens.
    stats = jax.jit(objective.evaluate)(tiny_variables, {k: jnp.asarray(v) for k, v in batch.items()},
                                        Step(0, jax.random.key(0)))
    tokens = float(mask.sum())
    expected = -float((batch["advantages"][:, None] * mask).sum()) / tokens
    assert abs(float(stats.ratio.total) / tokens - 1.0) <= 2 * bound
    assert abs(float(stats.loss.total) / tokens - expected) <= 2 * bound * np.abs(batch["advantages"]).max() + 1e-6


def test_settings_the_update_cannot_follow_are_refused(tiny_model):
    with pytest.raises(NotImplementedError, match="GRPOObjective samples with repetition_penalty=1.2: the penalty "
                                                  "depends on each row's history"):
        GRPOObjective(tiny_model, SEQ, _reward, max_new_tokens=4, sampling=Sampling(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="GRPOObjective samples at temperature 0"):
        GRPOObjective(tiny_model, SEQ, _reward, max_new_tokens=4, sampling=Sampling(temperature=0.0))
    with pytest.raises(ValueError, match="group_size is 1"):
        GRPOObjective(tiny_model, SEQ, _reward, max_new_tokens=4, group_size=1)
    objective = GRPOObjective(tiny_model, SEQ, _reward, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"a prompt of 6 tokens plus max_new_tokens 4 is beyond seq_len \+ 1 = 9"):
        objective.rollout(None, [[1] * 6], jax.random.key(0))


@pytest.mark.slow
def test_the_kl_term_reads_the_frozen_reference(rollout, tiny_model, tiny_variables):
    _, _, batch, _ = rollout
    objective = GRPOObjective(tiny_model, SEQ, _reward, group_size=4, max_new_tokens=4, kl_weight=0.1,
                              sampling=Sampling(eos_token_ids=(EOS,)), pretrained=tiny_variables)
    assert objective.ema_decay == 1.0 and objective.reads_reference
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.init_state()
    placed = place_batch(trainer.mesh, batch)
    step = trainer.compile_step(state, placed)
    state, first = step(state, placed)
    # The policy is the reference at the first step: the same computation on the same weights, so the
    # log-likelihood gap is an exact zero and so is the KL.
    assert float(first["stats"].kl.total) == 0.0
    state, second = step(state, placed)
    assert float(second["stats"].kl.total) > 0.0  # the policy moved, the reference did not
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.ema["params"]):
        expected = tiny_variables["params"]
        for entry in path:
            expected = expected[entry.key]
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected))


@pytest.mark.slow
def test_a_tempered_top_k_rollout_is_scored_as_the_sampler_drew_it(tiny_model, tiny_variables):
    """Temperature 0.7 and top_k 5: the rollout records each sampled token's kept ids (the snapshot's 5
    largest logits), and the update scores the sampler's distribution, tempered and renormalised over them."""
    temperature, k = 0.7, 5
    objective = GRPOObjective(tiny_model, SEQ, _reward, group_size=4, max_new_tokens=4, kl_weight=0.1,
                              pretrained=tiny_variables,
                              sampling=Sampling(temperature=temperature, top_k=k, eos_token_ids=(EOS,)))
    batch, _ = objective.rollout(tiny_variables, [[5, 9, 12], [7, 1, 30, 4]], jax.random.key(3))
    objective.check_batch(batch)
    logits = np.asarray(tiny_model.apply(tiny_variables, jnp.asarray(batch["text"][:, :-1])), np.float64)
    rows, columns = np.nonzero(batch["completion"])
    assert len(rows) >= 8
    # By hand, in float64: each sampled token's likelihood over the top 5 of the tempered logits.
    expected = []
    for row, column in zip(rows, columns):
        tempered = logits[row, column - 1] / temperature
        top = np.argsort(-tempered)[:k]
        kept = batch["support_ids"][row][batch["support_columns"][row] == column]
        assert sorted(kept.tolist()) == sorted(top.tolist()) and batch["text"][row, column] in kept
        expected.append(tempered[batch["text"][row, column]] - np.log(np.exp(tempered[top]).sum()))
    support = (jnp.asarray(batch["support_ids"]), jnp.asarray(batch["support_columns"]))
    ours = np.asarray(jax.jit(objective.log_probs)(tiny_variables, jnp.asarray(batch["text"]), support))
    # fp32 against float64 (the update) and cached decoding against float64 (the sampler): the logits differ
    # by a forward pass's roundings (decoder_ulps of the largest logit), which dividing by the temperature
    # scales by 1/0.7 (and rounds once); a log-softmax moves by at most twice its logits' error, and its
    # 5-term sum and log add a few roundings of values up to log 5 + 2 logit / 0.7. Bound 1.1e-5; observed at most
    # 2.2e-7 (the update) and 1.9e-7 (the sampler) over rollout keys 0-3.
    logit = float(np.abs(logits).max())
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=SEQ + 1, libraries=1)
    bound = 2 * ulp_bound(ulps + 1, logit / temperature) + ulp_bound(8, math.log(k) + 2 * logit / temperature)
    assert_within(ours[rows, columns - 1], np.asarray(expected), bound, "the update's sampled likelihoods")
    assert_within(batch["sampled_log_probs"][rows, columns], np.asarray(expected), bound,
                  "the sampler's recorded likelihoods")
    # One update from the snapshot: the ratio is 1 within that, and the KL to the reference (scored under the
    # same distribution, the same computation on the same weights) an exact zero.
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.init_state()
    placed = place_batch(trainer.mesh, batch)
    state, first = trainer.compile_step(state, placed)(state, placed)
    count = float(first["stats"].ratio.count)
    assert float(first["stats"].kl.total) == 0.0
    assert abs(float(first["stats"].ratio.total) / count - 1.0) <= 2 * bound
