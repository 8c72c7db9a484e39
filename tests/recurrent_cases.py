"""The cache cases every recurrent mixer (`dew.nn.recurrent`) passes, shared by the mixers' test files:
a padded prefill then decode steps equal each row's own pass, a reset row starts from zeros, packed
documents do not see each other. Each takes the mixer, its variables, its shape (for the cache), the
model width and `bound(seq_len, magnitude)`: one library's tolerance for the same layer in other chunks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.layer import LayerContext, LayerKnobs
from dew.nn.recurrent import RecurrentCache
from dew.sampling import Sampling, generate
from tests.compiled import compiled
from tests.tolerances import assert_within

KNOBS = LayerKnobs(window=None, rope=jnp.int32(0), index=jnp.int32(0), local=jnp.int32(0))


def order_one(torch, layer):
    """transformers' recurrent mixer `layer` with weights of order one, so that a wrong product shows:
    decay rates `exp(A_log)` from 0.5 to 4, time-step biases from -3 to 0.5, matrices scaled by their
    fan-in, every other weight near 1."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in layer.named_parameters():
            if name == "A_log":
                weight.copy_(torch.log(torch.linspace(0.5, 4.0, weight.numel())))
            elif name == "dt_bias":
                weight.copy_(torch.linspace(-3.0, 0.5, weight.numel()))
            elif name.endswith("weight") and weight.ndim >= 2:
                weight.copy_(torch.randn_like(weight) / math.sqrt(weight.shape[-1]))
            else:
                weight.copy_(1.0 + 0.5 * torch.randn_like(weight))
    return layer


def context(real, segments=None, **cached):
    real = jnp.asarray(real, jnp.int32)
    segments = real if segments is None else jnp.asarray(segments, jnp.int32) * real
    B, S = real.shape
    return LayerContext(rotary={}, slots_BS=jnp.broadcast_to(jnp.arange(S), (B, S)), segments_BS=segments, **cached)


def cached_context(real, cache_lengths, capacity):
    """The context the decoder gives a cached call (`CausalTransformer`): write slots after each row's
    filled ones, and the filled slots once this call's tokens are written."""
    real = jnp.asarray(real, jnp.int32)
    before = jnp.asarray(cache_lengths)[:, None] + jnp.cumsum(real, 1) - real
    lengths = jnp.asarray(cache_lengths) + real.sum(1)
    filled = (jnp.arange(capacity)[None] < lengths[:, None]).astype(jnp.int32)
    return context(real, write_slots_BS=jnp.where(real > 0, before, capacity), filled_BT=filled), lengths


def check_padded_prefill_then_decode(mixer, params, shape, width: int, bound) -> None:
    """Rows of 9 and 5 real tokens, left- and right-padded in one prefill, then three decode steps in
    which the second row idles once (a padded step): every real output and the final states equal the
    row's own uncached pass over its real tokens (and its own prefill's state)."""
    rng = np.random.default_rng(7)
    tokens = rng.normal(size=(2, 12, width)).astype(np.float32)
    real = np.zeros((2, 9), np.int32)
    real[0, :] = 1  # 9 real
    real[1, 2:7] = 1  # 2 pads, 5 real, 2 pads
    capacity = 16
    cache = RecurrentCache.empty(1, 2, capacity, shape, jnp.float32)
    apply = jax.jit(mixer.apply)
    out, cache_out, _ = apply(params, jnp.asarray(tokens[:, :9]), None, cached_context(real, [0, 0], capacity)[0],
                              KNOBS, cache)
    lengths = real.sum(1)
    outputs = [[out[0, t] for t in range(9)], [out[1, t] for t in range(2, 7)]]
    fed = [list(range(9)), list(range(2, 7))]
    for position, live in [(9, [1, 1]), (10, [1, 0]), (11, [1, 1])]:
        step_ctx, lengths = cached_context(np.asarray(live)[:, None], lengths, capacity)
        out, cache_out, _ = apply(params, jnp.asarray(tokens[:, position:position + 1]), None, step_ctx, KNOBS,
                                  cache_out)
        for row in range(2):
            if live[row]:
                outputs[row].append(out[row, 0])
                fed[row].append(position)
    for row in range(2):
        alone = jnp.asarray(tokens[row:row + 1, fed[row]])
        expected, _, _ = apply(params, alone, None, context(np.ones((1, len(fed[row])))), KNOBS)
        assert_within(np.stack(outputs[row]), expected[0], bound(len(fed[row]), float(np.abs(expected).max())),
                      f"row {row}")
        one = RecurrentCache.empty(1, 1, capacity, shape, jnp.float32)
        _, own, _ = apply(params, alone, None, cached_context(np.ones((1, len(fed[row]))), [0], capacity)[0], KNOBS,
                          one)
        np.testing.assert_allclose(cache_out.conv[0, row], own.conv[0, 0], rtol=0, atol=1e-6)
        assert_within(cache_out.state[0, row], own.state[0, 0], bound(len(fed[row]), float(np.abs(own.state).max())),
                      f"row {row}'s state")


def check_a_reset_row_starts_from_zeros(mixer, params, shape, width: int) -> None:
    """A row whose length is back to 0 (`Cache.reset`) reads its stale state as zeros."""
    tokens = jnp.asarray(np.random.default_rng(8).normal(size=(1, 5, width)).astype(np.float32))
    stale = RecurrentCache(conv=jnp.ones((1, 1, shape.conv_kernel - 1, shape.conv_dim)),
                           state=jnp.ones((1, 1, *shape.state_shape)), capacity=8)
    ctx, _ = cached_context(np.ones((1, 5)), [0], 8)
    out, _, _ = mixer.apply(params, tokens, None, ctx, KNOBS, stale)
    fresh, _, _ = mixer.apply(params, tokens, None, context(np.ones((1, 5))), KNOBS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fresh))


def check_packed_documents_do_not_see_each_other(mixer, params, width: int, bound) -> None:
    """Two documents in one row (segment ids 1 and 2): the second's outputs equal its own pass (the
    convolution reads no tap of the first, and the state restarts)."""
    tokens = jnp.asarray(np.random.default_rng(9).normal(size=(1, 11, width)).astype(np.float32))
    segments = np.asarray([[1] * 6 + [2] * 5])
    packed, _, _ = compiled(mixer.apply, params, tokens, None, context(np.ones((1, 11)), segments), KNOBS)
    alone, _, _ = compiled(mixer.apply, params, tokens[:, 6:], None, context(np.ones((1, 5))), KNOBS)
    assert_within(packed[0, 6:], alone[0], bound(11, float(np.abs(alone).max())), "second document")


def check_gradients_match_torch(torch, layer, params, mixer, width: int, hf_grads, bound) -> None:
    """The gradient of `sum(out * w)` for every parameter of transformers' `layer` and the input, against
    `torch`'s autograd (the module, which the calling test imported or skipped); `hf_grads(grads)` puts
    Dew's parameter gradients under transformers' names and layouts, and `bound(magnitude)` is the
    tolerance at a gradient of that size."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 13, width)).astype(np.float32)
    w = rng.normal(size=(2, 13, width)).astype(np.float32)
    x_torch = torch.from_numpy(x).requires_grad_(True)
    layer.zero_grad()
    (layer(x_torch) * torch.from_numpy(w)).sum().backward()
    expected = {name: p.grad.numpy() for name, p in layer.named_parameters()}
    expected["x"] = x_torch.grad.numpy()

    def loss(params, x):
        out, _, _ = mixer.apply(params, x, None, context(np.ones((2, 13))), KNOBS)
        return jnp.sum(out * w)

    grads, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(x))
    ours = hf_grads(grads["params"])
    ours["x"] = np.asarray(grad_x)
    assert set(ours) == set(expected)
    for name, value in expected.items():
        assert_within(ours[name], value, bound(float(np.abs(value).max())), f"gradient of {name}")


def check_greedy_mixed_batch(model, variables) -> None:
    """Prompts of 3, 9 and 2 tokens left-padded together, then 10 greedy steps through the model's cache:
    each row's tokens are the uncached argmax of its own sequence, step by step."""
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7]]
    generation = generate(model, variables, prompts, 10, key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    forward = jax.jit(lambda tokens: model.apply(variables, tokens))
    for row, prompt in enumerate(prompts):
        sequence = list(prompt)
        for _ in range(10):
            padded = np.zeros((1, 24), np.int32)  # causal: trailing tokens change nothing before them
            padded[0, :len(sequence)] = sequence
            sequence.append(int(jnp.argmax(forward(jnp.asarray(padded))[0, len(sequence) - 1])))
        assert list(generation.tokens[row, :generation.lengths[row]]) == sequence
