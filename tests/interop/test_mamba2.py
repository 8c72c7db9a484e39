"""The mamba2 family: tiny transformers Mamba2ForCausalLM checkpoints made here, loaded, compared
(logits, cached greedy generation), saved back for transformers, trained and resumed; and mamba_ssm's
own format (no model_type, `backbone.embedding`, a padded vocabulary) read as transformers' port."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.export import save_pretrained
from dew.interop.families import FAMILIES, family_for, family_of
from dew.interop.families.mamba2 import port_config
from dew.nn.mamba2 import Mamba2
from dew.nn.transformer import LINEAR, CausalTransformer, DecoderConfig
from dew.sampling import Sampling
from tests.compiled import compiled
from tests.interop.conftest import (
    check_training_resumes_bit_exactly, in_torch_memory, save_checkpoint, torch, transformers,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

VOCAB = 64  # the training stream draws ids below 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8, conv_kernel=4,
             num_hidden_layers=2, eos_token_id=2, pad_token_id=0, bos_token_id=1)
TOKENS = np.random.default_rng(5).integers(3, VOCAB, (2, 13))


def torch_mamba2(seed: int = 0, **overrides):
    """A transformers Mamba2 with random weights of order one, so a wrong convention shows."""
    config = transformers.Mamba2Config(**{**SHAPE, "n_groups": 2, "chunk_size": 8, **overrides})
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.copy_(torch.log(torch.linspace(0.5, 4.0, parameter.numel())))
            elif name.endswith("dt_bias"):
                parameter.copy_(torch.linspace(-3.0, 0.5, parameter.numel()))
            elif "norm" in name or name.endswith(".D") or name.endswith("bias"):
                parameter.copy_(1.0 + 0.3 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.3)
    return model


def bound(config, seq_len: int, magnitude: float) -> float:
    """fp32 against transformers: per layer its norm (`hidden` terms, an rsqrt) and the mixer (as
    tests/nn/test_mamba2.py's `layer_bound` counts it: projections, convolution, the scan's sums
    within and between chunks, the gated norm), then the final norm and the head (`hidden` terms); the
    roundings walk randomly (six standard deviations), each library function (an rsqrt per norm,
    softplus, the decays' exp, two silu) may differ by `LIBRARY_ULPS`, and a decay's exponent, a sum
    of up to `chunk` terms, carries its rounding into the exponential in full; logits up to
    `magnitude`. The two layers compound: each layer's output error enters the next one's input."""
    hidden, inner = config.hidden_size, config.num_heads * config.head_dim
    chunk = min(config.chunk_size, seq_len)
    per_layer = (hidden + 3 + hidden + config.conv_kernel + 4 * config.state_size + 2 * chunk + seq_len // chunk
                 + inner // config.n_groups + inner)
    roundings = config.num_hidden_layers * per_layer + 2 * hidden + 3
    library = LIBRARY_ULPS * (7 * config.num_hidden_layers + 1)
    return ulp_bound(math.sqrt(6 * roundings) + library + 4 * chunk * config.num_hidden_layers, magnitude)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = torch_mamba2()
    return save_checkpoint(model, tmp_path_factory.mktemp("mamba2"), tokenizer=True), model


@pytest.fixture(scope="module")
def bundle(checkpoint):
    return load_pretrained(checkpoint[0])


@pytest.mark.parametrize("seq_len", [16, 13])
def test_logits_match_transformers(checkpoint, bundle, seq_len):
    """Two groups, chunk 8, at a multiple of the chunk and not (observed 2.6e-6 of logits up to 5.6, against
    a bound of 1.1e-4)."""
    _, model = checkpoint
    tokens = np.random.default_rng(seq_len).integers(3, VOCAB, (2, seq_len))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(tokens, jnp.int32)))
    magnitude = float(np.abs(theirs).max())
    assert magnitude > 2.0
    assert_within(ours, theirs, bound(model.config, seq_len, magnitude), "logits")


def test_the_config_reads_as_mamba2_layers_without_feed_forward(bundle):
    config = bundle.model.config
    assert config.layer_types == ("linear_attention",) * 2 and config.mlp_features == 0
    assert config.recurrent.n_groups == 2 and config.recurrent.chunk_size == 8
    assert family_for(config) is FAMILIES["mamba2"]


def test_cached_greedy_generation_equals_transformers_generate(checkpoint, bundle):
    _, model = checkpoint
    prompt = [5, 17, 3, 44, 9]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ours = bundle.text_generation(Sampling(temperature=0.0))([prompt], 12)
    assert [int(t) for t in ours.continuations()[0]] == theirs


def test_save_reloads_in_transformers_with_equal_logits(checkpoint, bundle, tmp_path):
    """Saved weights are the loaded ones, bit for bit: transformers computes what it computed before."""
    _, model = checkpoint
    directory = bundle.save(tmp_path / "export")
    again = in_torch_memory(transformers.Mamba2ForCausalLM.from_pretrained(directory).eval())
    with torch.no_grad():
        before = model(torch.from_numpy(TOKENS)).logits.numpy()
        after = again(torch.from_numpy(TOKENS)).logits.numpy()
    np.testing.assert_array_equal(after, before)
    assert family_of(json.loads((directory / "config.json").read_text())) is FAMILIES["mamba2"]


@pytest.mark.slow
def test_a_dew_mamba2_model_saves_as_the_port(tmp_path):
    """A model built in Dew (its own max_seq_len) writes a config transformers reads back as it."""
    config = DecoderConfig(vocab_size=VOCAB, emb_features=32, num_layers=2, mlp_features=0, max_seq_len=64,
                           norm_eps=1e-5, layer_types=(LINEAR,) * 2,
                           recurrent=Mamba2(num_heads=8, head_dim=8, state_size=8, chunk_size=8))
    model = CausalTransformer(config)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    directory = save_pretrained(model, variables, tmp_path / "fresh")
    theirs = transformers.Mamba2ForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        expected = theirs(torch.from_numpy(TOKENS)).logits.numpy()
    ours = np.asarray(compiled(model.apply, variables, jnp.asarray(TOKENS, jnp.int32)))
    assert_within(ours, expected, bound(theirs.config, TOKENS.shape[1], max(1.0, float(np.abs(expected).max()))),
                  "logits")


@pytest.mark.slow
def test_training_a_loaded_model_resumes_bit_exactly(bundle, tmp_path):
    """Two steps, a checkpoint, two more, equal four straight, bit for bit; the loss falls."""
    check_training_resumes_bit_exactly(bundle, tmp_path)


# ---- mamba_ssm's own format --------------------------------------------------------------------------

NATIVE = {"d_model": 32, "d_intermediate": 0, "n_layer": 2, "vocab_size": 58,
          "ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 8, "ngroups": 1, "chunk_size": 8},
          "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
          "pad_vocab_size_multiple": 16, "tie_embeddings": True}


@pytest.fixture(scope="module")
def native_checkpoint(tmp_path_factory):
    """A mamba_ssm directory: its config.json and pytorch_model.bin under mamba_ssm's names, the
    embedding padded to 64 rows (58 up to a multiple of 16) and the head tied to it."""
    model = torch_mamba2(vocab_size=64, n_groups=1, tie_word_embeddings=True)
    directory = tmp_path_factory.mktemp("mamba_ssm")
    state = {name.replace("backbone.embeddings.", "backbone.embedding."): tensor.clone()
             for name, tensor in model.state_dict().items()}
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps(NATIVE))
    return directory, model


def test_mamba_ssm_config_reads_as_the_port(tmp_path):
    config = port_config(NATIVE)
    assert config["vocab_size"] == 64 and config["num_heads"] == 8 and config["n_groups"] == 1
    assert config["model_type"] == "mamba2" and config["tie_word_embeddings"] is True
    (tmp_path / "config.json").write_text(json.dumps(config))  # strict JSON: the infinity tagged as transformers does
    assert transformers.Mamba2Config.from_json_file(tmp_path / "config.json").time_step_limit[1] == math.inf


def test_a_mamba_ssm_checkpoint_loads_as_the_port_and_saves_it(native_checkpoint, tmp_path):
    directory, model = native_checkpoint
    bundle = load_pretrained(directory)
    assert bundle.config["model_type"] == "mamba2" and bundle.model.config.vocab_size == 64
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(TOKENS, jnp.int32)))
    assert_within(ours, theirs, bound(model.config, TOKENS.shape[1], float(np.abs(theirs).max())), "logits")
    again = in_torch_memory(transformers.Mamba2ForCausalLM.from_pretrained(bundle.save(tmp_path / "port")).eval())
    with torch.no_grad():
        np.testing.assert_array_equal(again(torch.from_numpy(TOKENS)).logits.numpy(), theirs)


@pytest.mark.parametrize("edit, says", [
    (dict(ssm_cfg={}), r"ssm_cfg names layer 'Mamba1' .* Mamba1 checkpoints .* are not built yet"),
    (dict(attn_layer_idx=[1]), r"'attn_layer_idx' = \[1\]: attention layers among the Mamba2 ones are not built"),
    (dict(ssm_cfg={"layer": "Mamba2", "norm_before_gate": True}), r"ssm_cfg 'norm_before_gate' = True is not"),
    (dict(ssm_cfg={"layer": "Mamba2", "d_ssm": 32}), r"ssm_cfg 'd_ssm' = 32 is not something Dew computes"),
    (dict(moe=True), r"names \['moe'\], which mamba_ssm's MambaConfig does not have"),
])
def test_a_mamba_ssm_config_the_port_does_not_compute_is_refused_by_name(edit, says):
    with pytest.raises(ValueError, match=says):
        port_config({**NATIVE, **edit})


def test_without_load_pretrained_a_mamba_ssm_config_is_named_as_such():
    with pytest.raises(ValueError, match=r"has no model_type \(mamba_ssm's own format: load_pretrained reads it"):
        family_of(NATIVE)
