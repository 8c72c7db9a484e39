"""Scanned runs of layers against the unrolled decoder, and the per-layer variable tree they keep."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.nn.stack import runs

# Gemma-2-like alternation: sliding and full layers with their own rotary bases scan as one run.
KNOBS = dict(vocab_size=61, emb_features=32, num_layers=4, num_heads=4, num_kv_heads=2, mlp_features=48,
             max_seq_len=32, sliding_window=5, rope_theta=1e6, local_rope_theta=1e4,
             layer_types=("sliding_attention", "full_attention") * 2)


def _pair(**knobs):
    scanned = models.build("causal_transformer", **{**KNOBS, **knobs, "scan_layers": 1})
    unrolled = models.build("causal_transformer", **{**KNOBS, **knobs, "scan_layers": 0})
    return scanned, unrolled


def _loss(model, variables, tokens):
    logits = model.apply(variables, tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] ** 2)


def test_alternating_windows_and_rotary_bases_scan_as_one_run():
    scanned, unrolled = _pair()
    assert runs(scanned.config.layer_specs, 1) == [(0, 4, True)]
    assert runs(unrolled.config.layer_specs, 0) == [(0, 1, False), (1, 2, False), (2, 3, False), (3, 4, False)]
    # Runs shorter than the threshold unroll: the default (8) leaves this 4-layer decoder unrolled.
    assert runs(scanned.config.layer_specs, 8) == runs(unrolled.config.layer_specs, 0)
    mixed = dataclasses.replace(scanned.config, qk_norm=True)
    assert runs(mixed.layer_specs, 1) == [(0, 4, True)]


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_equal_the_unrolled_ones(remat):
    scanned, unrolled = _pair(remat=remat)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 12)), jnp.int32)
    variables = scanned.init(jax.random.key(0), tokens)
    assert sorted(variables["params"]) == ["embed_tokens", "layers_0to3", "lm_head", "norm"]
    assert variables["params"]["layers_0to3"]["self_attn"]["q_proj"]["kernel"].shape == (4, 32, 32)
    # Both models read the per-layer form, as published checkpoints name it.
    variables = scanned.unstack_variables(jax.tree_util.tree_map(lambda x: x * 4.0, variables))  # logits ~10
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(
        unrolled.init(jax.random.key(0), tokens))

    ours = np.asarray(jax.jit(scanned.apply)(variables, tokens))
    theirs = np.asarray(jax.jit(unrolled.apply)(variables, tokens))
    # The same float32 operations in the same order; XLA may fuse a loop body differently from the
    # unrolled graph, which moves a sum's rounding by an ulp or so: 4 ulps of logits of order 10
    # (4.8e-6; observed 2.4e-6 on logits up to 6.7).
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=4 * 10 * np.finfo(np.float32).eps)

    grads = jax.jit(jax.grad(lambda v: _loss(scanned, v, tokens)))(variables)
    expected = jax.jit(jax.grad(lambda v: _loss(unrolled, v, tokens)))(variables)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(expected)):
        scale = float(np.max(np.abs(want))) or 1.0
        # Gradients sum over 24 positions and through 4 layers: 64 ulps of the largest entry (7.6e-6
        # relative; observed 1.8e-6).
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=64 * scale * np.finfo(np.float32).eps, err_msg=jax.tree_util.keystr(path))


def test_kept_layer_states_are_each_layers_output():
    scanned, unrolled = _pair()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 61, (1, 8)), jnp.int32)
    variables = scanned.init(jax.random.key(2), tokens)
    output = scanned.apply(variables, tokens, head=False, layers=(1, 3))
    assert sorted(output.aux) == ["layers_1", "layers_3"]
    # Layer 3 is the last: its output, normed, is the final hidden state.
    reference = unrolled.apply(variables, tokens, head=False, layers=(1, 3))
    for name in ("layers_1", "layers_3"):
        np.testing.assert_allclose(np.asarray(output.aux[name]), np.asarray(reference.aux[name]), rtol=0,
                                   atol=64 * np.finfo(np.float32).eps)
    np.testing.assert_allclose(np.asarray(output.logits()), np.asarray(scanned.apply(variables, tokens)), rtol=0,
                               atol=0)
    with pytest.raises(ValueError, match=r"layers \[4\] are not layers of this 4-layer model"):
        scanned.apply(variables, tokens, layers=(4,))


def test_per_layer_and_stacked_forms_round_trip():
    scanned, _ = _pair()
    stacked = scanned.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    per_layer = scanned.unstack_variables(stacked)
    assert sorted(per_layer["params"]) == ["embed_tokens", "layers_0", "layers_1", "layers_2", "layers_3",
                                           "lm_head", "norm"]
    again = scanned.stack_variables(per_layer)
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(stacked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert scanned.stack_variables(stacked) is stacked
    tokens = jnp.ones((1, 4), jnp.int32)
    np.testing.assert_array_equal(np.asarray(scanned.apply(per_layer, tokens)), np.asarray(scanned.apply(stacked, tokens)))
