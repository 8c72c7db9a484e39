"""Latent attention: the absorbed form against the expanded one, the compressed cache against the full
forward, the cache's layout, and the knobs it refuses."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.mla import LatentAttention, yarn_query_scale
from dew.nn.rotary import RopeScaling
from dew.nn.transformer import CausalTransformer, DecoderConfig
from tests.compiled import compiled
from tests.tolerances import decoder_ulps, ulp_bound

LATENT = LatentAttention(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=4, value_dim=6)
SHAPE = dict(vocab_size=61, emb_features=32, num_layers=2, num_heads=4, mlp_features=48, max_seq_len=64)


def build(absorb: str, **overrides) -> CausalTransformer:
    latent = dataclasses.replace(overrides.pop("latent", LATENT), absorb=absorb)
    return CausalTransformer(DecoderConfig(**SHAPE, latent=latent, **overrides))


@pytest.fixture(scope="module")
def variables():
    """Weights of order one, so a wrong product shows (the parameters do not depend on the form)."""
    fresh = compiled(build("never").init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    leaves, tree = jax.tree_util.tree_flatten(fresh)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, x.shape) * 0.3 for k, x in zip(keys, leaves)])


def bound(logits, seq_len: int) -> float:
    """Two fp32 evaluations of one decoder in another order: the absorbed form sums `kv_rank + rope`
    products per score where the expanded one sums `nope + rope` after `kv_rank`-term projections, and
    applies the value projection after the attention-weighted sum rather than before, so each layer
    rounds in other places: `decoder_ulps` over the wider of the two widths, one library."""
    ulps = decoder_ulps(layers=SHAPE["num_layers"], width=SHAPE["emb_features"], mlp_width=SHAPE["mlp_features"],
                        heads=SHAPE["num_heads"], head_dim=LATENT.kv_rank + LATENT.rope_dim, seq_len=seq_len,
                        libraries=1) + 2 * SHAPE["num_layers"] * math.sqrt(6 * (LATENT.kv_rank + LATENT.nope_dim))
    return ulp_bound(ulps, float(np.abs(logits).max()))


TOKENS = np.random.default_rng(0).integers(0, 61, (2, 12))


@pytest.mark.slow
def test_absorbed_form_equals_expanded_form(variables):
    """The whole sequence in both forms (observed 1.9e-6 on logits up to 6)."""
    tokens = jnp.asarray(TOKENS, jnp.int32)
    expanded = np.asarray(compiled(build("never").apply, variables, tokens))
    absorbed = np.asarray(compiled(build("always").apply, variables, tokens))
    assert np.abs(expanded).max() > 1.0
    np.testing.assert_allclose(absorbed, expanded, atol=bound(expanded, 12), rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("absorb", ["decode", "never"])
def test_cached_decode_equals_full_forward(variables, absorb):
    """Prefill 5 tokens of one row and 7 of the other (left padding takes no slot), then decode one token
    a step through the latent cache: each row's logits equal its own full forward (observed 2.4e-6)."""
    model = build(absorb)
    tokens = jnp.asarray(TOKENS, jnp.int32)
    full = np.asarray(compiled(model.apply, variables, tokens))
    mask = np.ones((2, 7), bool)
    mask[0, :2] = False
    prompt = np.concatenate([np.zeros((1, 2), np.int64), TOKENS[:1, :5]], axis=1), TOKENS[1:, :7]
    prompt = jnp.asarray(np.concatenate(prompt), jnp.int32)
    cache = model.init_cache(2, 16)
    logits, cache = compiled(model.apply, variables, prompt, cache=cache, attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(logits)[0, 2:], full[0, :5], atol=bound(full, 12), rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[1], full[1, :7], atol=bound(full, 12), rtol=0)
    columns = [5, 7]
    for _ in range(4):
        step = jnp.asarray([[TOKENS[row, columns[row]]] for row in range(2)], jnp.int32)
        logits, cache = compiled(model.apply, variables, step, cache=cache)
        for row in range(2):
            np.testing.assert_allclose(np.asarray(logits)[row, 0], full[row, columns[row]], atol=bound(full, 12),
                                       rtol=0)
        columns = [c + 1 for c in columns]
    assert np.asarray(cache.lengths).tolist() == [9, 11]


def test_cache_holds_the_latent_and_the_rotary_key_only():
    model = build("decode")
    cache = model.init_cache(rows=3, capacity=20)
    assert len(cache.runs) == 2  # two layers, too few to scan: a run each
    for run in cache.runs:
        assert run.latents.shape == (1, 3, 20, LATENT.kv_rank)
        assert run.rope_keys.shape == (1, 3, 20, LATENT.rope_dim)
    assert cache.capacity == 20
    # per token and layer: kv_rank + rope_dim values, against 2 * heads * (nope + rope) for expanded keys and values
    assert LATENT.cache_width == 20


def test_yarn_query_scale_is_deepseeks():
    """transformers' DeepSeek scale: (nope + rope) ** -0.5 times (0.1 * mscale_all_dim * ln(factor) + 1) ** 2."""
    scaling = RopeScaling("yarn", factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0)
    assert yarn_query_scale(192, scaling) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2, rel=1e-12)
    assert yarn_query_scale(192, RopeScaling()) == 192 ** -0.5


def test_odd_rope_dim_is_refused():
    with pytest.raises(ValueError, match="rope_dim is 5.*must be even"):
        LatentAttention(kv_rank=16, rope_dim=5)


@pytest.mark.parametrize("knob", [dict(sliding_window=4), dict(qk_norm=True), dict(query_scale=0.5),
                                  dict(attn_softcap=20.0)])
def test_attention_knobs_latent_attention_lacks_are_refused(knob):
    with pytest.raises(ValueError, match="latent"):
        DecoderConfig(**SHAPE, latent=LATENT, **knob)


def test_latent_from_a_dict_and_unknown_fields():
    assert DecoderConfig(**SHAPE, latent=dataclasses.asdict(LATENT)).latent == LATENT
    with pytest.raises(TypeError, match="kv_lora_rank"):
        DecoderConfig(**SHAPE, latent={"kv_lora_rank": 16})
