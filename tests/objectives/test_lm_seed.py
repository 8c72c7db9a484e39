"""LMObjective's seed details: the accuracy flag in the compiled step, the refusals the API reference
names, the defaults it gives, and which weights and processes previews use."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data.dataset import Dataset
from dew.data.inputs import ModelInputs
from dew.objectives.base import Mean, Step
from dew.objectives.lm import LMObjective, Samples
from dew.sampling import Sampling
from dew.training.mesh import place_batch

SEQ = 8
STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))
# The accuracy's argmax (dew.nn.head) is the first column holding a row's maximum: Dew's
# kernel (`dew_softmax_first_max`) where it runs, else a minimum over int32 columns, a reduction
# nothing else in the step makes. (jnp.argmax would lower to StableHLO's variadic reduce, (values,
# indices) together; none of the three must appear without accuracy.)
ARGMAX = re.compile(r"stablehlo\.reduce\(%[\w#.]+ init: %[\w#.]+\), \(%[\w#.]+ init: %[\w#.]+\)"
                    r"|applies stablehlo\.minimum across dimensions = \[\d+\] : \(tensor<[\dx]+xi32>"
                    r"|@dew_softmax_first_max")


def _tokens(seed: int = 0, rows: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, (rows, SEQ + 1)).astype(np.int32)


def test_token_accuracy_false_takes_no_argmax_in_the_compiled_step(tiny_model, tiny_variables):
    lowered = {}
    for accuracy in (True, False):
        objective = LMObjective(tiny_model, SEQ, ema_decay=None, token_accuracy=accuracy)
        trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
        state = trainer.init_state()
        batch = place_batch(trainer.mesh, {"text": _tokens()})
        step_text = jax.jit(trainer._train_step(1)).lower(state, batch).as_text()
        # token_scores returns `correct` to its caller, so nothing downstream can prune the argmax away.
        scores_text = jax.jit(objective.token_scores).lower(tiny_variables, jnp.asarray(_tokens())).as_text()
        lowered[accuracy] = (len(ARGMAX.findall(step_text)), len(ARGMAX.findall(scores_text)))
    assert lowered[True][0] >= 1 and lowered[True][1] >= 1
    assert lowered[False] == (0, 0)


def test_token_accuracy_changes_only_what_is_reported(tiny_model, tiny_variables):
    batch = {"text": jnp.asarray(_tokens(1))}
    with_accuracy = LMObjective(tiny_model, SEQ, token_accuracy=True).loss(tiny_variables, batch, STEP)[0]
    without = LMObjective(tiny_model, SEQ, token_accuracy=False).loss(tiny_variables, batch, STEP)[0]
    # The same scan computes the same log-sum-exp either way: bit-identical.
    assert float(with_accuracy.loss.total) == float(without.loss.total)
    assert without.token_accuracy is None and 0.0 <= float(with_accuracy.token_accuracy.value) <= 1.0
    assert LMObjective(tiny_model, SEQ, token_accuracy=False).token_scores(tiny_variables, batch["text"]).correct is None


def test_seq_aux_without_a_balance_loss_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"seq_aux=False.*aux_loss_alpha is unset.*leave seq_aux at True"):
        LMObjective(tiny_model, SEQ, seq_aux=False)


def test_qk_stats_are_the_models_maxima_in_scores_statistics_and_the_log(tiny_model, tiny_variables):
    """token_scores keeps each row's maxima (tests/nn/test_qk_stats.py checks them against q and k); the
    statistics keep the batch's largest, a window of micro-batches and a log window of steps the
    largest of theirs, and the log names the largest and each layer's."""
    rows = _tokens(3, rows=4)
    inputs = ModelInputs(jnp.asarray(rows), {"attention_mask": jnp.asarray(np.arange(SEQ + 1) >= [[0], [2], [0], [5]])})
    objective = LMObjective(tiny_model, SEQ, ema_decay=None, qk_stats=True)
    scores = objective.token_scores(tiny_variables, inputs, qk_stats=True)
    aux = tiny_model.apply(tiny_variables, inputs.tokens[:, :-1], head=False, qk_stats=True,
                           attention_mask=inputs.token_fields["attention_mask"][:, :-1]).aux
    np.testing.assert_array_equal(scores.qk_max, aux["qk_max"])
    assert scores.qk_max.shape == (2, 4, 4)  # [attention layers, rows, heads]
    assert objective.token_scores(tiny_variables, inputs).qk_max is None
    stats = objective.loss(tiny_variables, {"text": inputs}, STEP)[0]
    np.testing.assert_array_equal(stats.qk_max.value, np.max(scores.qk_max, axis=1))
    # two steps of two micro-batches, one log line: the largest of all four halves
    data = Dataset(train=lambda partition: iter([{"text": rows}, {"text": _tokens(4, rows=4)}]), val=None,
                   records=8, batch=4)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0))
    state = trainer.fit(data, steps=2, log_every=2, accumulation=2, verbose=False)  # a rate of 0 moves nothing
    logged = trainer.history[-1]
    each = [LMObjective(tiny_model, SEQ).token_scores(state.params, jnp.asarray(batch), qk_stats=True).qk_max
            for batch in (rows, _tokens(4, rows=4))]
    largest_L = np.max(np.concatenate(each, axis=1), axis=(1, 2))
    assert logged["train/qk_max"] == pytest.approx(float(largest_L.max()), rel=1e-6)
    assert [logged[f"train/qk_max/layers_{i}"] for i in (0, 1)] == pytest.approx(largest_L.tolist(), rel=1e-6)
    plain = Trainer(LMObjective(tiny_model, SEQ), optax.sgd(0.0), key=jax.random.key(0))
    plain.fit(data, steps=1, log_every=1, verbose=False)
    assert "train/qk_max" not in plain.history[-1]


def test_qk_stats_are_refused_for_a_model_without_attention():
    from dew.nn.mamba2 import Mamba2
    from dew.nn.transformer import CausalTransformer, DecoderConfig

    model = CausalTransformer(DecoderConfig(vocab_size=64, emb_features=32, num_layers=2, mlp_features=0,
                                            layer_types=("linear_attention",) * 2,
                                            recurrent=Mamba2(num_heads=2, head_dim=16, state_size=8)))
    with pytest.raises(ValueError, match=r"LMObjective\(qk_stats=True\).*no attention layer.*leave qk_stats unset"):
        LMObjective(model, SEQ, qk_stats=True)


@pytest.mark.parametrize("keyword, missing", [("depths", "mtp_depths 0"), ("indexer", "lightning indexer")])
def test_token_scores_refuses_reports_the_model_cannot_give(tiny_model, tiny_variables, keyword, missing):
    """Multi-token prediction and the indexer are built (tests/objectives/test_mtp.py, test_indexer.py); a
    model without them is refused by name."""
    objective = LMObjective(tiny_model, SEQ)
    with pytest.raises(ValueError, match=rf"token_scores\({keyword}=True\).*{missing}"):
        objective.token_scores(tiny_variables, jnp.asarray(_tokens()), **{keyword: True})


@pytest.mark.parametrize("keyword, value, shown", [
    ("routing", True, "routing=True"),
    ("routes", (np.zeros((2, SEQ + 1, 2, 1), np.int32), None), r"routes=\(<array of shape \(2, 9, 2, 1\)>"),
])
def test_token_scores_refuses_routing_without_a_mixture(tiny_model, tiny_variables, keyword, value, shown):
    objective = LMObjective(tiny_model, SEQ)
    with pytest.raises(ValueError, match=rf"token_scores\({shown}.*reads the routers of a mixture of experts, and this "
                                         "model has none"):
        objective.token_scores(tiny_variables, jnp.asarray(_tokens()), **{keyword: value})


def test_token_scores_accepts_the_neutral_values(tiny_model, tiny_variables):
    objective = LMObjective(tiny_model, SEQ)
    tokens = jnp.asarray(_tokens())
    plain = objective.token_scores(tiny_variables, tokens)
    neutral = objective.token_scores(tiny_variables, tokens, routing=False, depths=False, roles=None, qk_stats=False,
                                     indexer=False, layers=[], routes=None)
    np.testing.assert_array_equal(neutral.losses, plain.losses)


def test_samples_default_to_the_default_sampling():
    assert Samples(prompt=[1], max_new_tokens=2).sampling == Sampling()


def test_reduce_loss_takes_a_plain_mean(tiny_model, tiny_variables):
    stats = LMObjective(tiny_model, SEQ).loss(tiny_variables, {"text": jnp.asarray(_tokens())}, STEP)[0]
    assert LMObjective.reduce_loss(Mean(jnp.asarray(3.0), jnp.asarray(4.0))) == (3.0, 4.0)
    assert LMObjective.reduce_loss(stats) == (stats.loss.total, stats.loss.count)


def test_attention_dropout_is_refused_for_training_not_for_generation(tiny_model):
    from dew.sampling import generate

    config = dataclasses.replace(tiny_model.config, attention_dropout=0.1)
    model = dataclasses.replace(tiny_model, config=config)
    with pytest.raises(NotImplementedError, match="attention_dropout is 0.1: Dew does not apply attention dropout"):
        LMObjective(model, SEQ)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32), head=False)
    generation = generate(model, variables, [[1, 2]], 2, key=jax.random.key(0), sampling=Sampling(temperature=0.0))
    assert len(generation.host().tokens[0]) == 2 + 2  # the prompt and the new tokens


def test_previews_decode_on_process_zero_only(tiny_model, tiny_variables, monkeypatch):
    objective = LMObjective(tiny_model, SEQ, samples=Samples(prompt=[1, 2], max_new_tokens=2))
    texts = objective.preview(tiny_variables, None, STEP)
    # the default decode prints the ids as Python ints: "[1, 2, ...]", never "[np.int32(1), ...]"
    assert len(texts) == 1 and texts[0].startswith("[1, 2, ") and "np." not in texts[0]
    monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: 1)
    assert objective.preview(tiny_variables, None, STEP) is None


class _Texts:
    """A tracker that keeps the preview texts."""

    def __init__(self):
        self.seen = []

    def start(self, step):
        pass

    def scalars(self, step, values):
        pass

    def texts(self, step, name, texts):
        self.seen.extend(texts)

    def close(self):
        pass


def test_previews_draw_from_the_live_policy_when_the_ema_is_a_frozen_reference(tiny_model):
    greedy = Samples(prompt=[1, 2, 3], max_new_tokens=4, sampling=Sampling(temperature=0.0))
    objective = LMObjective(tiny_model, SEQ, ema_decay=1.0, samples=greedy)
    rows = _tokens(2, rows=4)
    data = Dataset(train=lambda partition: iter([{"text": rows}]), val=lambda partition: iter([{"text": rows}]),
                   records=4, batch=4)
    recorder = _Texts()
    trainer = Trainer(objective, optax.sgd(5.0), key=jax.random.key(0))
    state = trainer.fit(data, steps=1, eval_every=1, verbose=False, trackers=[recorder])
    live, frozen = objective.preview(state.params, None, STEP), objective.preview(state.ema, None, STEP)
    assert live != frozen  # one large step moves the greedy continuation, so the test tells them apart
    assert recorder.seen == live
