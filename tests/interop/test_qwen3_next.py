"""The hybrid families: tiny transformers Qwen3NextForCausalLM (Gated DeltaNet and gated attention layers,
experts with a shared expert, a dense layer among them) and Qwen3_5ForCausalLM (Qwen 3.5's dense text
decoder) checkpoints made here, loaded, compared (logits, cached greedy generation), saved back for
transformers, and trained and resumed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.families import FAMILIES, decoder_kwargs, family_for, family_of
from dew.nn.gated_deltanet import GatedDeltaNet
from tests.compiled import compiled
from tests.interop.conftest import (
    check_training_resumes_bit_exactly, greedy_continuations, in_torch_memory, save_checkpoint, torch, transformers,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, transformers_decoder_ulps, ulp_bound

VOCAB = 64  # the training stream draws ids below 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
# Qwen3-Next's layer 2 is dense (mlp_only_layers), the others route to 4 experts beside a shared one.
FAMILY_CASES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=16,
                                                                   shared_expert_intermediate_size=24,
                                                                   mlp_only_layers=[2])),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
}


def torch_hybrid(family: str, seed: int = 0):
    """A transformers model of `family` with random weights of order one, so a wrong convention shows."""
    config_class, model_class, options = FAMILY_CASES[family]
    config = getattr(transformers, config_class)(**SHAPE, **options)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.copy_(torch.log(torch.linspace(0.5, 4.0, parameter.numel())))
            elif name.endswith("dt_bias"):
                parameter.copy_(torch.linspace(-3.0, 0.5, parameter.numel()))
            elif "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.3)
    return model


def bound(config, seq_len: int, magnitude: float) -> float:
    """fp32 against transformers: the decoder's roundings and library functions as `decoder_ulps` counts
    them for every layer, plus each linear layer's own (as tests/nn/test_gated_deltanet.py's `layer_bound`
    counts them: the convolution, the L2 norms, the chunk's triangular solve and sums over a chunk of up
    to 64 positions, the state's reads; nine library functions; a decay's exponent, a sum over the
    chunk, carrying its rounding into the exponential in full), with the routed experts' and shared
    expert's gated products (`moe_intermediate_size` terms each) inside the MLP's count; logits up to
    `magnitude`."""
    chunk = min(64, seq_len)
    linear = config.layer_types.count("linear_attention")
    per_linear = (config.linear_conv_kernel_dim + 3 * config.linear_key_head_dim + chunk * chunk + 2 * chunk
                  + config.linear_value_head_dim)
    walk = math.sqrt(6 * linear * per_linear)
    return ulp_bound(transformers_decoder_ulps(config, seq_len) + walk + linear * (9 * LIBRARY_ULPS + 4 * 4 * chunk),
                     magnitude)


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def checkpoint(request, tmp_path_factory):
    model = torch_hybrid(request.param)
    return save_checkpoint(model, tmp_path_factory.mktemp(request.param), tokenizer=True), model


@pytest.fixture(scope="module")
def bundle(checkpoint):
    return load_pretrained(checkpoint[0])


@pytest.mark.parametrize("seq_len", [13, 70])
def test_logits_match_transformers(checkpoint, bundle, seq_len):
    """Within one of transformers' chunks (64) and across two (observed: at most 1.2e-4 of logits up to 8.4,
    Qwen3-Next over 70 tokens, against bounds of 1.6e-3 to 9.8e-3, which the rotations' angle error of
    `decoder_ulps` dominates)."""
    _, model = checkpoint
    tokens = np.random.default_rng(seq_len).integers(3, VOCAB, (2, seq_len))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, tokens.astype(np.int32)))
    magnitude = float(np.abs(theirs).max())
    assert magnitude > 2.0
    assert_within(ours, theirs, bound(model.config, seq_len, magnitude), "logits")


def test_the_config_reads_as_a_hybrid_stack(checkpoint, bundle):
    _, model = checkpoint
    config = bundle.model.config
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.recurrent == GatedDeltaNet(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8,
                                             conv_kernel=4, chunk_size=64)
    assert config.attn_output_gate and config.rope_scaling.rotated_fraction == 0.25 and config.norm_style == "gemma"
    assert family_for(config) is FAMILIES[model.config.model_type]
    if model.config.model_type == "qwen3_next":
        assert config.sparse_layers == (0, 1, 3) and config.mixture.shared_gate


def test_cached_greedy_generation_equals_transformers_generate(bundle, checkpoint):
    ours, theirs = greedy_continuations(checkpoint[1], bundle, [5, 17, 3, 44, 9], tokens=12)
    assert ours == theirs


def test_save_reloads_in_transformers_with_equal_logits(checkpoint, bundle, tmp_path):
    """Saved weights are the loaded ones, bit for bit: transformers computes what it computed before."""
    _, model = checkpoint
    directory = bundle.save(tmp_path / "export")
    again = in_torch_memory(type(model).from_pretrained(directory).eval())
    tokens = torch.from_numpy(np.random.default_rng(5).integers(3, VOCAB, (2, 13)))
    with torch.no_grad():
        np.testing.assert_array_equal(again(tokens).logits.numpy(), model(tokens).logits.numpy())
    assert family_of(json.loads((directory / "config.json").read_text())) is FAMILIES[model.config.model_type]


@pytest.mark.slow
def test_training_a_loaded_model_resumes_bit_exactly(bundle, tmp_path):
    """Two steps, a checkpoint, two more, equal four straight, bit for bit; the weights move."""
    check_training_resumes_bit_exactly(bundle, tmp_path)


def test_the_older_spellings_read_as_transformers_reads_them():
    """Qwen3-Next's first config.json spelled the rotary and the layer pattern at the top level
    (`rope_theta`, `partial_rotary_factor`, `full_attention_interval`) and named Qwen's window switch; it
    reads as transformers' own serialisation of the config it makes from it."""
    old = {"model_type": "qwen3_next", **SHAPE, **FAMILY_CASES["qwen3_next"][2], "num_hidden_layers": 6,
           "rope_theta": 10_000_000, "partial_rotary_factor": 0.5, "full_attention_interval": 3,
           "use_sliding_window": False}
    new = transformers.Qwen3NextConfig(**{k: v for k, v in old.items() if k != "model_type"}).to_dict()
    assert new["layer_types"] == ["linear_attention", "linear_attention", "full_attention"] * 2
    assert new["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert decoder_kwargs(old) == decoder_kwargs(new)
    assert decoder_kwargs(old)["rope_scaling"].rotated_fraction == 0.5


@pytest.mark.parametrize("edit, says", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     r"'layer_types' = .* one 'linear_attention' or 'full_attention' per layer \(4 layers\)"),
    (dict(linear_num_value_heads=3), r"'linear_num_value_heads' = 3 .* not a multiple of key_heads 2"),
    (dict(hidden_act="gelu"), r"'hidden_act' = 'gelu' .* the linear layers' convolution Dew computes is silu"),
])
def test_a_hybrid_config_dew_does_not_compute_is_refused_by_name(edit, says):
    with pytest.raises(ValueError, match=says):
        decoder_kwargs({"model_type": "qwen3_5_text", **SHAPE, **edit})


def test_qwen3_5_moe_text_matches_transformers_and_saves_back(tmp_path):
    """Qwen 3.5-MoE's text decoder: Qwen 3.5's layers, every feed-forward routed to 4 experts (top 2) beside a
    gated shared expert, no dense width in its config; logits within the hybrid bound (observed: 6.6e-5 of
    logits up to 5.8, bound 6.7e-4) and a save transformers reloads with equal logits."""
    shape = {k: v for k, v in SHAPE.items() if k != "intermediate_size"}
    config = transformers.Qwen3_5MoeTextConfig(**{**shape, "num_hidden_layers": 2}, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                               layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "moe")
    model = type(model).from_pretrained(tmp_path / "moe").eval()  # transformers' experts as it runs a loaded model
    bundle = load_pretrained(tmp_path / "moe")
    assert bundle.model.config.mixture.shared_gate and bundle.model.config.sparse_layers == (0, 1)
    tokens = np.random.default_rng(1).integers(3, VOCAB, (2, 13))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, tokens.astype(np.int32)))
    # counted as a dense decoder as wide as the widest expert (the shared one)
    counted = transformers.Qwen3_5TextConfig(**{**SHAPE, "num_hidden_layers": 2, "intermediate_size": 24},
                                             layer_types=["linear_attention", "full_attention"])
    assert_within(ours, theirs, bound(counted, 13, float(np.abs(theirs).max())), "logits")
    again = type(model).from_pretrained(bundle.save(tmp_path / "export")).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(again(torch.from_numpy(tokens)).logits.numpy(), theirs)
