"""The attention kernel: causal blocks against one full pass, and the mask rule; Gemma 4's options against
transformers; a read-only cache against float64 attention."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dew.nn.attention import AttentionSpec, attend, attention_mask
from dew.nn.layer import LayerContext, LayerKnobs
from dew.nn.rotary import rotary_angles
from tests.tolerances import LIBRARY_ULPS, decoder_ulps, rotary_frequency_ulps, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tests.hf_gemma4 import attention_state, gemma4_config, gemma4_spec, random_gemma4_weights, to_torch  # noqa: E402


@pytest.mark.parametrize("window", [None, 3])
def test_causal_blocks_equal_one_full_pass(window):
    rng = np.random.default_rng(0)
    B, S, H, K, D = 2, 11, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
    slots = jnp.broadcast_to(jnp.arange(S), (B, S))
    segments = jnp.asarray([[1] * 5 + [2] * 6, [1] * 9 + [0] * 2], jnp.int32)
    mask = attention_mask(slots, slots, segments, segments, causal=True, window=window)
    full = attend(q, k, v, mask)
    blocked = attend(q, k, v, mask, causal_blocks=True, block=4)  # blocks of 4, 4 and 3 queries
    # The same fp32 computation over fewer (all masked) keys, summed in another order, one library. A
    # weight moves by twice its score's error (8 roundings of an 8-term dot product and its scale, 2 of
    # the max subtracted, in units of the largest score's terms) plus 12 roundings (exp, an 11-term sum,
    # a division); the output adds 10 more, in units of the largest value. Bound 4.8e-5; observed: equal.
    score_size = float(np.einsum("bshd,bktd->bhkst", np.abs(q), np.abs(k)).max()) * D**-0.5
    bound = ulp_bound(2 * (8 + 2) * score_size + 12 + 10, magnitude=float(np.abs(v).max()))
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=bound, rtol=0)


def test_heads_major_queries_give_the_same_bits():
    """`attend` reading its queries heads-major `[B, H, S, D]` (how a prefill lays them out before rotating
    them) computes what it computes from `[B, S, H, D]`: the same products on the same values, equal."""
    rng = np.random.default_rng(3)
    B, S, H, K, D = 2, 11, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.bfloat16) for _ in range(2))
    mask = jnp.tril(jnp.ones((S, S), bool))[None].repeat(B, 0)
    run = jax.jit(lambda q, heads_major: attend(q, k, v, mask, causal_blocks=True, block=4, heads_major=heads_major),
                  static_argnums=1)
    np.testing.assert_array_equal(np.asarray(run(q.transpose(0, 2, 1, 3), True), np.float32),
                                  np.asarray(run(q, False), np.float32))


def test_mask_rule():
    slots = jnp.arange(5)[None]
    segments = jnp.asarray([[1, 1, 2, 2, 0]])
    mask = np.asarray(attention_mask(slots, slots, segments, segments, causal=True, window=None))[0]
    expected = np.array([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],  # padding reads only itself, so no row is empty
    ], bool)
    np.testing.assert_array_equal(mask, expected)
    windowed = np.asarray(attention_mask(slots, slots, jnp.ones((1, 5)), jnp.ones((1, 5)), causal=True, window=2))[0]
    assert windowed[4].tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma4_attention_matches_transformers(layer_type):
    """Gemma 4's options (scores scaled by 1, value heads normed without a scale, the key projection read
    as values on full layers, proportional rotary there) against transformers' `Gemma4TextAttention`."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention, Gemma4TextRotaryEmbedding

    config = gemma4_config()
    index = config.layer_types.index(layer_type)
    spec = gemma4_spec(config, index)
    B, S = 2, 9
    x_BSE = jax.random.normal(jax.random.key(0), (B, S, 32))
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    rotary = rotary_angles(positions_BS, *spec.rope())
    context = LayerContext(rotary={}, slots_BS=positions_BS, segments_BS=jnp.ones((B, S), jnp.int32))
    knobs = LayerKnobs(window=spec.window, rope=0, index=0, local=0)
    attention = spec.module(norm_style="olmo", norm_eps=config.rms_norm_eps, dtype=jnp.float32,
                            param_dtype=jnp.float32, name=None)
    variables = random_gemma4_weights(nn.meta.unbox(attention.init(jax.random.key(1), x_BSE, rotary, context,
                                                                    knobs)), seed=index)
    assert ("v_proj" in variables["params"]) == (layer_type == "sliding_attention")
    ours = np.asarray(attention.apply(variables, x_BSE, rotary, context, knobs)[0])

    reference = Gemma4TextAttention(config, index).eval()
    missing, unexpected = reference.load_state_dict(attention_state(variables["params"]), strict=True)
    assert not missing and not unexpected
    mask = attention_mask(positions_BS, positions_BS, context.segments_BS, context.segments_BS, causal=True,
                          window=spec.window)
    additive = torch.where(torch.from_numpy(np.array(mask))[:, None], 0.0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        x = to_torch(x_BSE)
        cos_sin = Gemma4TextRotaryEmbedding(config)(x, torch.from_numpy(np.array(positions_BS)), layer_type)
        theirs = reference(x, cos_sin, additive, shared_kv_states={})[0].numpy()
    # One layer's attention chain as `decoder_ulps` counts it (it counts an MLP this lacks, so it bounds from
    # above), plus the value norm (head_dim + 3 roundings and an rsqrt from two libraries), in ulps of the
    # output's size. Observed: 7.2e-7 (sliding) and 1.3e-6 (full) at outputs up to 2.5; the bounds 8.9e-5, 9.4e-5.
    ulps = (decoder_ulps(layers=1, width=32, mlp_width=48, heads=4, head_dim=spec.head_dim, seq_len=S,
                         frequency_ulps=rotary_frequency_ulps("proportional"))
            + math.sqrt(6 * (spec.head_dim + 3)) + LIBRARY_ULPS)
    bound = ulp_bound(ulps, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=bound, err_msg=layer_type)

    # Without the value norm the output moves by far more than the bound; reading keys as values is a
    # `v_proj` holding the key projection's weights (the values skip the keys' norm and rotation).
    for option in ("value_norm", "keys_as_values") if layer_type == "full_attention" else ("value_norm",):
        module = dataclasses.replace(spec, **{option: False}).module(
            norm_style="olmo", norm_eps=config.rms_norm_eps, dtype=jnp.float32, param_dtype=jnp.float32, name=None)
        params = dict(variables["params"])
        if option == "keys_as_values":
            params["v_proj"] = params["k_proj"]
        changed = np.asarray(module.apply({"params": params}, x_BSE, rotary, context, knobs)[0])
        if option == "keys_as_values":
            np.testing.assert_array_equal(changed, ours)
        else:
            assert float(np.abs(changed - theirs).max()) > 100 * bound, option


def test_a_read_only_cache_is_read_before_the_calls_own_keys():
    """A denoiser's pass (`read_only_cache`) over a cache a causal pass wrote with positions as its key
    slots (`key_slots_BT`; row 1 padded on the left): float64 attention over the cached then the own keys,
    the window counted back from the slot the context gives the queries; the cache comes back unchanged."""
    B, T, C, E, H, K, D, window = 2, 7, 3, 16, 4, 2, 8, 4
    spec = AttentionSpec(H, K, D, causal=True, window=window)
    rng = np.random.default_rng(3)
    valid_BT = np.arange(T)[None] >= np.array([[0], [2]])
    positions_BT = np.maximum(np.cumsum(valid_BT, axis=1) - 1, 0).astype(np.int32)
    length_B = valid_BT.sum(axis=1).astype(np.int32)
    prefix_BTE = jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)
    canvas_BCE = jnp.asarray(rng.normal(size=(B, C, E)), jnp.float32)
    canvas_positions_BC = length_B[:, None] + np.arange(C, dtype=np.int32)
    attention = spec.module(norm_style="llama", norm_eps=1e-6, dtype=jnp.float32, param_dtype=jnp.float32, name=None)
    knobs = LayerKnobs(window=jnp.int32(window), rope=0, index=0, local=0)
    write = LayerContext(rotary={}, slots_BS=jnp.asarray(positions_BT), segments_BS=jnp.asarray(valid_BT, jnp.int32),
                         write_slots_BS=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                         filled_BT=jnp.asarray(valid_BT, jnp.int32), key_slots_BT=jnp.asarray(positions_BT))
    prefix_rotary = rotary_angles(jnp.asarray(positions_BT), D, spec.rope_theta)
    empty = spec.empty_cache(1, B, T, jnp.float32)
    variables = attention.init(jax.random.key(0), prefix_BTE, prefix_rotary, write, knobs, empty)
    variables = random_gemma4_weights(nn.meta.unbox(variables), seed=4)
    _, cache, _ = attention.apply(variables, prefix_BTE, prefix_rotary, write, knobs, empty)

    read = LayerContext(rotary={}, slots_BS=jnp.broadcast_to(jnp.asarray(length_B)[:, None], (B, C)),
                        segments_BS=jnp.ones((B, C), jnp.int32), filled_BT=jnp.asarray(valid_BT, jnp.int32),
                        key_slots_BT=jnp.asarray(positions_BT), read_only_cache=True)
    canvas_rotary = rotary_angles(jnp.asarray(canvas_positions_BC), D, spec.rope_theta)
    denoiser = dataclasses.replace(spec, causal=False).module(norm_style="llama", norm_eps=1e-6, dtype=jnp.float32,
                                                              param_dtype=jnp.float32, name=None)
    ours, unchanged, _ = denoiser.apply(variables, canvas_BCE, canvas_rotary, read, knobs, cache)
    assert unchanged is cache

    p = {name: np.asarray(leaf["kernel"], np.float64) for name, leaf in variables["params"].items()}
    f64 = lambda x: np.asarray(x, np.float64)

    def rotate(x_BSHD, cos_BSD, sin_BSD):
        half = D // 2
        turned = np.concatenate([-x_BSHD[..., half:], x_BSHD[..., :half]], axis=-1)
        return x_BSHD * f64(cos_BSD)[:, :, None] + turned * f64(sin_BSD)[:, :, None]

    def project(x_BSE, rotary):
        S = x_BSE.shape[1]
        k = rotate((f64(x_BSE) @ p["k_proj"]).reshape(B, S, K, D), *rotary)
        return k, (f64(x_BSE) @ p["v_proj"]).reshape(B, S, K, D)

    q_BCHD = rotate((f64(canvas_BCE) @ p["q_proj"]).reshape(B, C, H, D), *canvas_rotary)
    cached_k, cached_v = project(prefix_BTE, prefix_rotary)
    own_k, own_v = project(canvas_BCE, canvas_rotary)
    k_BTKD, v_BTKD = np.concatenate([cached_k, own_k], 1), np.concatenate([cached_v, own_v], 1)
    # every query at the slot after the prefix: the canvas reads itself whole, the window counts from it
    read_BT = np.concatenate([valid_BT & (length_B[:, None] - positions_BT < window), np.ones((B, C), bool)], 1)
    scores = np.einsum("bchd,bthd->bhct", q_BCHD, np.repeat(k_BTKD, H // K, axis=2)) * D**-0.5
    scores = np.where(read_BT[:, None, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    theirs = np.einsum("bhct,bthd->bchd", weights, np.repeat(v_BTKD, H // K, axis=2)).reshape(B, C, H * D) @ p["o_proj"]
    # Dew's float32 roundings only (the float64 side is exact to them): the projections (16 terms), the
    # rotation (3), the scores (8 terms and the scale), the softmax (a 10-term sum, a division, exp's
    # LIBRARY_ULPS), the weighted values (10 terms) and the output projection (32): a random walk of
    # sqrt(6 N) ulps of the output's size. Bound 6.8e-6 at outputs up to 2.2; observed 1.7e-7.
    roundings = E + 3 + D + 1 + (T + C) + 1 + (T + C) + H * D
    bound = ulp_bound(math.sqrt(6 * roundings) + LIBRARY_ULPS, float(np.abs(theirs).max()))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=bound)
