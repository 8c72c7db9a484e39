"""LMObjective: the chunked loss and its gradient, target weights, statistics and refusals."""

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
from dew.objectives.lm import loss
from dew.objectives.lm.loss import chunked_cross_entropy
from tests.tolerances import assert_within, decoder_ulps, ulp_bound

STEP = Step(jnp.zeros((), jnp.int32), jax.random.key(0))


def _term_sizes(hidden, weight, targets, w, transposed, softcap, z_loss):
    """Sizes of what each result sums, float64: the largest |h| . |w| of a logit, each row's |lse|, and
    for each gradient entry the sum of its terms' sizes, with |dloss/dlogit| <= w (p + onehot)(1 + 2 z |lse|)
    (the softcap's derivative is at most 1)."""
    h, wt = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)
    head = wt.T if transposed else wt
    logits = h @ head
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    top = logits.max(-1)
    lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
    onehot = np.eye(head.shape[1])[np.asarray(targets)]
    dlogits = np.asarray(w, np.float64)[:, None] * (np.exp(logits - lse[:, None]) + onehot)
    dlogits *= (1 + 2 * z_loss * np.abs(lse))[:, None]
    dhead = np.abs(h).T @ dlogits
    gradient_terms = (dlogits @ np.abs(head).T, dhead.T if transposed else dhead)
    return float((np.abs(h) @ np.abs(head)).max()), np.abs(lse), gradient_terms


def _reference(hidden, weight, targets, transposed, softcap):
    logits = hidden @ (weight.T if transposed else weight)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


@pytest.mark.parametrize("transposed", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("chunks", [1, 3, 4, None])
def test_chunked_loss_and_gradient_equal_unchunked(transposed, softcap, chunks):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(10, 16)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(37, 16) if transposed else (16, 37)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, 10), jnp.int32)
    w = jnp.asarray(rng.uniform(size=10), jnp.float32)

    def chunked(h, wt):
        ce, lse, _ = chunked_cross_entropy(h, wt, targets, transposed, chunks, softcap)
        return jnp.sum(ce * w) + 0.01 * jnp.sum(lse**2 * w)

    def reference(h, wt):
        logits = h @ (wt.T if transposed else wt)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.sum(_reference(h, wt, targets, transposed, softcap) * w) + 0.01 * jnp.sum(lse**2 * w)

    value, grads = jax.value_and_grad(chunked, argnums=(0, 1))(hidden, weight)
    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(hidden, weight)
    # fp32, one library. A row's log-probabilities move by `shift` nats: two logits (16-term dot products
    # of terms up to `logit_terms`, and the softcap's 3 roundings) and the normaliser (37 exps summed, a
    # log of its size, 2 rescalings per chunk). The value sums 10 rows weighted w (1 + 0.02 |lse|), all
    # terms positive, 20 roundings of it; a gradient entry sums up to 37 terms, each `shift` off relatively.
    # Observed: 1.9e-6 on the value 26.6 (0.5% of its bound), 8.3e-7 on gradients (at most 1.5% of theirs).
    logit_terms, lse, gradient_terms = _term_sizes(hidden, weight, targets, w, transposed, softcap, 0.01)
    shift = ulp_bound(2 * (16 + 3) * logit_terms + 37 + 1 + lse.max() + 2 * (chunks or 1))
    value_bound = shift * float(np.sum(np.asarray(w) * (1 + 0.02 * lse))) + ulp_bound(20, abs(float(want)))
    np.testing.assert_allclose(value, want, atol=value_bound, rtol=0)
    for got, expected, terms in zip(grads, want_grads, gradient_terms):
        assert_within(got, expected, terms * (shift + ulp_bound(37)), "gradient")


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_accuracy_is_the_first_argmax_across_tiles(chunks):
    hidden = jnp.eye(6, 4, dtype=jnp.float32)
    weight = (jnp.zeros((4, 8), jnp.float32).at[0, 6].set(2.0).at[1, 1].set(3.0).at[2, 2].set(1.0).at[2, 5].set(1.0)
              .at[3, 3].set(1.0).at[3, 4].set(1.0))
    targets = jnp.asarray([6, 1, 5, 3, 4, 0])
    _, _, correct = chunked_cross_entropy(hidden, weight, targets, False, chunks, None)
    # Row 2 ties between 2 and 5 (other tiles at 4 chunks), row 3 between 3 and 4 (one tile at 4
    # chunks, two at 3): the first maximum wins. Rows 4 and 5 are all zeros: argmax 0, as jnp.argmax.
    want = (jnp.argmax(hidden @ weight, axis=-1) == targets).astype(jnp.float32)
    np.testing.assert_array_equal(want, [1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    np.testing.assert_array_equal(correct, want)


def test_tile_count_from_the_rows_keeps_each_tiles_logits_within_the_budget():
    # None: the fewest tiles of float32 logits within TILE_BYTES; a count is taken as given (at most V).
    assert loss._layout(4096, None, 512) == (4096, 1)  # 8 MiB of logits: one tile
    assert loss._layout(50257, None, 1024) == (12565, 4)  # 206 MB: four tiles of at most 64 MiB
    rows = loss.TILE_BYTES // (4 * 1000)
    assert loss._layout(1000, None, rows)[1] == 1 and loss._layout(1000, None, rows + 1)[1] == 2
    assert loss._layout(37, 4, 10) == (10, 4) and loss._layout(5, 9, 10) == (1, 5)


def _products(fn, *args) -> int:
    """How many products (XLA's dot_general, or oneDNN's call under DEW_FAST_MATMUL=on) `fn`'s jaxpr
    holds, inside scans and custom rules too."""
    def count(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += eqn.primitive.name == "dot_general" or (
                eqn.primitive.name == "ffi_call" and eqn.params["target_name"].startswith("dew_gemm"))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        total += count(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        total += count(sub)
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("chunks, products", [(1, 3), (None, 3), (2, 4)])
def test_one_tile_keeps_its_logits_for_the_backward_pass(chunks, products):
    # One tile: the forward product, then the hidden and head gradients from the kept logits. Several:
    # each tile's logits are made again in the backward pass (a fourth product, in the scan's body).
    hidden, weight = jnp.ones((8, 4), jnp.float32), jnp.ones((4, 6), jnp.float32)
    targets = jnp.arange(8) % 6

    def total(h, w):
        return jnp.sum(chunked_cross_entropy(h, w, targets, False, chunks, None)[0])

    assert _products(jax.grad(total, (0, 1)), hidden, weight) == products


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
