"""One decoder layer from its spec: Gemma 4's (sandwich norms that multiply by `scale`, the dense MLP beside
the experts, a per-layer output scalar) against transformers' `Gemma4TextDecoderLayer`, and bad specs."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dew.nn.layer import CONSTANTS, DecoderLayer, LayerContext, LayerKnobs, LayerSpec
from dew.nn.mlp import DenseSpec
from dew.nn.moe import DenseSparseSpec, Mixture, SparseSpec
from dew.nn.rotary import rotary_angles
from tests.compiled import compiled
from tests.tolerances import LIBRARY_ULPS, decoder_ulps, rotary_frequency_ulps, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tests.hf_gemma4 import attention_state, gemma4_config, gemma4_spec, random_gemma4_weights, to_torch  # noqa: E402

EXPERTS, TOP_K, EXPERT_FEATURES = 4, 2, 24
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")


def gemma4_layer_spec(config, index: int, **options) -> LayerSpec:
    """The `LayerSpec` computing transformers' Gemma 4 layer `index` with its mixture of experts."""
    sparse = SparseSpec(Mixture(EXPERTS, TOP_K, EXPERT_FEATURES, router_norm=True, expert_scale=True),
                        EXPERT_FEATURES, "gelu_tanh")
    return LayerSpec(gemma4_spec(config, index), DenseSparseSpec(DenseSpec(config.intermediate_size, "gelu_tanh"),
                                                                  sparse),
                     "sandwich", "olmo", config.rms_norm_eps, output_scalar="layer_scalar", **options)


def _layer_state(variables) -> dict:
    """transformers' Gemma 4 layer weights from Dew's layer variables."""
    params = variables["params"]
    state = {f"self_attn.{name}": value for name, value in attention_state(params["self_attn"]).items()}
    state.update({f"mlp.{name}.weight": to_torch(np.asarray(params["mlp"][name]["kernel"]).T)
                  for name in ("gate_proj", "up_proj", "down_proj")})
    state.update({f"{name}.weight": to_torch(params[name]["scale"]) for name in _NORMS})
    router, experts = params["router"], params["experts"]
    state.update({"router.proj.weight": to_torch(np.asarray(router["proj"]["kernel"]).T),
                  "router.scale": to_torch(router["scale"]), "router.per_expert_scale": to_torch(router["per_expert_scale"]),
                  "experts.gate_up_proj": to_torch(np.concatenate([np.swapaxes(experts["gate_proj"], 1, 2),
                                                                   np.swapaxes(experts["up_proj"], 1, 2)], axis=1)),
                  "experts.down_proj": to_torch(np.swapaxes(experts["down_proj"], 1, 2)),
                  "layer_scalar": to_torch(variables[CONSTANTS]["layer_scalar"])})
    return state


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gemma4_layer_matches_transformers(layer_type):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer, Gemma4TextRotaryEmbedding

    config = gemma4_config(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K,
                           moe_intermediate_size=EXPERT_FEATURES)
    index = config.layer_types.index(layer_type)
    spec = gemma4_layer_spec(config, index)
    B, S, E = 2, 9, config.hidden_size
    x_BSE = jax.random.normal(jax.random.key(0), (B, S, E))
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cos_BSD, sin_BSD = rotary_angles(positions_BS, *spec.mixer.rope())
    context = LayerContext(rotary={spec.mixer.head_dim: (cos_BSD[None], sin_BSD[None])}, slots_BS=positions_BS,
                           segments_BS=jnp.ones((B, S), jnp.int32))
    knobs = LayerKnobs(window=spec.mixer.window, rope=0, index=0, local=0)
    layer = DecoderLayer(spec)
    variables = nn.meta.unbox(compiled(layer.init, jax.random.key(1), (x_BSE, None, ()), knobs, context))
    assert set(variables) == {"params", CONSTANTS} and set(variables[CONSTANTS]) == {"layer_scalar"}
    assert {"mlp", "router", "experts", *_NORMS} <= set(variables["params"])
    variables = random_gemma4_weights(variables, seed=10 + index)
    (ours, _, _), (record, _) = compiled(layer.apply, variables, (x_BSE, None, ()), knobs, context)

    reference = Gemma4TextDecoderLayer(config, index).eval()
    missing, unexpected = reference.load_state_dict(_layer_state(variables), strict=True)
    assert not missing and not unexpected
    mask = np.array(positions_BS[:, None, :] <= positions_BS[:, :, None])
    if spec.mixer.window is not None:
        mask &= np.asarray(positions_BS[:, :, None] - positions_BS[:, None, :] < spec.mixer.window)
    additive = torch.where(torch.from_numpy(mask)[:, None], 0.0, torch.finfo(torch.float32).min)
    routed = []
    reference.router.register_forward_hook(lambda module, inputs, outputs: routed.append(outputs[2]))
    with torch.no_grad():
        x = to_torch(x_BSE)
        cos_sin = Gemma4TextRotaryEmbedding(config)(x, torch.from_numpy(np.array(positions_BS)), layer_type)
        theirs = reference(x, shared_kv_states={}, position_embeddings=cos_sin, attention_mask=additive).numpy()
    np.testing.assert_array_equal(np.sort(np.asarray(record.experts).reshape(-1, TOP_K), axis=1),
                                  np.sort(routed[0].numpy(), axis=1))
    # The layer chain `decoder_ulps` counts, plus what Gemma 4 adds to it: five more norms (`width + 3`
    # roundings each), the value norm, the router (a norm, a `width`-term projection, a softmax over 4,
    # the per-expert product), the two chosen experts (gate and up of `width` terms, the activation, down
    # of 24, a weighted sum of 2) and the output scalar; and seven more rsqrts, exps and activations from
    # two libraries. Observed: 1.6e-6 (sliding) and 2.6e-6 (full) at outputs up to 6.7; the bounds 2.1e-4, 3.0e-4.
    width = config.hidden_size
    extra = 5 * (width + 3) + (width + 3) + (width + 3) + width + 4 + 1 + 2 * width + 3 + EXPERT_FEATURES + 2 + 1
    ulps = (decoder_ulps(layers=1, width=width, mlp_width=config.intermediate_size, heads=4,
                         head_dim=spec.mixer.head_dim, seq_len=S, frequency_ulps=rotary_frequency_ulps("proportional"))
            + math.sqrt(6 * extra) + 7 * LIBRARY_ULPS)
    bound = ulp_bound(ulps, float(np.abs(theirs).max()))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=bound, err_msg=layer_type)


def test_output_scalar_is_frozen_unless_trainable():
    """The output scalar lives in `constants` (as transformers keeps the buffer), or in `params` when
    trainable; either way the layer's output is multiplied by it."""
    config = gemma4_config(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K,
                           moe_intermediate_size=EXPERT_FEATURES)
    x_BSE = jax.random.normal(jax.random.key(0), (1, 4, config.hidden_size))
    positions_BS = jnp.arange(4, dtype=jnp.int32)[None]
    outputs = {}
    for trainable in (False, True):
        spec = gemma4_layer_spec(config, 0, trainable_scalar=trainable)
        cos_BSD, sin_BSD = rotary_angles(positions_BS, *spec.mixer.rope())
        context = LayerContext(rotary={spec.mixer.head_dim: (cos_BSD[None], sin_BSD[None])}, slots_BS=positions_BS,
                               segments_BS=jnp.ones((1, 4), jnp.int32))
        knobs = LayerKnobs(window=spec.mixer.window, rope=0, index=0, local=0)
        layer = DecoderLayer(spec)
        variables = nn.meta.unbox(layer.init(jax.random.key(1), (x_BSE, None, ()), knobs, context))
        where = "params" if trainable else CONSTANTS
        assert variables[where]["layer_scalar"].tolist() == [1.0]
        assert (CONSTANTS in variables) == (not trainable)
        halved = jax.tree_util.tree_map(lambda x: x, variables)
        halved[where]["layer_scalar"] = jnp.asarray([0.5])
        one = layer.apply(variables, (x_BSE, None, ()), knobs, context)[0][0]
        half = layer.apply(halved, (x_BSE, None, ()), knobs, context)[0][0]
        np.testing.assert_array_equal(np.asarray(half), np.asarray(one) * 0.5)
        outputs[trainable] = np.asarray(one)
    np.testing.assert_array_equal(outputs[False], outputs[True])


def test_dense_beside_sparse_needs_sandwich_norms():
    spec = gemma4_layer_spec(gemma4_config(), 0)
    with pytest.raises(ValueError, match="a DenseSparseSpec \\(Gemma 4's\\) sits between the sandwich's"):
        dataclasses.replace(spec, norm_placement="pre")
