"""Cached generation against the uncached forward, and its refusals."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.sampling import Sampling, generate

# The module, which dew.sampling's `generate` (the function) hides.
generate_module = importlib.import_module("dew.sampling.generate")


@pytest.fixture(scope="module")
def windowed():
    model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, mlp_features=64, max_seq_len=48, sliding_window=6, tie_embeddings=True)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    # Larger weights make the argmax depend on the context, so a masking error would show.
    return model, jax.tree_util.tree_map(lambda x: x * 6.0, variables)


def _uncached_greedy(model, variables, prompt, steps):
    # One fixed width: causal attention makes the trailing zeros invisible to earlier positions.
    forward = jax.jit(lambda tokens: model.apply(variables, tokens))
    sequence = list(prompt)
    for _ in range(steps):
        padded = np.zeros((1, 32), np.int32)
        padded[0, : len(sequence)] = sequence
        sequence.append(int(jnp.argmax(forward(jnp.asarray(padded))[0, len(sequence) - 1])))
    return sequence


def test_greedy_cached_generation_equals_uncached_argmax(windowed):
    model, variables = windowed
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7]]
    generation = generate(model, variables, prompts, 12, key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    for row, prompt in enumerate(prompts):
        expected = _uncached_greedy(model, variables, prompt, 12)
        assert list(generation.tokens[row, : generation.lengths[row]]) == expected
        assert generation.continuations()[row] == expected[len(prompt):]


def test_eos_stops_a_row_and_pads_the_rest(windowed):
    model, variables = windowed
    greedy = generate(model, variables, [[3, 1, 4]], 8, key=jax.random.key(0), sampling=Sampling(temperature=0.0))
    stop = int(greedy.continuations()[0][2])
    first_stop = greedy.continuations()[0].index(stop)
    stopped = generate(model, variables, [[3, 1, 4]], 8, key=jax.random.key(0),
                       sampling=Sampling(temperature=0.0, eos_token_ids=(stop,), pad_id=63))
    assert bool(stopped.terminated[0]) and int(stopped.new_tokens[0]) == first_stop + 1
    assert list(stopped.tokens[0, 3 + first_stop + 1:]) == [63] * (8 - first_stop - 1)


def test_continuation_zero_does_not_change_with_n(windowed):
    model, variables = windowed
    sampling = Sampling(temperature=1.0, top_k=20)
    one = generate(model, variables, [[1, 2, 3], [4, 5]], 6, key=jax.random.key(7), sampling=sampling, n=1)
    three = generate(model, variables, [[1, 2, 3], [4, 5]], 6, key=jax.random.key(7), sampling=sampling, n=3)
    assert three.continuations()[0] == one.continuations()[0]
    assert three.continuations()[3] == one.continuations()[1]
    again = generate(model, variables, [[1, 2, 3], [4, 5]], 6, key=jax.random.key(7), sampling=sampling, n=3)
    np.testing.assert_array_equal(again.tokens, three.tokens)


def test_bad_requests_are_refused_by_name(windowed):
    model, variables = windowed
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="plus max_new_tokens 40 is 50, beyond the model's max_seq_len 48"):
        generate(model, variables, [list(range(10))], 40, key=key)
    with pytest.raises(ValueError, match="token id 64, outside the model's vocab_size 64"):
        generate(model, variables, [[1, 64]], 4, key=key)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, variables, [[1], []], 4, key=key)
    with pytest.raises(ValueError, match="max_new_tokens is 0"):
        generate(model, variables, [[1]], 0, key=key)
    with pytest.raises(ValueError, match="temperature is -1"):
        Sampling(temperature=-1)


def test_rows_beyond_memory_are_refused_before_any_is_allocated(windowed, monkeypatch):
    model, variables = windowed
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"n 1,000,000,000,000 continuations of 2 prompt\(s\) are 2,000,000,000,000 "
                                         r"rows, which would hold about .* while decoding .* a cache of 20 positions "
                                         r"and float32 logits over 64 tokens\), more than the .* the weights leave of "
                                         r"the (host's memory|memory of .*) \(.* GiB\): ask for n of at most "):
        generate(model, variables, [[1, 2], [3]], 4, key=key, n=10**12)
    # Room for 2 prompts x 3 rows beside the weights (16 prompt slots + 4 new tokens a row): n 3 fits, 4 does not.
    weights = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(variables))
    room = weights + 6 * generate_module.row_bytes(model, 20, 4)
    monkeypatch.setattr(generate_module, "memory", lambda: (room, "a small device"))
    assert generate(model, variables, [[1, 2], [3]], 4, key=key, n=3).tokens.shape == (6, 6)
    with pytest.raises(ValueError, match=r"of a small device \(.* GiB\): ask for n of at most 3, and for more in "):
        generate(model, variables, [[1, 2], [3]], 4, key=key, n=4)


def test_prompts_that_pad_to_one_width_reuse_the_executable(windowed):
    from dew.sampling.generate import _compiled

    model, variables = windowed
    sampling = Sampling(temperature=0.0)
    run = _compiled(model, 5, sampling.eos_token_ids, sampling.pad_id)
    before = run._cache_size()
    for prompts in ([[1, 2, 3]], [[4, 5, 6, 7, 8, 9, 10]], [[9] * 16]):
        generate(model, variables, prompts, 5, key=jax.random.key(0), sampling=sampling)
    assert run._cache_size() - before <= 1  # all three pad to the 16-token bucket


def test_new_sampling_values_reuse_the_executable(windowed):
    from dew.sampling.generate import _compiled

    model, variables = windowed
    run = _compiled(model, 5, (), 0)
    generate(model, variables, [[1, 2, 3]], 5, key=jax.random.key(0), sampling=Sampling(temperature=0.7, top_p=0.9))
    before = run._cache_size()
    for sampling in (Sampling(temperature=1.3, top_p=0.5), Sampling(temperature=0.0, top_p=0.95),
                     Sampling(temperature=0.2, top_p=0.99)):
        generate(model, variables, [[4, 5, 6]], 5, key=jax.random.key(0), sampling=sampling)
    assert run._cache_size() == before


def test_greedy_with_repetition_penalty_matches_transformers_generate():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.hf_llama import copy_into_torch

    kwargs = dict(vocab_size=50, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=48,
                  max_seq_len=40)
    model = models.build("causal_transformer", **kwargs)
    variables = jax.tree_util.tree_map(lambda x: x * 6.0, model.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32)))
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=40, rms_norm_eps=1e-6, attn_implementation="eager",
    )
    torch_model = transformers.LlamaForCausalLM(config).eval()
    copy_into_torch(variables, torch_model, 2)
    prompt = [7, 3, 9, 3, 1]
    with torch.no_grad():
        theirs = torch_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                      repetition_penalty=1.5, pad_token_id=0, eos_token_id=None)[0].tolist()
    ours = generate(model, variables, [prompt], 16, key=jax.random.key(0),
                    sampling=Sampling(temperature=0.0, repetition_penalty=1.5))
    assert list(ours.tokens[0]) == theirs


def test_on_token_streams_every_step_in_order(windowed):
    model, variables = windowed
    streamed = []
    generation = generate(model, variables, [[3, 1, 4], [2, 7]], 6, key=jax.random.key(0),
                          sampling=Sampling(temperature=0.0), on_token=lambda tokens, live: streamed.append(tokens))
    assert len(streamed) == 6
    np.testing.assert_array_equal(np.stack(streamed, axis=1), [c for c in generation.continuations()])
