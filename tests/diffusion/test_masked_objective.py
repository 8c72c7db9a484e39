"""MaskedDiffusionObjective: the negative ELBO against a plain reference, packed rows, its refusals, and
Trainer.fit running it unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer, metrics, models
from dew.diffusion.discrete import MDLM
from dew.objectives.base import Step
from dew.objectives.diffusion import MaskedDiffusionObjective
from dew.objectives.lm import Samples
from dew.sampling import Sampling
from tests.diffusion.conftest import BIDIRECTIONAL, MASK_ID, VOCAB
from tests.tolerances import ulp_bound

SEQ = 24


def _batch(packed: bool):
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, SEQ)).astype(np.int32)
    if not packed:
        return {"text": tokens}
    lengths = [(10, 14), (24,), (5, 7, 4), (16,)]  # the last two rows end in padding
    segments, positions = np.zeros((4, SEQ), np.int32), np.zeros((4, SEQ), np.int32)
    for row, documents in enumerate(lengths):
        start = 0
        for number, length in enumerate(documents, 1):
            segments[row, start:start + length] = number
            positions[row, start:start + length] = np.arange(length)
            start += length
        tokens[row, start:] = 0
    return {"text": tokens, "text_segment_ids": segments, "text_positions": positions}


def _reference(objective, params, batch, key):
    """(loss total, real tokens, masked hits, masked count, the logits' sizes) from the whole float32
    logits, with the mask's logit at -inf, and the process's own times and masks."""
    process, model = objective.process, objective.model
    tokens = jnp.asarray(batch["text"])
    segments = batch.get("text_segment_ids")
    real = jnp.ones(tokens.shape, bool) if segments is None else jnp.asarray(segments) != 0
    time_key, mask_key = jax.random.split(key)
    t = process.sample_times(time_key, tokens.shape[0])
    noisy, masked = process.corrupt(mask_key, tokens, real, t)
    kwargs = {} if segments is None else dict(segment_ids=segments, positions=batch["text_positions"])
    output = model.apply(params, noisy, head=False, **kwargs)
    logits = output.logits().at[..., MASK_ID].set(-jnp.inf)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]
    weights = masked * (1.0 / t)[:, None]
    hits = (jnp.argmax(logits, -1) == tokens) & masked
    h, w = np.asarray(output.hidden, np.float64), np.asarray(output.head.weight, np.float64)
    sizes = dict(logit_terms=float((np.abs(h) @ np.abs(w)).max()), weights=np.asarray(weights, np.float64),
                 logits=np.asarray(logits, np.float64), masked=np.asarray(masked))
    return (float(jnp.sum(ce * weights)), float(jnp.sum(real)), int(jnp.sum(hits)), int(jnp.sum(masked)), sizes)


@pytest.mark.parametrize("packed", [False, True], ids=["windows", "packed"])
def test_the_loss_is_the_nelbo_per_real_token(masked_model, masked_variables, process, packed):
    objective = MaskedDiffusionObjective(masked_model, process, seq_len=SEQ)
    batch = _batch(packed)
    key = jax.random.key(5)
    stats, effects = objective.loss(masked_variables, {k: jnp.asarray(v) for k, v in batch.items()},
                                    Step(jnp.int32(0), key))
    total, real, hits, masked, sizes = _reference(objective, masked_variables, batch, key)
    assert effects == {} and float(stats.loss.count) == real == (SEQ * 4 if not packed else SEQ * 4 - 8 - 8)
    assert float(stats.masked_fraction.total) == masked == float(stats.masked_accuracy.count)
    # fp32, one library; the hidden states are the same (one forward, the same inputs). A token's cross
    # entropy moves by `shift` nats between the chunked head (4 vocabulary tiles, the mask's column cut
    # out) and the whole logits: two logits (32-term dot products of terms up to `logit_terms`), the
    # normaliser (48 exps summed, a log, 2 rescalings a tile). The loss sums the masked tokens' weighted
    # terms, all positive: 96 roundings of the total. Observed: 0 and 1.2e-4 on totals of 690 and 620, against
    # bounds of 1.9e-2 and 1.7e-2.
    lse = np.log(np.exp(sizes["logits"] - sizes["logits"].max(-1, keepdims=True)).sum(-1)) + sizes["logits"].max(-1)
    shift = ulp_bound(2 * 32 * sizes["logit_terms"] + 48 + 1 + np.abs(lse).max() + 2 * 4)
    bound = shift * sizes["weights"].sum() + ulp_bound(96, abs(total))
    np.testing.assert_allclose(float(stats.loss.total), total, atol=bound, rtol=0)
    # The argmax may differ only where the top two logits lie within two shifts of each other.
    top2 = np.sort(sizes["logits"], -1)[..., -2:]
    near_ties = int(((top2[..., 1] - top2[..., 0] <= 2 * shift) & sizes["masked"]).sum())
    assert abs(float(stats.masked_accuracy.total) - hits) <= near_ties


def test_packed_documents_attend_within_themselves_in_both_directions(masked_model, masked_variables):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 12)), jnp.int32)
    segments = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3], jnp.int32)
    positions = jnp.asarray([list(range(5)) + list(range(4)) + [0] * 3], jnp.int32)
    hidden = lambda ids: np.asarray(masked_model.apply(masked_variables, ids, segment_ids=segments,
                                                       positions=positions, head=False).hidden)
    before = hidden(tokens)
    later = hidden(tokens.at[0, 4].set((tokens[0, 4] + 1) % VOCAB))  # document 1's last token
    assert not np.allclose(later[0, 0], before[0, 0])  # read by document 1's first position
    np.testing.assert_array_equal(later[0, 5:9], before[0, 5:9])  # and by no position of document 2
    other = hidden(tokens.at[0, 6].set((tokens[0, 6] + 1) % VOCAB))
    np.testing.assert_array_equal(other[0, :5], before[0, :5])


def test_the_mask_logit_gets_no_gradient(masked_model, masked_variables, process):
    objective = MaskedDiffusionObjective(masked_model, process, seq_len=SEQ)
    batch = {k: jnp.asarray(v) for k, v in _batch(False).items()}
    numerator = lambda p: objective.reduce_loss(objective.loss({"params": p}, batch,
                                                               Step(jnp.int32(0), jax.random.key(2)))[0])[0]
    grads = jax.jit(jax.grad(numerator))(masked_variables["params"])
    head = np.asarray(grads["lm_head"]["kernel"])
    assert (head[:, MASK_ID] == 0).all() and np.abs(head[:, :MASK_ID]).sum() > 0


def test_trainer_fit_runs_it_unchanged(masked_model, process):
    objective = MaskedDiffusionObjective(masked_model, process, seq_len=16, ema_decay=0.9)
    rng = np.random.default_rng(0)

    def rows(count):
        # Counting sequences: every token follows from its neighbours, so a bidirectional model learns them.
        return ((rng.integers(0, VOCAB, (count, 1)) + np.arange(16)) % VOCAB).astype(np.int32)

    held_out = [{"text": rows(8)} for _ in range(2)]
    data = Dataset(train=lambda partition: iter(lambda: {"text": rows(8)}, None),
                   val=lambda partition: iter(held_out), records=1000, batch=8)
    trainer = Trainer(objective, optax.adamw(3e-3), key=jax.random.key(0))
    state = trainer.fit(data, steps=40, log_every=20, eval_every=40, metrics=(metrics.perplexity(),),
                        accumulation=2, verbose=False)
    logged = [row for row in trainer.history if "train/loss" in row]
    assert logged[-1]["train/loss"] < logged[0]["train/loss"]
    assert {"train/masked_accuracy", "train/masked_fraction", "train/perplexity"} <= set(logged[-1])
    evaluation = next(row for row in trainer.history if "val/loss" in row)
    # The pass-level metric is exp of the summed loss over the summed real tokens: the same two sums.
    np.testing.assert_allclose(evaluation["val/perplexity"], np.exp(evaluation["val/loss"]), rtol=1e-12)
    assert int(state.step) == 40


def test_bad_input_is_refused_with_the_fix(masked_model, process):
    causal = models.build("causal_transformer", **{**BIDIRECTIONAL, "causal": True})
    with pytest.raises(ValueError, match=r"the model is causal \(causal=True\).*build it with causal=False"):
        MaskedDiffusionObjective(causal, process, seq_len=SEQ)
    with pytest.raises(ValueError, match=rf"mask_id {VOCAB + 1} is outside the model's vocab_size {VOCAB + 1}: .* "
                                         rf"vocab_size={VOCAB + 2}"):
        MaskedDiffusionObjective(masked_model, MDLM(mask_id=VOCAB + 1)(), seq_len=SEQ)
    with pytest.raises(ValueError, match="seq_len 64 is longer than the model's max_seq_len 48"):
        MaskedDiffusionObjective(masked_model, process, seq_len=64)
    with pytest.raises(ValueError, match="masked-diffusion previews unmask with the process's sampler"):
        MaskedDiffusionObjective(masked_model, process, seq_len=SEQ,
                                 samples=Samples([1, 2], 4, sampling=Sampling(temperature=0.5)))
    objective = MaskedDiffusionObjective(masked_model, process, seq_len=SEQ)
    with pytest.raises(ValueError, match=rf"token rows have shape \(2, {SEQ + 1}\); .*reads \[B, {SEQ}\], exactly "
                                         rf"seq_len ids \(no next-token shift\): load windows with seq_len={SEQ - 1}"):
        objective.check_batch({"text": np.zeros((2, SEQ + 1), np.int32)})
    clean = np.zeros((2, SEQ), np.int32)
    for row, column, value, message in ((1, 3, MASK_ID, f"is the mask id {MASK_ID}: the mask needs an id"),
                                        (0, 0, VOCAB + 5, f"is outside vocab_size {VOCAB + 1}")):
        bad = clean.copy()
        bad[row, column] = value
        with pytest.raises(ValueError, match=f"token id {value} at row {row}, column {column} {message}"):
            objective.check_batch({"text": bad})
    with pytest.raises(ValueError, match="text_segment_ids has shape"):
        objective.check_batch({"text": clean, "text_segment_ids": np.ones((2, SEQ - 1), np.int32)})


def test_pipeline_publishes_the_state_as_a_masked_generation(masked_model, process):
    from dew.data import ByteTokenizer
    from dew.inference import MaskedGeneration

    objective = MaskedDiffusionObjective(masked_model, process, seq_len=16, ema_decay=0.5,
                                         samples=Samples([1, 2], 5))
    state = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).init_state()
    state = state.replace(params=jax.tree_util.tree_map(lambda x: x * 2.0, state.params))  # live != averaged
    task = objective.pipeline(state, processor=ByteTokenizer())
    assert isinstance(task, MaskedGeneration) and task.params is state.ema and task.process is process
    assert task.max_new_tokens == 5 and objective.pipeline(state, ema=False).params is state.params
    result = task([[3, 4]], seed=1, steps=4)
    assert result.tokens.shape == (1, 7) and list(result.refinements) == [4]
