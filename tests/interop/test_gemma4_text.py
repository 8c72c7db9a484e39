"""Gemma 4's text decoder (`gemma4_text`) against transformers' `Gemma4ForCausalLM` on tiny random checkpoints, in
float32: logits (left-padded rows too), cached greedy continuations against `generate`, one SGD step, save ->
transformers reload, and the config fields it refuses by name."""

from __future__ import annotations

import json
import math
from functools import partial

import jax
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.export import save_pretrained
from dew.interop.families import decoder_kwargs, family_for
from dew.nn.layer import CONSTANTS
from dew.nn.transformer import CausalTransformer
from tests.interop.conftest import save_checkpoint, scatter_weights, sized, torch, transformers
from tests.interop.text_decoder_checks import (
    check_cached_continuation, check_left_padded_logits, check_save_reloads, sgd_step_both, their_logits,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, decoder_ulps, rotary_frequency_ulps, ulp_bound

SLIDING, FULL = "sliding_attention", "full_attention"
SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=4, max_position_embeddings=64,
             layer_types=[SLIDING, FULL, SLIDING, FULL], attn_implementation="eager")
CASES = {
    # every Gemma 4 knob on: per-layer inputs, the last two layers reading the first two's keys and values with a
    # double-wide MLP, full layers of one key/value head reading values from the key projection, capped logits
    "ple-shared-kv": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, num_kv_shared_layers=2,
                          use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
                          final_logit_softcapping=9.0),
    # none of them: full layers with their own value projection (and the config's key/value heads)
    "plain": dict(hidden_size_per_layer_input=0, attention_k_eq_v=False, num_global_key_value_heads=1),
    # the experts' block beside every layer's MLP: 4 experts of width 24, 2 per token
    "moe": dict(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=24, attention_k_eq_v=True, num_global_key_value_heads=1),
}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 11)).astype(np.int32)


def gemma4_ulps(model, seq_len: int) -> float:
    """Ulps of the logits' size between Dew's and transformers' fp32 logits: `decoder_ulps` over the widest heads
    (the full layers') and MLP (a shared layer's, doubled), plus per layer what Gemma 4 adds along the chain: two
    more norms of the sandwich and the value and key norms (a mean of squares, an rsqrt and a product each), the
    layer scalar, with the experts' block three more norms, the router (a `width`-term logit, a softmax, the top
    weights' sum, division and expert scale), each chosen expert (gate and up over the width, the activation,
    down over its width, its weight) and the halves' sum, and with per-layer inputs the gate (`width` terms, the activation, the product), its projection
    (`P` terms), its norm and add; once, the per-layer inputs themselves (the projection over the width, its
    scale, a `P`-wide norm, the sum and its scale) and the logit cap (a division, tanh, a product). Their rounding
    walks randomly (sqrt(6 N)); each rsqrt and tanh from two libraries adds LIBRARY_ULPS."""
    config = model.config
    width, layers = config.hidden_size, config.num_hidden_layers
    head_dim = max(layer.self_attn.head_dim for layer in model.model.layers)
    mlp_width = config.intermediate_size * (2 if config.use_double_wide_mlp else 1)
    chain = decoder_ulps(layers=layers, width=width, mlp_width=mlp_width, heads=config.num_attention_heads,
                         head_dim=head_dim, seq_len=seq_len,
                         frequency_ulps=rotary_frequency_ulps("proportional"))
    P = config.hidden_size_per_layer_input
    per_layer = 2 * (width + 3) + 2 * (head_dim + 3) + 1
    if P:
        per_layer += (width + 3) + P + (width + 3) + 1
    experts = 0
    if config.enable_moe_block:
        experts = 3 * (width + 3) + (width + 3) + (config.top_k_experts + 2) + config.top_k_experts * (
            2 * width + 3 + config.moe_intermediate_size + 1) + 1
    once = (width + 2 + (P + 3) + 2 if P else 0) + 3
    transcendental = LIBRARY_ULPS * (layers * (4 + (2 if P else 0) + (5 if experts else 0)) + 2)
    per_layer += experts
    return chain + math.sqrt(6 * (layers * per_layer + once)) + transcendental


def _bound(model, theirs, seq_len=TOKENS.shape[1]):
    assert np.abs(theirs).max() > 2.0  # weights large enough for a wrong convention to show
    return ulp_bound(gemma4_ulps(model, seq_len), np.abs(theirs).max())


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    """(case, transformers model, its directory, Dew's load of it)."""
    config = transformers.Gemma4TextConfig(**SHAPE, **CASES[request.param])
    torch.manual_seed(0)
    model = scatter_weights(transformers.Gemma4ForCausalLM(config).eval())
    with torch.no_grad():  # transformers' buffers start at one, which would hide a misplaced scalar
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    directory = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, directory, load_pretrained(directory, dtype="float32", max_seq_len=64)


def test_config_reads_as_layer_specs(loaded):
    case, model, _, bundle = loaded
    config = bundle.model.config
    specs = config.layer_specs
    shared = model.config.num_kv_shared_layers
    assert [spec.mixer.shared_kv for spec in specs] == (["store", "store", "reuse", "reuse"] if shared else [None] * 4)
    for spec, layer in zip(specs, model.model.layers):
        attention = layer.self_attn
        assert spec.mixer.head_dim == attention.head_dim
        assert spec.mixer.num_kv_heads == attention.config.num_attention_heads // attention.num_key_value_groups
        assert spec.mixer.keys_as_values == (attention.use_alternative_attention and not attention.is_kv_shared_layer)
        dense = getattr(spec.feed_forward, "dense", spec.feed_forward)  # beside the experts, with their block
        assert dense.features == layer.mlp.intermediate_size
        assert hasattr(spec.feed_forward, "sparse") == model.config.enable_moe_block
        assert spec.per_layer_input == model.config.hidden_size_per_layer_input
    assert family_for(config).model_type == "gemma4_text"  # the only family computing these layers
    written = family_for(config).to_hf_config(config)
    assert decoder_kwargs(written) == decoder_kwargs(json.loads((loaded[2] / "config.json").read_text()))


def test_logits_match_transformers_with_left_padding(loaded):
    """The first row whole (15 tokens), the second left-padded by 4: transformers with the mask and positions
    counted from each row's first real token."""
    case, model, _, bundle = loaded
    # bounds 1.4e-3 to 1.5e-3 on logits up to 6.6 (ple-shared-kv), 6.8 (plain) and 6.6 (moe); observed 1.2e-5,
    # 6.2e-6 and 9.1e-6
    check_left_padded_logits(model, bundle, TOKENS, partial(_bound, model), case)


@pytest.mark.parametrize("loaded", ["ple-shared-kv"], indirect=True)  # shared and own caches, sliding and full
def test_cached_greedy_continuation_matches_generate(loaded):
    """16 new tokens past the window of 4, and the logits of each cached step against transformers' over the whole
    sequence: with shared keys and values, the shared layers read the earlier layers' cache."""
    case, model, _, bundle = loaded
    prompt = [int(t) for t in TOKENS[0, :6]]
    # bound 1.6e-3 on logits up to 5.5; observed 5.5e-6
    check_cached_continuation(model, bundle, prompt, partial(_bound, model), case)


@pytest.mark.parametrize("loaded", ["ple-shared-kv"], indirect=True)  # every knob; a step compiles per case
def test_one_sgd_step_matches_transformers(loaded):
    case, model, directory, bundle = loaded
    params, stepped = sgd_step_both(bundle, directory, transformers.Gemma4ForCausalLM, TOKENS[:, :9])
    # the frozen scalars are not trained
    np.testing.assert_array_equal(np.asarray(params[CONSTANTS]["layers_1"]["layer_scalar"]),
                                  np.asarray(bundle.variables[CONSTANTS]["layers_1"]["layer_scalar"]))
    apply = jax.jit(bundle.model.apply)
    ours, before = np.asarray(apply(params, TOKENS)), np.asarray(apply(bundle.variables, TOKENS))
    theirs = their_logits(stepped, TOKENS)
    assert np.abs(ours - before).max() > 1e-2  # the step moved the logits well past the bound's reach
    # the forward chain over the stepped weights, whose own difference (the gradients' ulps times the rate) is
    # far below it; bound 1.1e-3, observed 1.7e-5 on logits up to 6.6
    assert_within(ours, theirs, _bound(stepped, theirs), case)


def test_save_reloads_in_transformers(loaded, tmp_path):
    case, model, directory, bundle = loaded
    check_save_reloads(bundle, directory, transformers.Gemma4ForCausalLM, model, tmp_path / "export", TOKENS)


@pytest.mark.parametrize("loaded", ["ple-shared-kv"], indirect=True)
def test_a_model_from_scratch_exports_as_gemma4_text(loaded, tmp_path):
    """A decoder built with the loaded one's config and other weights (the loaded ones moved by N(0, 0.3^2), layer
    scalars included; an init would compile one more program): `save_pretrained` picks gemma4_text, and
    transformers' load of the export gives Dew's logits."""
    _, _, _, bundle = loaded
    model = CausalTransformer(bundle.model.config)
    rng = np.random.default_rng(1)
    variables = jax.tree_util.tree_map(lambda x: x + rng.normal(0.0, 0.3, x.shape).astype(x.dtype),
                                       bundle.variables)
    out = save_pretrained(model, variables, tmp_path / "scratch")
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma4_text"
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    theirs = their_logits(theirs_model, TOKENS)
    # bound 1.4e-3; observed 1.6e-5 on logits up to 8.1
    assert_within(np.asarray(jax.jit(model.apply)(variables, TOKENS)), theirs, _bound(theirs_model, theirs), "export")


GEMMA4 = sized("gemma4_text", hidden_size_per_layer_input=0)


@pytest.mark.parametrize("source, message", [
    ({**GEMMA4, "enable_moe_block": True, "num_experts": 4}, "'enable_moe_block' = True .* needs num_experts \\(4\\), "
     "top_k_experts \\(None"),
    ({**GEMMA4, "use_bidirectional_attention": "all"}, "'use_bidirectional_attention' = 'all' .* not built"),
    ({**GEMMA4, "use_bidirectional_attention": True}, "'use_bidirectional_attention' = True is not \"vision\" or"),
    ({**GEMMA4, "num_hidden_layers": 2, "layer_types": [FULL, SLIDING]}, "forces the last layer to full_attention"),
    ({**GEMMA4, "num_hidden_layers": 2, "layer_types": [FULL, FULL], "num_kv_shared_layers": 2},
     "'num_kv_shared_layers' = 2 .* at least the first layer must compute its own keys and values"),
    ({**GEMMA4, "num_hidden_layers": 3, "layer_types": [FULL, SLIDING, FULL], "num_kv_shared_layers": 2},
     "the shared sliding_attention layers have no earlier sliding_attention layer"),
    ({**GEMMA4, "num_hidden_layers": 2, "layer_types": [SLIDING, FULL], "per_layer_config": {"0": {"head_dim": 4}}},
     "'per_layer_config' .* one head width and key/value head count for every full layer"),
])
def test_refusals_name_the_field(source, message):
    with pytest.raises(ValueError, match=message):
        decoder_kwargs(source)


def test_vision_scope_reads_text_causally():
    assert decoder_kwargs({**GEMMA4, "use_bidirectional_attention": "vision"}) == decoder_kwargs(GEMMA4)
