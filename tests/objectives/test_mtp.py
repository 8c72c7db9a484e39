"""Multi-token prediction in LMObjective: `mtp_weight` checked by hand, per-depth scores over packed and
padded rows, accumulation, and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.transformer import CausalTransformer, DecoderConfig
from dew.objectives.base import Mean, Step
from dew.objectives.lm import LMObjective
from tests.compiled import compiled

CONFIG = dict(vocab_size=40, emb_features=32, num_layers=2, num_heads=4, mlp_features=48, max_seq_len=32, mtp_depths=2,
              latent=dict(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=4, value_dim=6),
              mixture=dict(experts=4, top_k=2, layers=(1,), score_function="sigmoid", bias=True, shared_features=16))
SEQ = 10
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))  # the loss runs with the step's key as dropout rng
TOKENS = np.random.default_rng(0).integers(1, 40, (2, SEQ + 1))
# row 0: two documents (the second starts at column 6); row 1: one document ending in 3 padding tokens
SEGMENTS = np.array([[1] * 6 + [2] * 5, [1] * 8 + [0] * 3])


@pytest.fixture(scope="module")
def setup():
    model = CausalTransformer(DecoderConfig(**CONFIG))
    objective = LMObjective(model, SEQ, mtp_weight=0.3)
    return model, objective, compiled(objective.init, jax.random.key(0))


def test_depth_weights_follow_documents_and_padding(setup):
    """Depth d at position p scores token p + d + 1: counted only where columns p to p + d + 1 are one document."""
    _, objective, variables = setup
    scores = compiled(objective.token_scores, variables, jnp.asarray(TOKENS), segment_ids=jnp.asarray(SEGMENTS),
                      depths=True)
    weights = np.asarray(scores.depths.weights)
    assert weights.shape == (2, 2, SEQ)
    segments = SEGMENTS
    for depth in (1, 2):
        for row in range(2):
            for p in range(SEQ):
                span = segments[row, p:p + depth + 2]
                expected = float(len(span) == depth + 2 and span[0] != 0 and (span == span[0]).all())
                assert weights[depth - 1, row, p] == expected, (depth, row, p)


@pytest.mark.slow
def test_mtp_weight_is_the_mean_over_depths_over_the_main_target_mass(setup):
    """By hand from the full logits (log-softmax in float64): the term is 0.3 * mean over depths of each
    depth's summed CE, divided like the main CE by the mass of main targets. Both sides are fp32 sums of
    the same 22 per-token losses of size ~4, so 1e-5 relative covers their different order."""
    model, objective, variables = setup
    tokens, segments = jnp.asarray(TOKENS), jnp.asarray(SEGMENTS)
    stats, _ = compiled(objective.loss, variables, {"text": tokens, "text_segment_ids": segments}, STEP)
    output = model.apply(variables, tokens[:, :-1], segment_ids=segments[:, :-1], head=False, depths=True)
    log_probs = jax.nn.log_softmax(np.asarray(output.head.logits(output.aux["depths"]), np.float64), axis=-1)
    weights = np.asarray(compiled(objective.token_scores, variables, tokens, segment_ids=segments,
                                  depths=True).depths.weights)
    sums = []
    for depth in (1, 2):
        total = 0.0
        for row in range(2):
            for p in range(SEQ - depth):
                target = TOKENS[row, p + depth + 1]
                total -= weights[depth - 1, row, p] * log_probs[depth - 1, row, p, target]
        sums.append(total)
    main_mass = float(np.sum((SEGMENTS[:, 1:] == SEGMENTS[:, :-1]) & (SEGMENTS[:, 1:] != 0)))
    assert float(stats.terms["mtp"].count) == main_mass == float(stats.ce.count)
    np.testing.assert_allclose(float(stats.terms["mtp"].total), 0.3 * np.mean(sums), rtol=1e-5)
    summary = objective.summarize(stats)
    assert summary["loss"] == pytest.approx(summary["ce"] + summary["mtp"], rel=1e-6)


@pytest.mark.slow
def test_two_micro_batches_equal_one_batch(setup):
    """Accumulation adds numerators and the main target mass, then divides once: the rows scored apart
    and together give one loss (fp32 sums in another order: 1e-6 relative)."""
    _, objective, variables = setup
    batch = {"text": jnp.asarray(TOKENS), "text_segment_ids": jnp.asarray(SEGMENTS)}
    whole, _ = compiled(objective.loss, variables, batch, STEP)
    parts = [compiled(objective.loss, variables, {k: v[i:i + 1] for k, v in batch.items()}, STEP)[0] for i in range(2)]
    totals = objective.totals_of(whole)
    accumulated = sum(float(objective.window_loss(part, totals)[0]) for part in parts)
    np.testing.assert_allclose(accumulated, float(objective.window_loss(whole, totals)[0]), rtol=1e-6)
    assert isinstance(whole.terms["mtp"], Mean)


def test_refusals_name_the_fix():
    plain = CausalTransformer(DecoderConfig(**{**CONFIG, "mtp_depths": 0}))
    with pytest.raises(ValueError, match="mtp_depths 0"):
        LMObjective(plain, SEQ, mtp_weight=0.3)
    with pytest.raises(ValueError, match="leave depths unset"):
        LMObjective(plain, SEQ).token_scores({}, jnp.asarray(TOKENS), depths=True)
    with pytest.raises(ValueError, match="weight >= 0"):
        LMObjective(CausalTransformer(DecoderConfig(**CONFIG)), SEQ, mtp_weight=-1.0)
    with pytest.raises(ValueError, match="mtp_depths is -1"):
        DecoderConfig(**{**CONFIG, "mtp_depths": -1})
