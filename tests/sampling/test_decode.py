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

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3, 5, 3, 6]]


@pytest.fixture(scope="module", params=["full-unrolled", "sliding-scanned"])
def decoder(request):
    # The scanned decoder keeps each run's cache stacked and writes it layer by layer inside the scan.
    knobs = dict(sliding_window=4, scan_layers=1) if request.param == "sliding-scanned" else dict(scan_layers=0)
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=64, **knobs)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
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
    logits, cache = prefill(model, variables, jnp.asarray(tokens), jnp.asarray(valid), model.init_cache(2, 12))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [3, 3])
    alone_logits, alone = prefill(model, variables, jnp.asarray([[4, 5, 6]]), jnp.ones((1, 3), jnp.int32),
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
    _, cache = prefill(model, variables, jnp.asarray([[4, 5, 6], [7, 8, 9]]), jnp.ones((2, 3), jnp.int32),
                       model.init_cache(2, 8))
    _, after = decode_step(model, variables, jnp.asarray([1, 2]), jnp.asarray([True, False]), cache)
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
