"""Gemma 3n's text decoder (`gemma3n_text`) against transformers' `Gemma3nForCausalLM` on tiny random checkpoints, in
float32: logits (left-padded rows too), cached greedy continuations against `generate`, one SGD step and a training
forward (AltUp's coefficients clipped), save -> transformers reload, and the config fields it refuses by name."""

from __future__ import annotations

import copy
import json
import math
from functools import partial

import jax
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.families import decoder_kwargs, family_for
from dew.nn.gemma3n import Gemma3nLayers
from dew.nn.gemma4 import Gemma4Layers
from dew.nn.transformer import FULL, SLIDING, DecoderConfig
from tests.interop.conftest import save_checkpoint, scatter_weights, sized, torch, transformers
from tests.interop.text_decoder_checks import (
    check_cached_continuation, check_left_padded_logits, check_save_reloads, sgd_step_both, their_logits,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, decoder_ulps, ulp_bound

CLIP = 0.4  # AltUp's coefficient clip in training: small enough for weights of N(0, 0.3^2) to pass it
SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64,
             layer_types=[SLIDING, FULL, SLIDING, FULL], hidden_size_per_layer_input=8, laurel_rank=4,
             final_logit_softcapping=9.0, altup_coef_clip=CLIP, attn_implementation="eager")
CASES = {
    # three streams, the last two layers reading the first two's keys and values, gate sparsity on two layers
    "shared-kv": dict(altup_num_inputs=3, num_kv_shared_layers=2, vocab_size_per_layer_input=97,
                      activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0]),
    # two streams, the second active, no output scale, every layer its own keys; ids 80 and up read the per-layer
    # table's row 0; the widths written per layer, as transformers writes them
    "active-1": dict(altup_num_inputs=2, altup_active_idx=1, altup_correct_scale=False, num_kv_shared_layers=0,
                     vocab_size_per_layer_input=80, intermediate_size=[48] * 4),
}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 11)).astype(np.int32)


def gemma3n_ulps(model, seq_len: int) -> float:
    """Ulps of the logits' size between Dew's and transformers' fp32 logits: `decoder_ulps`, plus per layer what
    Gemma 3n adds along the chain: two more norms of the sandwich and the value and key norms (a mean of squares,
    an rsqrt and a product each); AltUp's prediction and correction (each a `width`-wide norm, the router's `width`
    terms, its scale and tanh, K coefficient terms, the K-term mix or the change, its product and add); LAuReL (left
    over `width`, right over its rank, a norm, the add and the average); the gate's sparsity (a `mlp_width`-term
    mean, a variance of as many, its sqrt, the cutoff, the subtraction); the per-layer gate (`width` terms, the
    activation, the product, its projection over `P`, a norm, the output scale and the add); once, the streams'
    split and merge (per stream a `width`-term projection, a root mean square, a rescale; the K-term mean), the
    per-layer inputs (the projection over the width, its scale, a `P`-wide norm, the sum and its scale) and the
    logit cap. Their rounding walks randomly (sqrt(6 N)); each rsqrt, sqrt and tanh from two libraries adds
    LIBRARY_ULPS."""
    config = model.config
    width, layers, K = config.hidden_size, config.num_hidden_layers, config.altup_num_inputs
    P, rank, mlp_width = config.hidden_size_per_layer_input, config.laurel_rank, config.intermediate_size[0]
    chain = decoder_ulps(layers=layers, width=width, mlp_width=mlp_width, heads=config.num_attention_heads,
                         head_dim=config.head_dim, seq_len=seq_len)
    altup = 2 * ((width + 3) + (width + 2) + K + K + 2)
    per_layer = (2 * (width + 3) + 2 * (config.head_dim + 3) + altup + (width + rank + width + 3 + 3)
                 + (3 * mlp_width + 4) + (width + 3 + P + width + 3 + 2))
    once = 2 * K * (width + width + 4) + K + (width + 2 + P + 3 + 2) + 3
    transcendental = LIBRARY_ULPS * (layers * 12 + 2 * K + 2)
    return chain + math.sqrt(6 * (layers * per_layer + once)) + transcendental


def _bound(model, theirs, seq_len=TOKENS.shape[1]):
    assert np.abs(theirs).max() > 2.0  # weights large enough for a wrong convention to show
    return ulp_bound(gemma3n_ulps(model, seq_len), np.abs(theirs).max())


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    """(case, transformers model, its directory, Dew's load of it)."""
    config = transformers.Gemma3nTextConfig(**{**SHAPE, **CASES[request.param]})
    torch.manual_seed(0)
    model = scatter_weights(transformers.Gemma3nForCausalLM(config).eval())
    with torch.no_grad():  # inside the clip: transformers clamps these in place while training (see below)
        for layer in model.model.layers:
            layer.altup.prediction_coefs.weight.clamp_(-CLIP, CLIP)
    directory = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, directory, load_pretrained(directory, dtype="float32", max_seq_len=64)


def test_config_reads_as_layer_specs(loaded):
    case, model, directory, bundle = loaded
    config = bundle.model.config
    theirs = model.config
    assert [spec.mixer.shared_kv for spec in config.layer_specs] == theirs.kv_sharing_modes
    for spec, layer in zip(config.layer_specs, model.model.layers):
        assert spec.feed_forward.sparsity == pytest.approx(layer.mlp.activation_sparsity)
        assert spec.feed_forward.features == layer.mlp.intermediate_size
        assert (spec.altup.inputs, spec.altup.active, spec.altup.clip, spec.altup.scale_output) == (
            theirs.altup_num_inputs, theirs.altup_active_idx, theirs.altup_coef_clip, theirs.altup_correct_scale)
        assert spec.laurel_rank == theirs.laurel_rank and spec.per_layer_input == theirs.hidden_size_per_layer_input
        assert spec.mixer.value_norm and spec.mixer.query_scale == 1.0
    assert family_for(config).model_type == "gemma3n_text"  # the only family computing these layers
    written = family_for(config).to_hf_config(config)
    assert decoder_kwargs(written) == decoder_kwargs(json.loads((directory / "config.json").read_text()))


def test_logits_match_transformers_with_left_padding(loaded):
    """The first row whole (15 tokens), the second left-padded by 4: transformers with the mask and positions
    counted from each row's first real token."""
    case, model, _, bundle = loaded
    assert (TOKENS >= 80).any()  # ids past active-1's per-layer table
    # bounds 1.3e-3 on logits up to 5.9 (active-1) and 5.8 (shared-kv); observed 5.9e-6 and 9.1e-6
    check_left_padded_logits(model, bundle, TOKENS, partial(_bound, model), case)


@pytest.mark.parametrize("loaded", ["shared-kv"], indirect=True)  # shared and own caches, sliding and full
def test_cached_greedy_continuation_matches_generate(loaded):
    """16 new tokens past the window of 4, and the logits of each cached step against transformers' over the whole
    sequence: with shared keys and values, the shared layers read the earlier layers' cache."""
    case, model, _, bundle = loaded
    prompt = [int(t) for t in TOKENS[0, :6]]
    # bound 1.6e-3 on logits up to 5.4; observed 1.4e-5
    check_cached_continuation(model, bundle, prompt, partial(_bound, model), case)


@pytest.mark.parametrize("loaded", ["shared-kv"], indirect=True)  # every knob; a step compiles per case
def test_one_sgd_step_matches_transformers(loaded):
    """Training clips AltUp's correction coefficients (some of these lie past the clip: their gradient is zero on
    both sides) and the prediction ones (inside it here: transformers clamps those in place, which the next test
    takes on)."""
    case, model, directory, bundle = loaded
    correction = np.concatenate([layer.altup.correction_coefs.weight.detach().numpy().ravel()
                                 for layer in model.model.layers])
    assert (np.abs(correction) > CLIP).any()
    params, stepped = sgd_step_both(bundle, directory, transformers.Gemma3nForCausalLM, TOKENS[:, :9],
                                    train_mode=True)
    apply = jax.jit(bundle.model.apply)
    ours, before = np.asarray(apply(params, TOKENS)), np.asarray(apply(bundle.variables, TOKENS))
    theirs = their_logits(stepped, TOKENS)
    assert np.abs(ours - before).max() > 1e-2  # the step moved the logits well past the bound's reach
    # the forward chain over the stepped weights, whose own difference (the gradients' ulps times the rate) is
    # far below it; bound 9.9e-4, observed 2.6e-5 on logits up to 5.4
    assert_within(ours, theirs, _bound(stepped, theirs), case)


@pytest.mark.parametrize("loaded", ["shared-kv"], indirect=True)
def test_a_training_forward_clips_the_coefficients(loaded):
    """The prediction coefficients tripled past the clip: a forward with a dropout rng (as training losses run it)
    computes what transformers' training-mode forward does, and differs from the unclipped inference forward."""
    case, model, _, bundle = loaded
    theirs_model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in theirs_model.model.layers:
            layer.altup.prediction_coefs.weight.mul_(3.0)
    variables = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 3.0 if "prediction_coefs" in jax.tree_util.keystr(path) else x, bundle.variables)
    apply = jax.jit(bundle.model.apply)
    inference = np.asarray(apply(variables, TOKENS))
    ours = np.asarray(jax.jit(lambda v, t: bundle.model.apply(v, t, rngs={"dropout": jax.random.key(0)}))(
        variables, TOKENS))
    np.testing.assert_allclose(inference, their_logits(theirs_model, TOKENS), atol=_bound(model, inference), rtol=0)
    theirs = their_logits(theirs_model.train(), TOKENS)  # clamps the weights in place
    assert np.abs(ours - inference).max() > 1e-1
    # bound 1.0e-3, observed 1.5e-5 on logits up to 5.6
    assert_within(ours, theirs, _bound(model, theirs), case)


def test_save_reloads_in_transformers(loaded, tmp_path):
    case, model, directory, bundle = loaded
    check_save_reloads(bundle, directory, transformers.Gemma3nForCausalLM, model, tmp_path / "export", TOKENS)


GEMMA3N = sized("gemma3n_text", num_hidden_layers=2, layer_types=[SLIDING, FULL], num_kv_shared_layers=0,
                activation_sparsity_pattern=[0.0, 0.0])


@pytest.mark.parametrize("source, message", [
    ({**GEMMA3N, "intermediate_size": [8, 16]}, "'intermediate_size' = \\[8, 16\\] .* one MLP width for every layer"),
    ({**GEMMA3N, "activation_sparsity_pattern": [0.5]}, "'activation_sparsity_pattern' = \\[0.5\\] .* a list of 2"),
    ({**GEMMA3N, "activation_sparsity_pattern": 0.5}, "'activation_sparsity_pattern' = 0.5 .* one fraction"),
    ({**GEMMA3N, "altup_active_idx": 4}, "'altup_active_idx' = 4 .* one of the altup_num_inputs 4 streams"),
    ({**GEMMA3N, "hidden_size_per_layer_input": 0}, "'hidden_size_per_layer_input' = 0 .* always read per-layer"),
    ({**GEMMA3N, "altup_coef_clip": 0.0}, "'altup_coef_clip' = 0.0 .* above 0"),
    ({**GEMMA3N, "num_kv_shared_layers": 2}, "'num_kv_shared_layers' = 2 .* at least the first layer must compute"),
    ({**GEMMA3N, "num_hidden_layers": 3, "layer_types": [FULL, SLIDING, FULL], "num_kv_shared_layers": 2,
      "activation_sparsity_pattern": [0.0] * 3}, "the shared sliding_attention layers have no earlier sliding"),
])
def test_refusals_name_the_field(source, message):
    with pytest.raises(ValueError, match=message):
        decoder_kwargs(source)


def test_transformers_defaults_read_as_gemma_3n():
    """transformers' own default config (E4B's shape): every fifth layer full, the first ten sparse at 0.95, the last
    fifteen sharing keys and values."""
    kwargs = decoder_kwargs(transformers.Gemma3nTextConfig().to_dict())
    g = kwargs["gemma3n"]
    assert g.sparsity == (0.95,) * 10 + (0.0,) * 25 and g.kv_shared_layers == 15
    assert [i for i, kind in enumerate(kwargs["layer_types"]) if kind == FULL] == [4, 9, 14, 19, 24, 29, 34]
    assert kwargs["logit_softcap"] == 30.0 and kwargs["local_rope_theta"] == 10_000.0


@pytest.mark.parametrize("options, error, message", [
    (dict(), ValueError, "gemma3n with norm_placement 'pre' .* use 'sandwich'"),
    (dict(norm_placement="sandwich", gemma3n=Gemma3nLayers(sparsity=(0.5,))), ValueError,
     "gemma3n sparsity gives 1 values for 2 layers"),
    (dict(norm_placement="sandwich", gemma4=Gemma4Layers()), NotImplementedError, "gemma3n with \\['gemma4'\\]"),
    (dict(norm_placement="sandwich", gemma3n={"altup_inputs": 2, "altup_active": 2}), ValueError,
     "altup active is 2; .* 0 to 1 of 2"),
])
def test_decoder_config_refuses_what_gemma_3n_layers_cannot_be(options, error, message):
    with pytest.raises(error, match=message):
        DecoderConfig(vocab_size=10, num_layers=2, **{"gemma3n": Gemma3nLayers(), **options})
