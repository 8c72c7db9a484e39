"""The sampling filters against transformers' own logits processors, and sampled frequencies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.sampling import Sampling
from dew.sampling.sampling import categorical, first_maximum
from tests.tolerances import ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.generation import logits_process as hf  # noqa: E402

CASES = {
    "temperature": (Sampling(temperature=0.7), [hf.TemperatureLogitsWarper(0.7)]),
    "top-k": (Sampling(temperature=1.3, top_k=5), [hf.TemperatureLogitsWarper(1.3), hf.TopKLogitsWarper(5)]),
    "top-p": (Sampling(temperature=0.9, top_p=0.8), [hf.TemperatureLogitsWarper(0.9), hf.TopPLogitsWarper(0.8)]),
    "min-p": (Sampling(temperature=1.0, min_p=0.1), [hf.MinPLogitsWarper(0.1)]),
    # A p below every token's probability keeps the most likely one (transformers' min_tokens_to_keep=1);
    # 1e-40 is a float32 denormal, which a CPU that flushes denormals reads as 0.
    "top-p-below-every-token": (Sampling(temperature=0.9, top_p=1e-40),
                                [hf.TemperatureLogitsWarper(0.9), hf.TopPLogitsWarper(1e-40)]),
    "all": (
        Sampling(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        [hf.RepetitionPenaltyLogitsProcessor(1.3), hf.TemperatureLogitsWarper(0.8), hf.TopKLogitsWarper(12),
         hf.TopPLogitsWarper(0.9), hf.MinPLogitsWarper(0.05)],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_filters_match_transformers(case):
    sampling, processors = CASES[case]
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(6, 40)) * 3).astype(np.float32)
    history = rng.integers(0, 40, (6, 9))
    seen = np.zeros((6, 40), bool)
    np.put_along_axis(seen, history, True, axis=1)
    ours = np.asarray(sampling.filter(jnp.asarray(logits), jnp.asarray(seen)))
    scores = torch.from_numpy(logits.copy())
    for processor in processors:
        scores = processor(torch.from_numpy(history), scores)
    theirs = scores.numpy()
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    finite = np.isfinite(theirs)
    # A kept logit is divided by the penalty and the temperature, each a division or a product by the
    # reciprocal (up to 2 roundings a side), so 4 ulps of itself apart. Observed: 1 ulp (1.2e-7).
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=ulp_bound(4), atol=0)


def test_sampled_frequencies_follow_the_filtered_distribution():
    sampling = Sampling(temperature=0.9, top_k=4, top_p=0.95)
    logits = jnp.asarray([[2.0, 1.5, 1.0, 0.2, -0.5, 0.0]], jnp.float32)
    probs = np.asarray(jax.nn.softmax(sampling.filter(logits), axis=-1))[0]
    draws = 20000
    keys = jax.random.split(jax.random.key(42), draws)
    tokens, _ = jax.jit(lambda k: sampling.draw(k, jnp.repeat(logits, draws, axis=0)))(keys)
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[probs == 0].sum() == 0
    # Each kept token's frequency lies within 5 standard deviations of its probability: a statistical
    # bound, not a rounding one (fixed seed; observed at most 1.8 standard deviations).
    sigma = np.sqrt(probs * (1 - probs) / draws)
    np.testing.assert_array_less(np.abs(counts / draws - probs), 5 * sigma + 1e-12)


def test_greedy_takes_the_first_maximum_and_reports_its_log_probability():
    logits = jnp.asarray([[0.0, 3.0, 3.0, 1.0]], jnp.float32)
    token, log_prob = Sampling(temperature=0.0).draw(jax.random.split(jax.random.key(0), 1), logits)
    assert int(token[0]) == 1
    # The same log_softmax of the same float32 logits, at most in another program: a 4-term sum, an exp,
    # a log and two subtractions, 7 roundings of terms up to 3. Observed: equal.
    np.testing.assert_allclose(float(log_prob[0]), float(jax.nn.log_softmax(logits)[0, 1]), atol=ulp_bound(7, 3.0),
                               rtol=0)


# 49,152 (SmolLM2's vocabulary): XLA's CPU backend reduces a row that long in a library whose maximum skips NaNs
@pytest.mark.parametrize("vocab", [50, 128 * 5, 49152], ids=["flat", "blocks", "vocabulary"])
def test_first_maximum_is_argmax_with_ties_nans_and_infinities(vocab):
    rows = np.random.default_rng(2).normal(size=(9, vocab)).astype(np.float32)
    rows[1, [7, 30]] = 9.0  # a tie: the first
    rows[2, [12, 40]] = np.nan  # NaNs: the first, as argmax
    rows[2, 3] = np.inf
    rows[3] = -np.inf
    rows[4, vocab - 1] = np.inf
    rows[5, :] = 0.0
    rows[6, [vocab - 1, 41]] = 7.0  # a tie across blocks, the later one in the block read first
    rows[7, [vocab - 2, 45]] = [np.nan, 8.0]  # a NaN after the maximum
    rows[8, [vocab - 1, 3]] = [np.inf, np.nan]  # a NaN before an infinity
    np.testing.assert_array_equal(np.asarray(jax.jit(first_maximum)(jnp.asarray(rows))), np.argmax(rows, axis=-1))


def test_categorical_draws_what_jax_random_categorical_draws():
    # The same noise from the same keys and the same first maximum: equal tokens, not close ones, over rows
    # with filtered (-inf) entries, ties of logits and a row of one certain token.
    rows = np.random.default_rng(3).normal(size=(16, 3000)).astype(np.float32) * 4
    rows[1, ::3] = -np.inf
    rows[2, 100:200] = 2.5
    rows[3, :] = -np.inf
    rows[3, 17] = 0.0
    old = jax.jit(jax.vmap(jax.random.categorical))
    new = jax.jit(categorical)
    for seed in range(8):
        keys = jax.random.split(jax.random.key(seed), rows.shape[0])
        logits = jnp.asarray(rows * (1 + seed % 3))
        np.testing.assert_array_equal(np.asarray(new(keys, logits)), np.asarray(old(keys, logits)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_top_p_that_keeps_no_token_draws_the_most_likely_one(jit):
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(8, 40)) * 3, jnp.float32)
    sampling = Sampling(temperature=1.0, top_p=1e-40)
    draw = jax.jit(sampling.draw) if jit else sampling.draw
    tokens, log_probs = draw(jax.random.split(jax.random.key(0), 8), logits)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits), axis=-1))
    np.testing.assert_array_equal(np.asarray(log_probs), 0.0)  # the only token kept: probability 1


def test_bad_sampling_is_refused_by_name():
    for kwargs, message in (({"top_k": 0}, "top_k is 0"), ({"top_p": 1.5}, "top_p is 1.5"),
                            ({"min_p": -0.1}, "min_p is -0.1"), ({"repetition_penalty": 0.0}, "repetition_penalty is 0.0")):
        with pytest.raises(ValueError, match=message):
            Sampling(**kwargs)
