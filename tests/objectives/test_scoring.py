"""LMObjective's policy scoring and chat masks: per_token_log_probs against transformers, sampled_log_probs
at a temperature and over a kept support by hand, loss_role (also under accumulation), token_scores(layers=),
predict, ModelInputs batches, sessions.pack and the rollouts policy() draws."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.data.inputs import ModelInputs
from dew.objectives.base import Mean, Step
from dew.objectives.lm import LMObjective, LMStatistics, Role, sessions
from dew.nn.head import chunked_cross_entropy
from dew.sampling import Sampling
from dew.sharding import MeshSpec, place_batch
from tests.tolerances import LIBRARY_ULPS, assert_within, decoder_ulps, transformers_decoder_ulps, ulp_bound

STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))
SEQ = 8
SMALL = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=64, max_seq_len=64)
A, U, N = int(Role.ASSISTANT), int(Role.USER), int(Role.NONE)


def _log_softmax64(logits):
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - (np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top)


def _softmax_bound(logit_error, logits):
    """How far two log-softmaxes of logits `logit_error` apart may be: the target's logit and the
    log-sum-exp move by at most that each, and each side rounds its own log-sum-exp (a V-term sum of
    exps, and a log: V + 2 LIBRARY_ULPS ulps of it)."""
    logits = np.asarray(logits, np.float64)
    lse = np.abs(_log_softmax64(logits) - logits).max()
    return 2 * logit_error + 2 * ulp_bound(logits.shape[-1] + 2 * LIBRARY_ULPS, lse)


# -- against transformers ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The interop tests' tiny transformers Llama (weights of order one), loaded into Dew: (objective,
    variables, torch model)."""
    pytest.importorskip("transformers")
    from dew.interop import load_pretrained
    from tests.interop.conftest import save_checkpoint, torch_model

    model = torch_model("llama")
    bundle = load_pretrained(save_checkpoint(model, tmp_path_factory.mktemp("llama")))
    return LMObjective(bundle.model, 16, ema_decay=None), bundle.variables, model


def _torch_log_probs(torch_model, rows):
    """transformers' log-softmax of its logits at each row's next tokens, one unpadded row at a time."""
    import torch

    out = []
    for row in rows:
        with torch.no_grad():
            logits = torch_model(torch.as_tensor([row])).logits[0].float()
        log_probs = torch.log_softmax(logits, -1)[:-1].gather(1, torch.as_tensor(row[1:])[:, None])[:, 0]
        out.append((log_probs.numpy(), logits.numpy()))
    return out


@pytest.mark.slow
def test_per_token_log_probs_equal_transformers_log_softmax_with_and_without_left_padding(llama):
    objective, variables, torch_model = llama
    rng = np.random.default_rng(0)
    width, pads = 12, np.asarray([0, 3, 5])
    real = [rng.integers(0, 97, width - p).tolist() for p in pads]
    theirs = _torch_log_probs(torch_model, real)
    padded = np.stack([np.concatenate([rng.integers(0, 97, p), row]) for p, row in zip(pads, real)]).astype(np.int32)
    mask = np.arange(width)[None, :] >= pads[:, None]
    score = jax.jit(objective.per_token_log_probs)
    plain = np.asarray(score(variables, jnp.asarray(padded[:1])))
    shifted = np.asarray(score(variables, jnp.asarray(padded), left_padding=jnp.asarray(pads)))
    masked = np.asarray(score(variables, ModelInputs.of(padded, attention_mask=mask)))
    # Logits: the decoder's fp32 roundings against transformers' over 12 tokens (transformers_decoder_ulps
    # of the largest logit); the log-softmax moves by twice that plus each side's log-sum-exp roundings.
    # Observed: 1.9e-6 against a bound of 1.0e-3.
    for row, (pad, (expected, logits)) in enumerate(zip(pads, theirs)):
        assert np.abs(logits).max() > 2.0  # weights large enough for a wrong convention to show
        bound = _softmax_bound(ulp_bound(transformers_decoder_ulps(torch_model.config, width), np.abs(logits).max()),
                               logits)
        for ours in (shifted, masked):
            assert_within(ours[row, pad:], expected, bound, f"row {row}")
            assert np.all(ours[row, :pad] == 0.0)  # padded inputs: zero and unscored
    assert_within(plain[0], theirs[0][0], bound, "no padding")


def test_per_token_log_probs_refuse_bad_padding(llama):
    objective, variables, _ = llama
    tokens = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"left_padding 5 at row 1 is outside \[0, 4\]"):
        objective.per_token_log_probs(variables, tokens, left_padding=np.asarray([0, 5]))
    with pytest.raises(ValueError, match="one integer count per row"):
        objective.per_token_log_probs(variables, tokens, left_padding=np.asarray([0]))
    with pytest.raises(ValueError, match="give one or the other"):
        objective.per_token_log_probs(variables, ModelInputs.of(np.zeros((2, 6), np.int32)), left_padding=np.zeros(2, int))


# -- sampled_log_probs -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[None, 5.0], ids=["plain", "softcap"])
def capped(request):
    """A tiny model with (or without) a final logit cap and large logits, its variables and one batch."""
    model = models.build("causal_transformer", **SMALL, logit_softcap=request.param, tie_embeddings=True)
    variables = jax.jit(lambda key: model.init(key, jnp.zeros((1, SEQ), jnp.int32), head=False))(jax.random.key(1))
    embedding = variables["params"]["embed_tokens"]["embedding"]
    # A tied head of entries of order two gives logits of order ten, where the cap bends them.
    variables = {"params": {**variables["params"], "embed_tokens": {"embedding": embedding * 100.0}}}
    tokens = np.random.default_rng(1).integers(0, 64, (2, SEQ + 1)).astype(np.int32)
    objective = LMObjective(model, SEQ, ema_decay=None, head_chunks=3)
    return objective, variables, tokens, jax.jit(objective.token_scores)(variables, jnp.asarray(tokens))


def _hand_logits(objective, variables, scores):
    return np.asarray(jax.jit(objective.head_logits)(variables, scores.states), np.float64)


def test_sampled_log_probs_at_unit_temperature_are_the_raw_policy(capped):
    objective, variables, tokens, scores = capped
    np.testing.assert_array_equal(objective.sampled_log_probs(variables, scores, tokens), -scores.losses)


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_sampled_log_probs_temper_the_capped_logits_by_hand(capped, temperature):
    objective, variables, tokens, scores = capped
    logits = _hand_logits(objective, variables, scores)
    expected = np.take_along_axis(_log_softmax64(logits / temperature), tokens[:, 1:, None], -1)[..., 0]
    ours = np.asarray(jax.jit(objective.sampled_log_probs, static_argnames="temperature")(
        variables, scores, tokens, temperature=temperature))
    # The same fp32 logits on both sides but for the tiles' own 32-term products (32 ulps of |h||w|), a
    # cap (tanh, LIBRARY_ULPS) and the division: then the log-softmax's bound. Observed: 3.1e-5 uncapped
    # (logits up to 74), 1.5e-6 capped, against bounds of 1.2e-3 to 2.7e-3 and 5.2e-4 to 1.1e-3.
    states, head = np.asarray(scores.states, np.float64), np.abs(np.asarray(variables["params"]["embed_tokens"]["embedding"]))
    products = (np.abs(states) @ head.T).max()
    error = ulp_bound(32 + LIBRARY_ULPS + 1, products) / temperature
    assert_within(ours, expected, _softmax_bound(error, logits / temperature), f"temperature {temperature}")
    assert not np.allclose(ours, -np.asarray(scores.losses), atol=1e-3)


def test_sampled_log_probs_renormalise_over_the_kept_support_by_hand(capped):
    objective, variables, tokens, scores = capped
    temperature = 0.8
    logits = _hand_logits(objective, variables, scores) / temperature
    # Row 0: the targets in columns 2 and 5 kept 3 and 1 ids; row 1: column 8 kept 4 ids; other entries unused.
    kept = {(0, 2): [tokens[0, 2], 7, 9], (0, 5): [tokens[0, 5]], (1, 8): [11, tokens[1, 8], 12, 13]}
    ids, columns = np.zeros((2, 5), np.int32), np.full((2, 5), -1, np.int32)
    cursor = [0, 0]
    for (row, column), entries in kept.items():
        for token in entries:
            ids[row, cursor[row]], columns[row, cursor[row]] = token, column
            cursor[row] += 1
    full = np.take_along_axis(_log_softmax64(logits), tokens[:, 1:, None], -1)[..., 0]
    expected = full.copy()
    for (row, column), entries in kept.items():
        z = logits[row, column - 1]
        expected[row, column - 1] = z[tokens[row, column]] - np.log(np.exp(z[np.asarray(entries)]).sum())
    ours = np.asarray(jax.jit(objective.sampled_log_probs, static_argnums=4)(variables, scores, tokens, (ids, columns),
                                                                             temperature))
    assert abs(ours[0, 4]) <= ulp_bound(2, np.abs(logits).max())  # a target that kept one id has likelihood 1
    # As above; the support's logits are 32-term products of their own. Observed: 2.0e-5 uncapped, 1.5e-6
    # capped, against 2.4e-3 and 9.8e-4.
    states = np.abs(np.asarray(scores.states, np.float64))
    head = np.abs(np.asarray(variables["params"]["embed_tokens"]["embedding"]))
    error = ulp_bound(32 + LIBRARY_ULPS + 1, (states @ head.T).max()) / temperature
    assert_within(ours, expected, _softmax_bound(error, logits), "support")


def test_sampled_log_probs_refuse_a_support_that_could_not_have_drawn_the_target(capped):
    objective, variables, tokens, scores = capped
    missing = (tokens[0, 3] + 1) % 64
    with pytest.raises(ValueError, match=rf"the target {tokens[0, 3]} at row 0, column 3 is not among the 1 ids"):
        objective.sampled_log_probs(variables, scores, tokens, (np.asarray([[missing], [0]]), np.asarray([[3], [-1]])))
    with pytest.raises(ValueError, match="temperature is 0; give the sampler's temperature"):
        objective.sampled_log_probs(variables, scores, tokens, temperature=0)


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_tempered_chunked_loss_and_gradient_equal_unchunked(softcap):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(10, 16)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(16, 37)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, 10), jnp.int32)

    def chunked(h, w):
        return jnp.sum(chunked_cross_entropy(h, w, targets, False, 3, softcap, False, 0.6)[0])

    def reference(h, w):
        logits = h @ w
        logits = logits if softcap is None else softcap * jnp.tanh(logits / softcap)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits / 0.6, targets))

    # Ten 37-way cross entropies of logits up to |h||w| ~ 25 / 0.6: the tiles' and the whole softmax's
    # roundings, a few hundred ulps of the 40-sized terms; the gradients sum 37 columns of sizes up to
    # |w| / 0.6. Observed: 1.5e-5 (loss), 2.4e-6 (gradients).
    scale = float(np.abs(np.asarray(hidden) @ np.abs(np.asarray(weight))).max()) / 0.6
    np.testing.assert_allclose(jax.jit(chunked)(hidden, weight), reference(hidden, weight), rtol=0,
                               atol=ulp_bound(10 * (37 + 2 * LIBRARY_ULPS), scale))
    gradients = jax.jit(jax.grad(chunked, (0, 1)))(hidden, weight), jax.grad(reference, (0, 1))(hidden, weight)
    for ours, theirs in zip(*gradients):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=ulp_bound(37 * 4 + 16, scale))


# -- loss_role -------------------------------------------------------------------------------------
def _chat_batch(seed: int, rows: int) -> dict[str, np.ndarray]:
    """Chat rows: two conversations in most rows (segments 1 and 2, positions restarting), a padded tail,
    user and assistant spans and template tokens (NONE); one row has no assistant target at all."""
    rng = np.random.default_rng(seed)
    width = SEQ + 1
    tokens = rng.integers(1, 64, (rows, width)).astype(np.int32)
    roles = rng.choice([U, A, A, N], (rows, width)).astype(np.int32)
    segments = np.ones((rows, width), np.int32)
    positions = np.tile(np.arange(width, dtype=np.int32), (rows, 1))
    for row in range(rows):
        split, tail = 2 + row % 4, width - row % 3
        segments[row, split:tail], positions[row, split:tail] = 2, np.arange(tail - split)
        segments[row, tail:], positions[row, tail:], roles[row, tail:], tokens[row, tail:] = 0, 0, N, 0
    roles[rows - 1] = np.where(roles[rows - 1] == A, U, roles[rows - 1])
    return {"text": tokens, "text_segment_ids": segments, "text_positions": positions, "text_roles": roles}


def _kept_by_hand(batch) -> np.ndarray:
    """Targets an assistant-only loss keeps: in the same segment as their input, not padding, assistant's."""
    segments, roles = batch["text_segment_ids"], batch["text_roles"]
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    return same & (roles[:, 1:] == A)


def test_loss_role_keeps_only_that_roles_targets_by_hand(tiny_model, tiny_variables):
    batch = _chat_batch(0, 4)
    kept = _kept_by_hand(batch)
    assert 0 < kept.sum() < kept.size
    fields = dict(segment_ids=batch["text_segment_ids"], positions=batch["text_positions"])
    every = jax.jit(LMObjective(tiny_model, SEQ).token_scores)(tiny_variables, jnp.asarray(batch["text"]), **fields)
    chat = LMObjective(tiny_model, SEQ, loss_role="assistant")
    assert chat.loss_role is Role.ASSISTANT
    chat.check_batch(batch)
    stats, _ = jax.jit(chat.loss)(tiny_variables, batch, STEP)
    assert float(stats.ce.count) == kept.sum() == float(stats.token_accuracy.count)
    assert float(stats.token_accuracy.total) == np.sum(np.asarray(every.correct)[kept])
    losses = np.asarray(every.losses, np.float64)
    # The same float32 losses summed in another order: sum(kept) - 1 roundings of their total.
    assert float(stats.ce.total) == pytest.approx(losses[kept].sum(), abs=ulp_bound(kept.sum(), losses[kept].sum()))
    scored = jax.jit(chat.token_scores)(tiny_variables, jnp.asarray(batch["text"]), roles=batch["text_roles"], **fields)
    np.testing.assert_array_equal(scored.weights, kept.astype(np.float32))
    np.testing.assert_array_equal(scored.losses, every.losses)


def test_loss_role_under_accumulation_equals_one_batch(tiny_model):
    batch = _chat_batch(1, 8)  # micro-batches of 2 rows count 5, 6, 8 and 2 assistant targets
    objective = LMObjective(tiny_model, SEQ, loss_role=Role.ASSISTANT, ema_decay=None)
    data = Dataset(train=lambda partition: iter([batch] * 4), val=None, records=8, batch=8)
    states, logged = {}, {}
    for accumulation in (1, 4):
        trainer = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0))
        states[accumulation] = trainer.fit(data, steps=2, log_every=1, verbose=False, accumulation=accumulation)
        logged[accumulation] = trainer.history
    # As the dense accumulation test (tests/training/test_trainer.py): the losses agree to the roundings
    # of sums of 64 terms in another order, the parameters to 1e-6 after two steps. Observed: 1.0e-7
    # relative (losses), 3.0e-8 (parameters).
    for one, four in zip(logged[1], logged[4]):
        assert four["train/ce"] == pytest.approx(one["train/ce"], rel=ulp_bound(64))
    flat = lambda state: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(state.params)])
    np.testing.assert_allclose(flat(states[4]), flat(states[1]), atol=1e-6, rtol=0)


def test_roles_are_refused_where_they_cannot_mean_anything(tiny_model, tiny_variables):
    batch = _chat_batch(2, 2)
    tokens = jnp.asarray(batch["text"])
    with pytest.raises(ValueError, match=r"token_scores\(roles=<array of shape \(2, 9\)>\).*this LMObjective has none"):
        LMObjective(tiny_model, SEQ).token_scores(tiny_variables, tokens, roles=batch["text_roles"])
    chat = LMObjective(tiny_model, SEQ, loss_role=Role.ASSISTANT)
    with pytest.raises(ValueError, match=r"loss_role=ASSISTANT\) keeps the targets of one role, and no roles"):
        chat.token_scores(tiny_variables, tokens)
    with pytest.raises(ValueError, match="the batch has no 'text_roles'.*data:chat"):
        chat.check_batch({"text": batch["text"]})
    with pytest.raises(ValueError, match=r"text_roles holds 7 at row 0, column 0, which is no Role"):
        chat.check_batch({**batch, "text_roles": np.full_like(batch["text_roles"], 7)})
    for wrong in ("narrator", Role.NONE, 3):
        with pytest.raises(ValueError, match=r"loss_role=...\): .* is not a message role: use one of \['system'"):
            LMObjective(tiny_model, SEQ, loss_role=wrong)


# -- ModelInputs batches, placement, predict, layers ---------------------------------------------------
def test_a_model_inputs_batch_weighs_only_real_targets(tiny_model, tiny_variables):
    rng = np.random.default_rng(3)
    pads = np.asarray([0, 2, 4])
    tokens = rng.integers(1, 64, (3, SEQ + 1)).astype(np.int32)
    mask = np.arange(SEQ + 1)[None, :] >= pads[:, None]
    objective = LMObjective(tiny_model, SEQ)
    batch = {"text": ModelInputs.of(tokens, attention_mask=mask)}
    objective.check_batch(batch)
    placed = place_batch(MeshSpec(data=1).build(jax.devices()[:1]), batch)
    assert isinstance(placed["text"], ModelInputs) and isinstance(placed["text"].token_fields["attention_mask"], jax.Array)
    loss, _, prediction = jax.jit(lambda v, b: objective.predict(v, b, STEP, train=False))(tiny_variables, placed)
    assert float(loss.count) == np.sum(SEQ - pads)
    np.testing.assert_array_equal(prediction.weights, mask[:, :-1] & mask[:, 1:])
    # Masked rows score as rows whose padding is moved out of the way (left_padding): the same decoder
    # with another mask (decoder_ulps with one library) moves each logit, so each cross entropy by
    # twice that plus its log-sum-exp's roundings, over the 21 targets. Observed: 3.6e-6 against 1.4e-3.
    moved = jax.jit(objective.per_token_log_probs)(tiny_variables, jnp.asarray(tokens), left_padding=jnp.asarray(pads))
    logits = np.asarray(prediction.logits)
    error = ulp_bound(decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=SEQ, libraries=1),
                      np.abs(logits).max())
    assert float(loss.total) == pytest.approx(-float(np.sum(np.asarray(moved, np.float64))),
                                                  abs=np.sum(SEQ - pads) * _softmax_bound(error, logits))


def test_predict_gives_the_logits_weights_and_layer_states_behind_the_loss(tiny_model, tiny_variables):
    batch = {k: jnp.asarray(v) for k, v in _chat_batch(4, 2).items()}
    objective = LMObjective(tiny_model, SEQ, loss_role="assistant")
    mean, effects, prediction = jax.jit(lambda v, b: objective.predict(v, b, STEP, train=True, layers=(0, 1)))(
        tiny_variables, batch)
    stats, _ = jax.jit(objective.loss)(tiny_variables, batch, STEP)
    # the reference's signature: the loss's Mean first; the whole statistics are predict_statistics'
    assert isinstance(mean, Mean) and effects == {}
    assert float(mean.total) == float(stats.loss.total) and float(mean.count) == float(stats.loss.count)
    whole, _, again = jax.jit(lambda v, b: objective.predict_statistics(v, b, STEP, train=True, layers=(0, 1)))(
        tiny_variables, batch)
    assert isinstance(whole, LMStatistics) and float(whole.ce.total) == float(stats.ce.total)
    assert float(whole.token_accuracy.total) == float(stats.token_accuracy.total)
    np.testing.assert_array_equal(again.logits, prediction.logits)
    assert prediction.logits.shape == (2, SEQ, 64) and prediction.logits.dtype == jnp.float32
    np.testing.assert_array_equal(prediction.weights, _kept_by_hand(_chat_batch(4, 2)).astype(np.float32))
    scored = jax.jit(lambda v, b: objective.token_scores(
        v, b["text"], segment_ids=b["text_segment_ids"], positions=b["text_positions"], roles=b["text_roles"],
        layers=[1]))(tiny_variables, batch)
    np.testing.assert_array_equal(prediction.layers["layers_1"], scored.layers["layers_1"])
    assert set(prediction.layers) == {"layers_0", "layers_1"} and set(scored.layers) == {"layers_1"}
    assert prediction.layers["layers_0"].shape == (2, SEQ, 32)
    assert not np.allclose(prediction.layers["layers_0"], prediction.layers["layers_1"])
    # The whole logits' log-softmax against the chunked loss: the same logits but for each tile's own
    # 32-term products, then the log-softmax's bound. Observed: 4.2e-7 against 7.5e-5.
    logits = np.asarray(prediction.logits, np.float64)
    expected = -np.take_along_axis(_log_softmax64(logits), np.asarray(batch["text"])[:, 1:, None], -1)[..., 0]
    assert_within(scored.losses, expected, _softmax_bound(ulp_bound(32, np.abs(logits).max()), logits), "losses")
    with pytest.raises(ValueError, match="layers \\[5\\] are not layers of this 2-layer model"):
        objective.predict(tiny_variables, batch, STEP, train=False, layers=(5,))


@pytest.mark.slow
def test_predict_refuses_router_loss_terms_and_keeps_balance_rate():
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=2,
                         mlp_features=32, max_seq_len=16, mixture=dict(experts=4, top_k=2, bias=True))
    variables = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32), head=False)
    batch = {"text": jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, SEQ + 1)), jnp.int32)}
    for name, value in (("aux_loss_alpha", 0.1), ("router_z_loss", 0.01)):
        with pytest.raises(ValueError, match=rf"predict: {name}={value} is a router loss normalised by its own totals"):
            LMObjective(model, SEQ, **{name: value}).predict(variables, batch, STEP, train=False)
    objective = LMObjective(model, SEQ, balance_rate=0.01)
    _, effects, prediction = jax.jit(lambda v, b: objective.predict(v, b, STEP, train=False))(variables, batch)
    assert effects["counts"].shape == (2, 4) and int(effects["counts"].sum()) == 2 * 2 * SEQ * 2
    assert prediction.logits.shape == (2, SEQ, 64)


# -- sessions.pack -------------------------------------------------------------------------------------
def _sessions():
    return [
        [sessions.Turn("user", [5, 6, 7]), sessions.Turn("assistant", [8, 9], [-0.5, -0.25], [[8, 1], [9]]),
         sessions.Turn(Role.TOOL, [10]), sessions.Turn("assistant", [11], [-1.0])],
        [sessions.Turn("user", [3]), sessions.Turn("assistant", [4, 5, 6], [-0.1, -0.2, -0.3], [[4], [5, 6], [6, 7, 8]])],
    ]


def test_sessions_pack_turns_roles_and_supports_by_hand():
    packed = sessions.pack(_sessions(), SEQ, pad_id=0)
    np.testing.assert_array_equal(packed.tokens, [[5, 6, 7, 8, 9, 10, 11, 0, 0], [3, 4, 5, 6, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(packed.roles, [[U, U, U, A, A, int(Role.TOOL), A, N, N], [U, A, A, A, N, N, N, N, N]])
    np.testing.assert_array_equal(packed.segment_ids, [[1] * 7 + [0] * 2, [1] * 4 + [0] * 5])
    np.testing.assert_array_equal(packed.sampled, [[0, 0, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(packed.log_probs, np.asarray([[0, 0, -0.5, -0.25, 0, -1.0, 0, 0],
                                                                [-0.1, -0.2, -0.3, 0, 0, 0, 0, 0]], np.float32))
    ids, columns = packed.support
    np.testing.assert_array_equal(ids, [[8, 1, 9, 0, 0, 0], [4, 5, 6, 6, 7, 8]])
    np.testing.assert_array_equal(columns, [[3, 3, 4, -1, -1, -1], [1, 2, 2, 3, 3, 3]])
    assert packed.batch()["text_positions"][1].tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 0]


def test_packed_sessions_score_over_their_supports(tiny_model, tiny_variables):
    packed = sessions.pack(_sessions(), SEQ)
    objective = LMObjective(tiny_model, SEQ, loss_role="assistant")
    batch = packed.batch()
    objective.check_batch(batch)
    def score(variables, batch, support):
        scores = objective.token_scores(variables, batch["text"], segment_ids=batch["text_segment_ids"],
                                        positions=batch["text_positions"], roles=batch["text_roles"])
        return scores, objective.sampled_log_probs(variables, scores, batch["text"], support)

    scores, ours = jax.jit(score)(tiny_variables, batch, packed.support)
    ours = np.asarray(ours)
    # Targets that kept only themselves have likelihood 1; the others renormalise over 2 or 3 ids, so
    # they lie above the full softmax's; unsupported sampled ones (row 0, slot 5) keep the full softmax.
    assert ours[1, 0] == 0.0 and ours[0, 3] == 0.0
    for row, slot in ((0, 2), (1, 1), (1, 2)):
        assert -float(scores.losses[row, slot]) < ours[row, slot] < 0.0
    assert ours[0, 5] == -float(scores.losses[0, 5])


@pytest.mark.parametrize("session, message", [
    ([sessions.Turn("user", list(range(10)))], "session 0 is 10 tokens, longer than a row of seq_len \\+ 1 = 9"),
    ([sessions.Turn("assistant", [1], [-0.1])], "turn 0 is sampled and opens the session"),
    ([sessions.Turn("user", [1]), sessions.Turn("assistant", [2, 3], [-0.1])], "2 tokens and 1 log_probs"),
    ([sessions.Turn("user", [1]), sessions.Turn("assistant", [2], [-0.1], [[3, 4]])],
     "token 0 \\(2\\) is not among its 2 kept ids"),
    ([sessions.Turn("narrator", [1])], "session 0, turn 0: role 'narrator' is not a message role"),
    ([sessions.Turn("user", [1]), sessions.Turn("assistant", [2], None, [[2]])], "gives a support and no log_probs"),
])
def test_sessions_pack_refuses_bad_sessions_by_name(session, message):
    with pytest.raises(ValueError, match=message):
        sessions.pack([session], SEQ)


# -- policy ----------------------------------------------------------------------------------------------
def test_policy_rollouts_record_the_sampler_and_the_raw_policy(tiny_model, tiny_variables):
    from dew.objectives.lm import Rollout

    objective = LMObjective(tiny_model, SEQ)
    plain = objective.policy(tiny_variables, Sampling(temperature=1.0))([[1, 2, 3], [4, 5]], 5, seed=0, n=2)
    assert isinstance(plain, Rollout) and plain.policy_log_probs.shape == plain.log_probs.shape == (4, 5)
    raw = np.asarray(objective._compiled_log_probs(tiny_variables, jnp.asarray(plain.tokens)))
    logits = np.asarray(jax.jit(lambda v, t: objective.head_logits(v, objective.token_scores(v, t).states))(
        tiny_variables, jnp.asarray(plain.tokens)))
    # The sampler at temperature 1 without filters is the raw policy: the cached decode against the full
    # pass, the same decoder in another order (decoder_ulps, one library), then the log-softmax's bound.
    # Observed: 4.8e-7 against 7.8e-5 (and 0 for the rollout's raw likelihoods: the same compiled pass).
    error = ulp_bound(decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=8, libraries=1),
                      np.abs(logits).max())
    bound = _softmax_bound(error, logits)
    for row in range(4):
        prompt, new = plain.lengths[row] - plain.new_tokens[row], plain.new_tokens[row]
        assert_within(plain.policy_log_probs[row, :new], raw[row, prompt - 1:prompt - 1 + new], bound, "raw")
        assert_within(plain.log_probs[row, :new], plain.policy_log_probs[row, :new], bound, "sampler")
    filtered = objective.policy(tiny_variables, Sampling(temperature=1.0, top_k=3))([[1, 2, 3]], 5, seed=0)
    # Renormalised over three ids, the sampler's likelihoods lie above the raw policy's.
    assert np.all(filtered.log_probs[0] > filtered.policy_log_probs[0])
