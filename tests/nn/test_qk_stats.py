"""`qk_stats`: each attention layer's largest pre-softmax logit per row and head, against a direct
float64 computation from the layer's queries and keys (captured at their projections), over the
pairs the mask allows: causal, sliding windows, padding and packed documents; grouped-query and latent
attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.mla import LatentAttention
from dew.nn.transformer import CausalTransformer, DecoderConfig
from tests.compiled import compiled
from tests.tolerances import assert_within, ulp_bound

SHAPE = dict(vocab_size=61, emb_features=32, num_layers=3, num_heads=4, max_seq_len=64, scan_layers=0)
TOKENS = np.random.default_rng(0).integers(0, 61, (2, 12)).astype(np.int32)
# row 0: two packed documents; row 1: left padding (3 slots), as a generation batch has it
SEGMENTS = np.asarray([[1] * 7 + [2] * 5, [0] * 3 + [1] * 9], np.int32)


def _large_weights(model):
    """Random weights of order one, so the logits spread over several units and a wrong pair would show."""
    leaves, tree = jax.tree_util.tree_flatten(compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
                                                       head=False))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [jax.random.normal(k, x.shape) * 0.5 for k, x in zip(keys, leaves)])


def _captured(model, variables, names, **kwargs):
    """(the model's output, each layer's captured projection outputs `{layer: {name: [B, S, F]}}`)."""
    output, state = model.apply(variables, jnp.asarray(TOKENS), head=False, capture_intermediates=(
        lambda module, method: module.name in names), mutable=["intermediates"], **kwargs)
    found = state["intermediates"]
    layers = {}
    for layer in range(model.config.num_layers):
        mixer = found[f"layers_{layer}"]["self_attn"]
        layers[layer] = {name: np.asarray(mixer[name]["__call__"][0], np.float64) for name in names}
    return output, layers


def _rotate(x_BSHD, positions_BS, theta):
    """Llama's rotation in float64: halves, `theta ** (-2i / D)`."""
    D = x_BSHD.shape[-1]
    angles_BSF = positions_BS[..., None] * theta ** (-np.arange(0, D, 2) / D)
    cos, sin = np.cos(angles_BSF)[:, :, None], np.sin(angles_BSF)[:, :, None]
    first, second = x_BSHD[..., : D // 2], x_BSHD[..., D // 2:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _allowed(segments_BS, window):
    """The pairs a real query reads: same document, not later, fewer than `window` slots behind."""
    S = segments_BS.shape[1]
    q, k = np.arange(S)[:, None], np.arange(S)[None, :]
    allowed = (segments_BS[:, :, None] == segments_BS[:, None, :]) & (k <= q)[None]
    if window is not None:
        allowed &= (q - k < window)[None]
    return allowed & (segments_BS > 0)[:, :, None]


def _positions(segments_BS):
    """Each document's positions from 0, as the decoder derives them for packed rows and padding."""
    positions = np.zeros(segments_BS.shape, np.int64)
    for row, segments in enumerate(segments_BS):
        for segment in set(segments.tolist()) - {0}:
            where = np.flatnonzero(segments == segment)
            positions[row, where] = np.arange(len(where))
    return positions


def _largest(scores_BHST, allowed_BST):
    return np.where(allowed_BST[:, None], scores_BHST, -np.inf).max(axis=(2, 3))


def _bound(q_BSHD, k_BSHD, scale):
    """float32 against float64: each rotated feature is a few ulps off (the projection's output is the
    same; the rotation's sincosf and two products round it), and the dot of D features sums D
    roundings: (4 + 1) * D ulps of the largest sum of |q_i k_i|, times the scale."""
    D = q_BSHD.shape[-1]
    magnitude = np.einsum("bshd,bthd->bhst", np.abs(q_BSHD), np.abs(k_BSHD)).max() * scale
    return ulp_bound(5 * D, magnitude)


@pytest.mark.parametrize("window, layer_types", [(None, None), (3, ("sliding_attention", "full_attention",
                                                                         "sliding_attention"))])
def test_grouped_query_maxima_match_the_direct_computation(window, layer_types):
    config = DecoderConfig(**SHAPE, num_kv_heads=2, sliding_window=window, layer_types=layer_types)
    model = CausalTransformer(config)
    variables = _large_weights(model)
    output, captured = _captured(model, variables, ("q_proj", "k_proj"), segment_ids=jnp.asarray(SEGMENTS),
                                 qk_stats=True)
    qk_max_LBH = np.asarray(output.aux["qk_max"])
    assert qk_max_LBH.shape == (3, 2, 4) and config.attention_layers == (0, 1, 2)
    positions = _positions(SEGMENTS)
    H, K, D = 4, 2, config.head_dim
    for layer, found in captured.items():
        q_BSHD = _rotate(found["q_proj"].reshape(2, 12, H, D), positions, config.rope_theta)
        k_BSKD = _rotate(found["k_proj"].reshape(2, 12, K, D), positions, config.rope_theta)
        k_BSHD = np.repeat(k_BSKD, H // K, axis=2)  # query head h reads key head h // (H / K)
        scores_BHST = np.einsum("bshd,bthd->bhst", q_BSHD, k_BSHD) * D**-0.5
        want_BH = _largest(scores_BHST, _allowed(SEGMENTS, config.layer_window(layer)))
        assert np.abs(want_BH).max() > 1.0
        # observed 5.0e-7 on maxima up to 8.9, against bounds of 4e-5 to 7e-5
        assert_within(qk_max_LBH[layer], want_BH, _bound(q_BSHD, k_BSHD, D**-0.5), f"layer {layer}")
    # the window holds out the pairs the full layer reads: a sliding layer's maxima differ from its
    # maxima over every causal pair somewhere, so the test sees the window
    if window is not None:
        q_BSHD = _rotate(captured[0]["q_proj"].reshape(2, 12, H, D), positions, config.rope_theta)
        k_BSHD = np.repeat(_rotate(captured[0]["k_proj"].reshape(2, 12, K, D), positions, config.rope_theta), 2, 2)
        full_BH = _largest(np.einsum("bshd,bthd->bhst", q_BSHD, k_BSHD) * D**-0.5, _allowed(SEGMENTS, None))
        assert (full_BH > qk_max_LBH[0] + 1e-3).any()


def test_latent_maxima_match_the_expanded_keys():
    """Latent attention scores in the absorbed form; the direct computation expands each head's key."""
    latent = LatentAttention(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=4, value_dim=6)
    config = DecoderConfig(**{**SHAPE, "num_layers": 2}, latent=latent)
    model = CausalTransformer(config)
    variables = _large_weights(model)
    names = ("q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm")
    output, captured = _captured(model, variables, names, segment_ids=jnp.asarray(SEGMENTS), qk_stats=True)
    positions = _positions(SEGMENTS)
    H, N, R, C = 4, 8, 4, 16
    scale = (N + R) ** -0.5
    interleave = lambda x: np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)  # DeepSeek's pairs, as halves
    for layer, found in captured.items():
        q_BSHF = found["q_b_proj"].reshape(2, 12, H, N + R)
        q_rope_BSHR = _rotate(interleave(q_BSHF[..., N:]), positions, config.rope_theta)
        k_rope_BS1R = _rotate(interleave(found["kv_a_proj_with_mqa"][:, :, None, C:]), positions, config.rope_theta)
        kv_b_CHF = np.asarray(variables["params"][f"layers_{layer}"]["self_attn"]["kv_b_proj"]["kernel"],
                              np.float64).reshape(C, H, -1)
        k_nope_BSHN = np.einsum("bsc,chn->bshn", found["kv_a_layernorm"], kv_b_CHF[..., :N])
        q_BSHD = np.concatenate([q_BSHF[..., :N], q_rope_BSHR], axis=-1)
        k_BSHD = np.concatenate([k_nope_BSHN, np.broadcast_to(k_rope_BS1R, (2, 12, H, R))], axis=-1)
        want_BH = _largest(np.einsum("bshd,bthd->bhst", q_BSHD, k_BSHD) * scale, _allowed(SEGMENTS, None))
        assert np.abs(want_BH).max() > 1.0
        # the absorbed form also sums kv_rank products per key feature: C more roundings per term
        # (observed 4.4e-7 on maxima up to 5.4, against bounds near 1e-3)
        assert_within(output.aux["qk_max"][layer], want_BH, _bound(q_BSHD, k_BSHD, scale) * (1 + C), f"layer {layer}")


def test_qk_stats_are_refused_through_a_cache():
    model = CausalTransformer(DecoderConfig(**SHAPE))
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
    with pytest.raises(ValueError, match="qk_stats=True reports a whole sequence's attention logits.*leave qk_stats"):
        model.apply(variables, jnp.asarray(TOKENS), cache=model.init_cache(2, 16), qk_stats=True)


def test_qk_stats_do_not_change_the_output_or_its_gradient():
    model = CausalTransformer(DecoderConfig(**SHAPE, num_kv_heads=2))
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
    loss = lambda params, qk: jnp.sum(model.apply(params, jnp.asarray(TOKENS), head=False, qk_stats=qk).hidden ** 2)
    grads = [jax.grad(loss)(variables, qk) for qk in (False, True)]
    jax.tree_util.tree_map(np.testing.assert_array_equal, *grads)
