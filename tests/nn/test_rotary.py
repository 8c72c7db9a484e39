"""Rotary frequencies and tables against transformers' own, for each scaling Dew builds."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.nn.rotary import SCALINGS, RopeScaling, rotary_angles, rotary_frequencies
from dew.run_config import to_json
from tests.tolerances import LIBRARY_ULPS, assert_within, rotary_frequency_ulps, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

# (head_dim, theta, scaling): the published settings, and the tiny ones the family parity tests use.
CASES = {
    "default": (128, 10000.0, RopeScaling()),
    "default-tiny": (16, 500.0, RopeScaling()),
    "linear-gemma-3": (256, 1e6, RopeScaling("linear", 8.0)),
    "llama3-llama-3.1": (128, 5e5, RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)),
    "llama3-llama-3.2": (64, 5e5, RopeScaling("llama3", 32.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)),
    "llama3-tiny": (16, 500.0, RopeScaling("llama3", 4.0, 32, low_freq_factor=1.0, high_freq_factor=4.0)),
    "yarn-qwen3": (128, 1e6, RopeScaling("yarn", 4.0, 32768)),
    "yarn-olmo-3": (128, 5e5, RopeScaling("yarn", 8.0, 8192, attention_factor=1.2079441541679836)),
    "yarn-mscale": (64, 1e4, RopeScaling("yarn", 40.0, 4096, beta_fast=24.0, beta_slow=2.0, mscale=0.707,
                                         mscale_all_dim=1.0)),
    "yarn-untruncated": (16, 100.0, RopeScaling("yarn", 4.0, 64, truncate=False)),
    "yarn-tiny": (16, 100.0, RopeScaling("yarn", 4.0, 64)),
    "proportional-gemma-4": (512, 1e6, RopeScaling("proportional", rotated_fraction=0.25)),
    "proportional-tiny": (16, 1e6, RopeScaling("proportional", 2.0, rotated_fraction=0.25)),
}
_TRANSFORMERS_NAMES = {"kind": "rope_type", "original_max_seq_len": "original_max_position_embeddings",
                       "rotated_fraction": "partial_rotary_factor"}


def _frequency_rtol(scaling: RopeScaling) -> float:
    """numpy's and torch's float32 pow, then the scaling's roundings (see rotary_frequency_ulps)."""
    return ulp_bound(rotary_frequency_ulps(scaling.kind, scaling.factor, scaling.low_freq_factor,
                                           scaling.high_freq_factor))


def _transformers_config(head_dim: int, theta: float, scaling: RopeScaling):
    rope = {"rope_theta": theta}
    for field in dataclasses.fields(scaling):
        if field.name == "kind" or field.name in SCALINGS[scaling.kind]:
            value = getattr(scaling, field.name)
            if value is not None:
                rope[_TRANSFORMERS_NAMES.get(field.name, field.name)] = value
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=int(scaling.factor * (scaling.original_max_seq_len or 64)),
                                    rope_parameters=rope)


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_match_transformers(case):
    head_dim, theta, scaling = CASES[case]
    config = _transformers_config(head_dim, theta, scaling)
    if scaling.kind == "default":
        theirs, their_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling.kind](config)
    ours, our_factor = rotary_frequencies(head_dim, theta, scaling)
    assert ours.dtype == np.float32 and ours.shape == (head_dim // 2,)
    # Observed: at most 3 ulps (3.6e-7 relative, llama3-tiny); the bounds run from 7.2e-7 (default)
    # to 2.4e-5 (llama3-llama-3.2, whose blend gains 11x).
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=_frequency_rtol(scaling), atol=0, err_msg=case)
    # float64 on both sides, the same math.log and about 5 roundings; observed: equal.
    assert our_factor == pytest.approx(their_factor, rel=ulp_bound(5, dtype=np.float64))


@pytest.mark.parametrize("case", ["llama3-tiny", "yarn-mscale", "yarn-tiny"])
def test_tables_match_transformers_rotary_embedding(case):
    head_dim, theta, scaling = CASES[case]
    module = LlamaRotaryEmbedding(_transformers_config(head_dim, theta, scaling))
    positions = np.array([[0, 1, 2, 7, 63, 255], [5, 16, 31, 64, 200, 1000]])
    with torch.no_grad():
        their_cos, their_sin = module(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions))
    our_cos, our_sin = rotary_angles(jnp.asarray(positions, jnp.int32), head_dim, theta, scaling)
    inv_freq, attention_factor = rotary_frequencies(head_dim, theta, scaling)
    # Each angle position * inv_freq carries the frequencies' relative error and one float32 rounding
    # of its size; cos and sin from two libraries add LIBRARY_ULPS of the result and of the angle; the
    # attention factor's float32 rounding and product, two ulps of it. Observed: 7.3e-5 (llama3-tiny, at
    # angle 269 where the bound is 1.3e-3), 2.8e-5 (yarn-mscale), 1.2e-7 (yarn-tiny); at most 12% of the bound.
    angles = np.abs(positions[..., None] * np.concatenate([inv_freq, inv_freq]).astype(np.float64))
    bound = attention_factor * (angles * (_frequency_rtol(scaling) + ulp_bound(1))
                                + ulp_bound(LIBRARY_ULPS * (1 + angles) + 2))
    assert_within(our_cos, their_cos.numpy(), bound, f"{case} cos")
    assert_within(our_sin, their_sin.numpy(), bound, f"{case} sin")
    # cos(0) = 1 times the factor rounded once to float32. YaRN's factor scales the tables.
    assert np.abs(np.asarray(our_cos)).max() == pytest.approx(attention_factor, rel=ulp_bound(1))


@pytest.mark.parametrize("fields, message", [
    (dict(kind="dynamic", factor=2.0), "rope_type 'dynamic' is not built; Dew builds default, linear, llama3, yarn"),
    (dict(kind="linear", factor=2.0, beta_fast=16.0), "rope_type 'linear' does not read \\['beta_fast'\\]"),
    (dict(kind="default", factor=2.0), "rope_type 'default' does not read \\['factor'\\]"),
    (dict(kind="llama3", factor=8.0, original_max_seq_len=8192), "low_freq_factor None and high_freq_factor None"),
    (dict(kind="llama3", factor=8.0, original_max_seq_len=8192, low_freq_factor=4.0, high_freq_factor=1.0),
     "0 < low_freq_factor < high_freq_factor"),
    (dict(kind="yarn", factor=4.0), "original_max_seq_len None: give the context length"),
    (dict(kind="linear", factor=0.0), "factor 0.0; it must be positive"),
    (dict(kind="proportional", rotated_fraction=1.5), "rotated_fraction 1.5; it is the share of each head"),
    (dict(kind="linear", factor=2.0, rotated_fraction=0.5), "rope_type 'linear' does not read \\['rotated_fraction'\\]"),
])
def test_bad_scalings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(**fields)


def test_decoder_config_reads_scaling_back_from_json_and_stays_hashable():
    scaling = RopeScaling("yarn", 4.0, 64)
    model = models.build("causal_transformer", vocab_size=8, emb_features=32, num_layers=2, num_heads=4,
                         sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                         rope_scaling=scaling, local_rope_scaling=RopeScaling())
    config = model.config
    rebuilt = models.build("causal_transformer", **json.loads(json.dumps(to_json(config)))).config
    assert rebuilt == config and hash(rebuilt) == hash(config)
    assert [config.layer_rope(i) for i in range(2)] == [(10000.0, RopeScaling()), (10000.0, scaling)]
    with pytest.raises(ValueError, match="local_rope_scaling applies to sliding layers"):
        models.build("causal_transformer", vocab_size=8, emb_features=32, num_layers=2, num_heads=4,
                     local_rope_scaling=scaling)


def test_rotation_backward_matches_autodiff_of_the_rotation():
    """`apply_rotary`'s own backward (the cotangent rotated back) against autodiff of the rotation as
    written, for the input and both tables, in float32; and the cotangent keeps a bfloat16 input's dtype.
    Each cotangent element is the same two products and one sum either way (`-rotate_half(g) * sin` is
    the transpose of `rotate_half(x) * sin` because the table's halves are equal), so only the order of
    an add or a fused multiply-add may differ: a few float32 ulps of the larger term."""
    import jax

    from dew.nn.rotary import _rotate, apply_rotary

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 6, 3, 8)), jnp.float32)
    cos, sin = rotary_angles(jnp.broadcast_to(jnp.arange(6), (2, 6)) * 7 + 3, 8, 100.0)
    g = jnp.asarray(rng.standard_normal((2, 6, 3, 8)), jnp.float32)
    ours = jax.vjp(apply_rotary, x, cos, sin)[1](g)
    plain = jax.vjp(_rotate, x, cos, sin)[1](g)
    for name, a, b in zip(("x", "cos", "sin"), ours, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6, err_msg=name)
    assert np.asarray(ours[0]).any() and np.asarray(ours[1]).any()
    dx_bf16 = jax.vjp(lambda v: apply_rotary(v, cos, sin), x.astype(jnp.bfloat16))[1](g.astype(jnp.bfloat16))[0]
    assert dx_bf16.dtype == jnp.bfloat16
    # bfloat16 (8 significant bits) rounds the input, the cotangent and the result, each by 2^-9
    # relative; the terms are under 4 in size.
    np.testing.assert_allclose(np.asarray(dx_bf16, np.float32), np.asarray(ours[0]), rtol=0.02, atol=0.05)


def test_rotation_heads_major_is_the_rotation_transposed():
    """`apply_rotary` with `heads_axis` 1 on `[B, H, S, D]` gives, forward and backward, the bits the
    default gives on `[B, S, H, D]` transposed: the same elementwise products, in another layout."""
    import jax

    from dew.nn.rotary import apply_rotary

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 6, 3, 8)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((2, 6, 3, 8)), jnp.bfloat16)
    cos, sin = rotary_angles(jnp.broadcast_to(jnp.arange(6), (2, 6)) * 5 + 1, 8, 100.0)
    seq, seq_vjp = jax.vjp(apply_rotary, x, cos, sin)
    heads, heads_vjp = jax.vjp(lambda x, c, s: apply_rotary(x, c, s, 1), x.transpose(0, 2, 1, 3), cos, sin)
    np.testing.assert_array_equal(np.asarray(heads.transpose(0, 2, 1, 3), np.float32), np.asarray(seq, np.float32))
    (dx_seq, *dtables_seq), (dx_heads, *dtables_heads) = seq_vjp(g), heads_vjp(g.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np.asarray(dx_heads.transpose(0, 2, 1, 3), np.float32),
                                  np.asarray(dx_seq, np.float32))
    # the tables' cotangents sum three heads' float32 products: at most 2 roundings of the terms' size apart
    # (observed: equal)
    terms = float(np.abs(np.asarray(g, np.float32)).sum(axis=2).max() * np.abs(np.asarray(x, np.float32)).max())
    for ours, theirs in zip(dtables_heads, dtables_seq):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=ulp_bound(2, terms))


def test_tables_are_evaluated_once_per_step():
    """The cos and sin tables reach every query and key rotation, forward and backward, as arrays:
    the compiled gradient of two layers' rotations evaluates each function once, on half the head
    dimension. (Left as expressions, XLA's CPU backend fused them into each consumer, and each
    re-ran libm's scalar `sincosf` over the whole table.)"""
    import jax

    from dew.nn.rotary import apply_rotary

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 16, 3, 8)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((2, 8, 8)), jnp.float32)

    def loss(x, weights, positions):
        cos, sin = rotary_angles(positions, 8, 100.0)
        for w in weights:  # two layers, each rotating its queries and keys
            q, k = apply_rotary(x @ w, cos, sin), apply_rotary(x @ w.T, cos, sin)
            x = jnp.tanh(q * k)
        return jnp.sum(x)

    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, weights, positions).compile().as_text()
    counts = {op: text.count(f" {op}(") for op in ("sine", "cosine")}
    assert counts == {"sine": 1, "cosine": 1}, f"the tables were evaluated {counts} times in the compiled step"
    assert "f32[2,16,4]{2,1,0} sine(" in text  # each frequency once, before the halves are repeated
