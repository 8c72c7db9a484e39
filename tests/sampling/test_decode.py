"""The per-row KV cache: padding takes no slot, rows of any length decode side by side, and
`prefill` / `decode_step` are the pure pieces `generate` is built from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.sampling import Sampling, generate
from dew.sampling.generate import decode_step, prefill
from tests.compiled import compiled
from tests.tolerances import ulp_bound

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6]]


@pytest.fixture(scope="module", params=["full-unrolled", "sliding-scanned"])
def decoder(request):
    # The scanned decoder keeps each run's cache stacked and writes it layer by layer inside the scan.
    knobs = dict(sliding_window=4, scan_layers=1) if request.param == "sliding-scanned" else dict(scan_layers=0)
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=64, **knobs)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    # Larger weights make the argmax depend on the context, so a slot error would show.
    return model, jax.tree_util.tree_map(lambda x: x * 6.0, variables)


def test_a_mixed_batch_generates_what_each_prompt_generates_alone(decoder):
    model, variables = decoder
    greedy = Sampling(temperature=0.0)
    together = generate(model, variables, PROMPTS, 10, key=jax.random.key(0), sampling=greedy)
    for row, prompt in enumerate(PROMPTS):
        alone = generate(model, variables, [prompt], 10, key=jax.random.key(0), sampling=greedy)
        assert together.continuations()[row] == alone.continuations()[0]


def test_padding_takes_no_cache_slot(decoder):
    model, variables = decoder
    tokens = np.zeros((2, 8), np.int32)
    valid = np.zeros((2, 8), np.int32)
    tokens[0, 5:], valid[0, 5:] = [4, 5, 6], 1  # left padding
    tokens[1, :3], valid[1, :3] = [4, 5, 6], 1  # right padding
    logits, cache = compiled(prefill, model, variables, jnp.asarray(tokens), jnp.asarray(valid), model.init_cache(2, 12))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [3, 3])
    alone_logits, alone = compiled(prefill, model, variables, jnp.asarray([[4, 5, 6]]), jnp.ones((1, 3), jnp.int32),
                                   model.init_cache(1, 12))
    # Layer 0's cache: the first run, its first (or only) layer.
    keys, alone_keys = np.asarray(cache.runs[0].keys[:1]), np.asarray(alone.runs[0].keys[:1])
    for row in range(2):
        # Both rows hold the same three tokens in slots 0-2 and nothing after them.
        np.testing.assert_allclose(keys[:, row, :, :3], alone_keys[:, 0, :, :3], rtol=0, atol=1e-5)
        assert not keys[:, row, :, 3:].any()
        np.testing.assert_allclose(np.asarray(logits[row]), np.asarray(alone_logits[0]), rtol=0, atol=1e-4)


def test_a_finished_row_writes_nothing(decoder):
    model, variables = decoder
    _, cache = compiled(prefill, model, variables, jnp.asarray([[4, 5, 6], [7, 8, 9]]), jnp.ones((2, 3), jnp.int32),
                       model.init_cache(2, 8))
    _, after = compiled(decode_step, model, variables, jnp.asarray([1, 2]), jnp.asarray([True, False]), cache)
    np.testing.assert_array_equal(np.asarray(after.lengths), [4, 3])
    np.testing.assert_array_equal(np.asarray(after.runs[0].keys[:, 1]), np.asarray(cache.runs[0].keys[:, 1]))
    assert np.asarray(after.runs[0].keys[:, 0, :, 3]).any()


def test_streaming_draws_the_same_tokens_as_one_call(decoder):
    model, variables = decoder
    sampling = Sampling(temperature=0.9, top_p=0.9, repetition_penalty=1.3)
    whole = generate(model, variables, PROMPTS, 6, key=jax.random.key(4), sampling=sampling, n=2)
    streamed = []
    piecewise = generate(model, variables, PROMPTS, 6, key=jax.random.key(4), sampling=sampling, n=2,
                         on_token=lambda tokens, live: streamed.append(tokens))
    np.testing.assert_array_equal(piecewise.tokens, whole.tokens)
    np.testing.assert_array_equal(np.stack(streamed, axis=1), np.asarray(whole.continuations()))


def test_a_fresh_cache_prefills_in_causal_blocks_to_the_same_logits():
    # Prompts longer than attention's 128-query blocks, one left- and one right-padded: into a cache
    # marked fresh, the prefill scores each query block against the keys up to its end only.
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=320)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (2, 260)).astype(np.int32)
    valid = np.ones((2, 260), np.int32)
    valid[0, :60] = 0  # left padding
    valid[1, 200:] = 0  # right padding
    run = jax.jit(lambda cache: prefill(model, variables, jnp.asarray(tokens), jnp.asarray(valid), cache))
    plain = model.init_cache(2, 300)
    fresh = plain.replace(fresh=True)
    assert "128,128]" in str(jax.make_jaxpr(run)(fresh)) and "128,128]" not in str(jax.make_jaxpr(run)(plain))
    (logits, cache), (fresh_logits, fresh_cache) = run(plain), run(fresh)
    assert not fresh_cache.fresh
    np.testing.assert_array_equal(np.asarray(fresh_cache.lengths), [200, 200])
    # The one difference is the order of the weighted values' sums: their contraction stops at the
    # block's end, and the keys it leaves out carry probability exactly 0. A sum of up to 300 terms in
    # another order lands up to 299 ulps of its terms' total magnitude apart, here at most max |v| <= 1
    # (the probabilities sum to 1); the later layers and the head, at init scale, shrink rather than
    # grow that. Largest difference observed: 3.7e-8 (logits of magnitude 0.3), 3.0e-8 (keys, values).
    bound = ulp_bound(299)
    np.testing.assert_allclose(np.asarray(fresh_logits), np.asarray(logits), rtol=0, atol=bound)
    for run_cache, fresh_run in zip(cache.runs, fresh_cache.runs):
        np.testing.assert_allclose(np.asarray(fresh_run.keys), np.asarray(run_cache.keys), rtol=0, atol=bound)
        np.testing.assert_allclose(np.asarray(fresh_run.values), np.asarray(run_cache.values), rtol=0, atol=bound)
