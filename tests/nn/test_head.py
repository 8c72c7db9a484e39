"""The output head's cross entropy over the vocabulary in tiles (`dew.nn.head`): its loss and gradient
against the whole logits, its argmax accuracy, its tile layout and the products it runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.nn import head
from dew.nn.head import chunked_cross_entropy
from tests.tolerances import assert_within, ulp_bound


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
    assert head._layout(4096, None, 512) == (4096, 1)  # 8 MiB of logits: one tile
    assert head._layout(50257, None, 1024) == (12565, 4)  # 206 MB: four tiles of at most 64 MiB
    rows = head.TILE_BYTES // (4 * 1000)
    assert head._layout(1000, None, rows)[1] == 1 and head._layout(1000, None, rows + 1)[1] == 2
    assert head._layout(37, 4, 10) == (10, 4) and head._layout(5, 9, 10) == (1, 5)


def _products(fn, *args) -> int:
    """How many products (XLA's dot_general, or oneDNN's call under DEW_KERNELS=native) `fn`'s jaxpr
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
