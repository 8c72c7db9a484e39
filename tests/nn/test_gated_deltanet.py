"""The Gated DeltaNet mixer: the chunked delta rule against the step-by-step recurrence (float64), one
layer against transformers' `Qwen3NextGatedDeltaNet` and `Qwen3_5GatedDeltaNet` (outputs and gradients,
float32), and its recurrent cache: a padded prefill leaves each row's state as its own prompt would,
decode steps continue it, a reset row starts from zeros, packed documents do not see each other."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dew.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetMixer, gated_delta_rule
from dew.nn.rotary import RopeScaling
from dew.nn.transformer import LINEAR, CausalTransformer, DecoderConfig
from dew.run_config import to_json
from tests.compiled import compiled
from tests.recurrent_cases import (
    KNOBS, check_a_reset_row_starts_from_zeros, check_gradients_match_torch, check_greedy_mixed_batch,
    check_packed_documents_do_not_see_each_other, check_padded_prefill_then_decode, context, order_one,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

WIDTH = 32


def reference_rule(q, k, v, g, beta, starts, state):
    """The delta rule one token at a time in float64 (transformers' recurrent form), the state zeroed
    first at a start."""
    q, k, v, g, beta, state = (np.asarray(t, np.float64) for t in (q, k, v, g, beta, state))
    Bn, S, H, _ = q.shape
    o = np.zeros((Bn, S, H, v.shape[-1]))
    state = state.copy()
    for t in range(S):
        state = np.where(np.asarray(starts)[:, t, None, None, None], 0.0, state)
        state = state * np.exp(g[:, t])[..., None, None]
        predicted = np.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return o, state


@pytest.mark.parametrize("seq_len,chunk", [(16, 4), (13, 4), (13, 32), (7, 1)])
def test_chunked_rule_equals_the_recurrence(x64, seq_len, chunk):
    """Chunks that divide the sequence, that do not, one longer than it and chunks of one; with a
    document restart, padded positions (beta 0, g 0) and a carried-in state, in float64. Only the order
    of the sums differs (and the chunk's triangular solve, whose unit lower-triangular system has
    entries below 1 in size, as keys are unit vectors and beta, the decays below 1): a few hundred
    roundings of 1.1e-16 of terms up to about 10, so 1e-12."""
    rng = np.random.default_rng(seq_len * 100 + chunk)
    Bn, H, K, V = 2, 3, 4, 5
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k = unit(rng.normal(size=(Bn, seq_len, H, K))), unit(rng.normal(size=(Bn, seq_len, H, K)))
    v = rng.normal(size=(Bn, seq_len, H, V))
    g = -rng.uniform(0.01, 2.0, (Bn, seq_len, H))
    beta = rng.uniform(0.0, 1.0, (Bn, seq_len, H))
    g[1, :3], beta[1, :3] = 0.0, 0.0  # padding
    starts = np.zeros((Bn, seq_len), bool)
    starts[0, seq_len // 2] = True
    state = rng.normal(size=(Bn, H, K, V))
    o, final = compiled(gated_delta_rule, *(jnp.asarray(t) for t in (q, k, v, g, beta, starts, state)), chunk)
    o_ref, final_ref = reference_rule(q, k, v, g, beta, starts, state)
    assert o.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(o), o_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final), final_ref, rtol=0, atol=1e-12)


# ---- one layer against transformers ------------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = GatedDeltaNet(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4, chunk_size=8)
LAYERS = {
    "qwen3_next": (transformers.Qwen3NextConfig, "transformers.models.qwen3_next.modeling_qwen3_next",
                   "Qwen3NextGatedDeltaNet"),
    "qwen3_5": (transformers.Qwen3_5TextConfig, "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
}


def hf_config(family: str):
    config_class = LAYERS[family][0]
    s = SHAPE
    return config_class(hidden_size=WIDTH, num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=50,
                        linear_num_key_heads=s.key_heads, linear_num_value_heads=s.value_heads,
                        linear_key_head_dim=s.key_head_dim, linear_value_head_dim=s.value_head_dim,
                        linear_conv_kernel_dim=s.conv_kernel, rms_norm_eps=1e-6)


def hf_layer(family: str):
    """transformers' mixer with weights of order one, so that a wrong product shows."""
    module = importlib.import_module(LAYERS[family][1])
    layer = getattr(module, LAYERS[family][2])(hf_config(family), layer_idx=0).eval()
    return order_one(torch, layer)


def in_proj_rows(w: dict, shape: GatedDeltaNet) -> np.ndarray:
    """Dew's `in_proj` rows (queries, keys, values, z, b, a) from either family's projections: Qwen 3.5's
    split ones, or Qwen3-Next's two fused ones whose rows are grouped per key head."""
    if "in_proj_qkv.weight" in w:
        return np.concatenate([w[f"in_proj_{part}.weight"] for part in ("qkv", "z", "b", "a")])
    s, r = shape, shape.value_heads // shape.key_heads
    qkvz = w["in_proj_qkvz.weight"].reshape(s.key_heads, -1, WIDTH)
    q, k, v, z = np.split(qkvz, np.cumsum([s.key_head_dim, s.key_head_dim, r * s.value_head_dim]), axis=1)
    b, a = np.split(w["in_proj_ba.weight"].reshape(s.key_heads, 2 * r, WIDTH), 2, axis=1)
    return np.concatenate([part.reshape(-1, WIDTH) for part in (q, k, v, z, b, a)])


def dew_params(layer) -> dict:
    w = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    params = {"in_proj": {"kernel": in_proj_rows(w, SHAPE).T}, "out_proj": {"kernel": w["out_proj.weight"].T},
              "conv1d": {"kernel": w["conv1d.weight"]}, "A_log": w["A_log"], "dt_bias": w["dt_bias"],
              "norm": {"scale": w["norm.weight"]}}
    return jax.tree_util.tree_map(jnp.asarray, {"params": params})


def dew_grads(grads, layer) -> dict:
    """Dew's parameter gradients under transformers' names and layouts."""
    g = jax.tree_util.tree_map(np.asarray, grads)
    rows = g["in_proj"]["kernel"].T
    s = SHAPE
    out = {"out_proj.weight": g["out_proj"]["kernel"].T, "conv1d.weight": g["conv1d"]["kernel"], "A_log": g["A_log"],
           "dt_bias": g["dt_bias"], "norm.weight": g["norm"]["scale"]}
    q, k, v, z, b, a = np.split(rows, np.cumsum([s.key_dim, s.key_dim, s.value_dim, s.value_dim, s.value_heads]))
    if hasattr(layer, "in_proj_qkv"):
        out.update({"in_proj_qkv.weight": np.concatenate([q, k, v]), "in_proj_z.weight": z, "in_proj_b.weight": b,
                    "in_proj_a.weight": a})
        return out
    per_head = lambda part: part.reshape(s.key_heads, -1, WIDTH)
    out["in_proj_qkvz.weight"] = np.concatenate([per_head(p) for p in (q, k, v, z)], axis=1).reshape(-1, WIDTH)
    out["in_proj_ba.weight"] = np.concatenate([per_head(b), per_head(a)], axis=1).reshape(-1, WIDTH)
    return out


def layer_bound(seq_len: int, magnitude: float, libraries: int = 2) -> float:
    """Two float32 evaluations of one layer, in other orders (and with another library's exp, softplus,
    sigmoid, silu and rsqrt when `libraries` is 2), at outputs of `magnitude`. Roundings along the
    chain walk randomly (six standard deviations of their count): the projection (`WIDTH` terms), the
    convolution (K), the L2 norms (`key_head_dim`), the scores and the state reads (`key_head_dim`
    each), the chunk's triangular solve and its sums over positions (`chunk` terms each, one solve per
    position of the chunk deep), the state's update (`chunk`), the per-head norm (`value_head_dim`)
    and the output projection (`value_dim`); the transcendentals (softplus's exp and log, the decays'
    exp, sigmoid, silu twice, three rsqrts) may differ by `LIBRARY_ULPS` each, and a decay's argument,
    a sum of up to `chunk` log decays of size up to |g| <= 4 * softplus(0.5), carries its rounding into
    the exponential, relative in full."""
    s, L = SHAPE, min(SHAPE.chunk_size, seq_len)
    roundings = (WIDTH + s.conv_kernel + 3 * s.key_head_dim + L * L + 2 * L + seq_len // L + s.value_head_dim
                 + s.value_dim)
    library = (libraries - 1) * LIBRARY_ULPS * 9
    return ulp_bound(math.sqrt(6 * roundings) + library + 4 * 4 * L, magnitude)


@pytest.fixture(scope="module", params=sorted(LAYERS))
def pair(request):
    layer = hf_layer(request.param)
    return layer, dew_params(layer), GatedDeltaNetMixer(SHAPE, 1e-6)


@pytest.mark.parametrize("seq_len", [16, 13])
def test_layer_matches_transformers(pair, seq_len):
    """Qwen3-Next's fused projections and Qwen 3.5's split ones, at a multiple of Dew's chunk (8) and
    not (transformers' torch path pads to its own 64) (observed: 1.4e-6 of outputs up to 2.8, against
    bounds near 6e-5)."""
    layer, params, mixer = pair
    x = np.random.default_rng(seq_len).normal(size=(2, seq_len, WIDTH)).astype(np.float32)
    with torch.no_grad():
        expected = layer(torch.from_numpy(x)).numpy()
    ours, _, _ = jax.jit(mixer.apply)(params, jnp.asarray(x), None, context(np.ones((2, seq_len))), KNOBS)
    magnitude = float(np.abs(expected).max())
    assert magnitude > 0.5
    assert_within(ours, expected, layer_bound(seq_len, magnitude), "layer outputs")


def test_layer_gradients_match_torch(pair):
    """The gradient of `sum(out * w)` for every parameter and the input, against torch's autograd
    through transformers' torch path (observed: 2.2e-6 relative to each gradient's largest entry;
    the backward pass rounds about as often as the forward, so twice the forward's bound)."""
    layer, params, mixer = pair
    check_gradients_match_torch(torch, layer, params, mixer, WIDTH, lambda grads: dew_grads(grads, layer),
                                lambda scale: 2 * layer_bound(13, scale))


# ---- the recurrent cache ---------------------------------------------------------------------------


def test_padded_prefill_then_decode_equals_each_row_alone(pair):
    """The same computation in other chunks: one library's bound."""
    _, params, mixer = pair
    check_padded_prefill_then_decode(mixer, params, SHAPE, WIDTH, lambda n, m: layer_bound(n, m, libraries=1))


def test_a_reset_row_starts_from_zeros(pair):
    _, params, mixer = pair
    check_a_reset_row_starts_from_zeros(mixer, params, SHAPE, WIDTH)


def test_packed_documents_do_not_see_each_other(pair):
    _, params, mixer = pair
    check_packed_documents_do_not_see_each_other(mixer, params, WIDTH, lambda n, m: layer_bound(n, m, libraries=1))




# ---- in a decoder ----------------------------------------------------------------------------------


def test_a_hybrid_config_reads_back_from_run_json_and_names_its_axes():
    """run.json records the shape as a dict; it reads back as a `GatedDeltaNet` (its fields name it), and
    the mixer's parameters carry logical axis names (the stacked layer axis first)."""
    config = DecoderConfig(vocab_size=64, emb_features=WIDTH, num_layers=3, num_heads=4, mlp_features=48,
                           layer_types=(LINEAR, LINEAR, "full_attention"), recurrent=SHAPE, scan_layers=2)
    back = DecoderConfig(**json.loads(json.dumps(to_json(config))))
    assert back == config and back.layer_specs == config.layer_specs
    names = CausalTransformer(config).logical_names()["params"]["layers_0to1"]["self_attn"]
    assert names["in_proj"]["kernel"] == PartitionSpec("layers", "embed", "mlp")
    assert names["conv1d"]["kernel"] == PartitionSpec("layers", "mlp", None, None)
    assert names["A_log"] == PartitionSpec("layers", "heads")
    assert names["norm"]["scale"] == PartitionSpec("layers", "norm")
    with pytest.raises(TypeError, match=r"recurrent names fields \['chunk_size', 'conv_kernel'\], which more than one"):
        DecoderConfig(**{**to_json(config), "recurrent": {"conv_kernel": 4, "chunk_size": 8}})


@pytest.mark.slow
def test_greedy_cached_generation_of_a_hybrid_mixed_batch_equals_the_uncached_argmax():
    """Gated DeltaNet layers around a gated, partially rotated attention layer (Qwen3-Next's), every layer
    with an MLP: one decoder, two kinds of cache; weights tripled so the argmax depends on the context."""
    config = DecoderConfig(vocab_size=64, emb_features=WIDTH, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                           mlp_features=48, layer_types=(LINEAR, "full_attention", LINEAR),
                           recurrent=dataclasses.replace(SHAPE, chunk_size=4), norm_style="gemma", qk_norm=True,
                           attn_output_gate=True, rope_scaling=RopeScaling(rotated_fraction=0.25))
    model = CausalTransformer(config)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    check_greedy_mixed_batch(model, jax.tree_util.tree_map(lambda x: x * 3.0, variables))
