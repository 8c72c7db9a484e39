"""SampledRollout: its rows are what `LMObjective.policy` draws with the same key, laid out as a batch
(prompt, completion mask, both likelihoods in the completion's columns, padding); its refusals."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.objectives.lm import LMObjective, SampledRollout
from dew.sampling import Sampling
from tests.tolerances import assert_within, decoder_ulps, ulp_bound

SEQ = 8
EOS = 2
PROMPTS = [[5, 9, 12], [7, 1, 30, 4]]


def test_a_rollout_lays_out_what_the_policy_draws_with_the_same_key(tiny_model, tiny_variables):
    objective = LMObjective(tiny_model, SEQ)
    sampling = Sampling(eos_token_ids=(EOS,), pad_id=0)
    batch = SampledRollout(objective, sampling, group_size=3, max_new_tokens=4)(tiny_variables, PROMPTS,
                                                                                  jax.random.key(3))
    drawn = objective.policy(tiny_variables, sampling)(PROMPTS, 4, key=jax.random.key(3), n=3)
    assert sorted(batch) == ["completion", "policy_log_probs", "sampled_log_probs", "text"]
    for name, dtype in (("text", np.int32), ("completion", np.int32), ("sampled_log_probs", np.float32),
                        ("policy_log_probs", np.float32)):
        assert batch[name].shape == (6, SEQ + 1) and batch[name].dtype == dtype, name
    completions = drawn.continuations()
    for row, completion in enumerate(completions):
        prompt = PROMPTS[row // 3]  # rows grouped by prompt
        start, end = len(prompt), len(prompt) + len(completion)
        assert batch["text"][row].tolist() == prompt + completion + [0] * (SEQ + 1 - end)
        assert batch["completion"][row].tolist() == [0] * start + [1] * len(completion) + [0] * (SEQ + 1 - end)
        # The same draw, so the same numbers, bit for bit; nothing outside the completion.
        np.testing.assert_array_equal(batch["sampled_log_probs"][row, start:end], drawn.log_probs[row, :len(completion)])
        np.testing.assert_array_equal(batch["policy_log_probs"][row, start:end],
                                      drawn.policy_log_probs[row, :len(completion)])
        for name in ("sampled_log_probs", "policy_log_probs"):
            assert not batch[name][row, :start].any() and not batch[name][row, end:].any()
    # At unit temperature without filters the sampler's distribution is the raw policy's: the two
    # likelihoods come from the cached decode and a teacher-forced pass (fp32, same weights), whose logits
    # differ by a forward pass's roundings in another order (decoder_ulps of the largest logit); a
    # log-softmax moves by at most twice that, and its 64-term sum adds 66 roundings of 1. Observed at
    # most 4.8e-7 over keys 0-3.
    mask = batch["completion"] > 0
    logit = float(np.abs(np.asarray(tiny_model.apply(tiny_variables, jnp.asarray(batch["text"])))).max())
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=SEQ + 1, libraries=1)
    bound = 2 * ulp_bound(ulps, logit) + ulp_bound(66, 1.0) + ulp_bound(2, math.log(64) + 2 * logit)
    assert_within(batch["sampled_log_probs"][mask], batch["policy_log_probs"][mask], bound,
                  "the sampler's and the raw policy's likelihoods")


def test_a_rollout_refuses_what_does_not_fit_the_rows(tiny_model):
    objective = LMObjective(tiny_model, SEQ)
    with pytest.raises(ValueError, match=r"max_new_tokens is 9; it must lie in \[1, seq_len 8\]"):
        SampledRollout(objective, max_new_tokens=9)
    with pytest.raises(ValueError, match="group_size is 0; draw at least 1 completion per prompt"):
        SampledRollout(objective, group_size=0)
    with pytest.raises(ValueError, match=r"a prompt of 6 tokens plus max_new_tokens 4 is beyond seq_len \+ 1 = 9"):
        SampledRollout(objective, max_new_tokens=4)(None, [[1] * 6], jax.random.key(0))
