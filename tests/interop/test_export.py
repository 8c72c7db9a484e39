"""Models built from scratch written as transformers checkpoints (`save_pretrained`): the plainest family that
computes each is chosen, transformers loads the export with equal logits, and a family is one converter."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from dew import models
from dew.interop import load_pretrained
from dew.interop.export import generation_config, save_pretrained, write_export
from dew.interop.families import FAMILIES, Converter, family_for, register
from dew.interop.families.llama import DECODER_RULES, LLAMA_FIELDS
from dew.interop.pretrained import generation_defaults
from dew.interop.tensors import Rule
from dew.nn.rotary import RopeScaling
from dew.nn.stack import unstack_variables
from dew.sampling import Sampling
from tests.compiled import compiled
from tests.interop.conftest import torch, transformers
from tests.tolerances import transformers_decoder_ulps, ulp_bound

# Two layers scanned as one run (scan_layers 2), so every export cuts its layers out of stacked leaves.
SHAPE = dict(vocab_size=97, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=48,
             max_seq_len=64, scan_layers=2)
WINDOWS = dict(sliding_window=5, layer_types=("sliding_attention", "full_attention"))
GEMMA = dict(norm_style="gemma", scale_embeddings=True, activation="gelu_tanh", tie_embeddings=True, head_dim=16)
OLMO = dict(norm_style="olmo", norm_placement="post", qk_norm=True, qk_norm_scope="projection")
# Each family's knobs as a from-scratch `models.build` config reaches them, and the family that writes it.
CASES = {
    "llama": dict(rope_theta=500.0),
    "llama-bias-tied": dict(qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True),
    "qwen2": dict(qkv_bias=True, sliding_window=5, layer_types=("full_attention", "sliding_attention")),
    "qwen3": dict(qk_norm=True, head_dim=16, rope_scaling=RopeScaling("yarn", 4.0, 16)),
    "mistral": dict(sliding_window=5, head_dim=8),
    "ministral": dict(**WINDOWS, rope_scaling=RopeScaling("linear", 2.0)),
    "gemma": GEMMA,
    "gemma2": dict(**GEMMA, **WINDOWS, norm_placement="sandwich", query_scale=12**-0.5, attn_softcap=20.0,
                   logit_softcap=8.0),
    "gemma3_text": dict(**GEMMA, **WINDOWS, norm_placement="sandwich", qk_norm=True, local_rope_theta=100.0,
                        rope_scaling=RopeScaling("linear", 8.0)),
    "olmo2": OLMO,
    "olmo3": dict(**OLMO, **WINDOWS, rope_theta=500000.0),
}
TOKENS = np.random.default_rng(4).integers(0, 97, (2, 12))


def _model(case: str, seed: int = 0):
    """A from-scratch model of `case` with weights of order one (so a wrong convention shows) and its variables."""
    model = models.build("causal_transformer", **SHAPE, **CASES[case])
    variables = compiled(model.init, jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))
    rng = np.random.default_rng(seed)
    noisy = lambda x: jnp.asarray(np.asarray(x) + rng.normal(0.0, 0.3, x.shape), x.dtype)
    return model, jax.tree_util.tree_map(noisy, variables)


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_the_export_with_equal_logits(case, tmp_path):
    """fp32 logits of transformers' load of the export against Dew's: 2-layer width-32 decoders over 12 tokens,
    transformers_decoder_ulps gives 650-894 ulps of the largest logit (6.3-9.1), 4.9e-4 to 7.6e-4. Observed:
    llama 8.6e-6, llama-bias-tied 1.0e-5, qwen2 8.8e-6, qwen3 4.8e-6, mistral 9.1e-6, ministral 1.1e-5,
    gemma 5.1e-6, gemma2 5.4e-6, gemma3_text 3.0e-6, olmo2 6.3e-6, olmo3 5.7e-6."""
    model, variables = _model(case)
    assert "layers_0to1" in variables["params"]
    expected_family = case.split("-")[0]
    assert family_for(model.config).model_type == expected_family
    out = save_pretrained(model, variables, tmp_path / case, generation=Sampling(temperature=0.0, eos_token_ids=(2,)))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == expected_family and config["dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), "numpy") as exported:
        assert "model.layers.1.self_attn.q_proj.weight" in exported.keys()

    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = theirs_model(torch.from_numpy(TOKENS)).logits.numpy()
    ours = np.asarray(compiled(model.apply, variables, jnp.asarray(TOKENS, jnp.int32)))
    assert np.abs(theirs).max() > 2.0
    bound = ulp_bound(transformers_decoder_ulps(theirs_model.config, TOKENS.shape[1]), np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0, err_msg=case)

    again = load_pretrained(out)  # and Dew reads back the same weights (per layer: 2 layers scan from 8 by default)
    assert again.generation == Sampling(temperature=0.0, eos_token_ids=(2,), pad_id=0)
    _assert_same_weights(again.variables, variables)


def _assert_same_weights(ours, theirs):
    ours, theirs = unstack_variables(ours), unstack_variables(theirs)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    for path, leaf in jax.tree_util.tree_leaves_with_path(ours):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(_at(theirs, path)),
                                      err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.parametrize("knobs, message", [
    (dict(causal=False), r"closest, llama \(LlamaConfig\), computes layer 0 causal False \(it computes True\)"),
    (dict(o_bias=True), r"closest, llama .* layer 0 o_bias True \(it computes False\)"),
    (dict(norm_style="gemma"), r"closest, gemma \(GemmaConfig\), computes scale_embeddings False \(it computes True\)"),
])
def test_a_model_no_family_computes_is_refused_by_name(knobs, message, tmp_path):
    model = models.build("causal_transformer", **SHAPE, **knobs)
    with pytest.raises(ValueError, match=message):
        save_pretrained(model, {}, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match=r"transformers' LlamaConfig does not compute this model"):
        FAMILIES["llama"].to_hf_config(model.config)


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=0.0, eos_token_ids=(2, 7), pad_id=1),
    Sampling(temperature=0.7, top_k=None, top_p=0.9, min_p=0.05, repetition_penalty=1.1, eos_token_ids=(3,)),
    Sampling(temperature=1.0, top_k=40),
])
def test_generation_config_reads_back_as_the_same_sampling(sampling):
    written = generation_config(sampling, max_new_tokens=32)
    assert generation_defaults(written, {}) == (sampling, 32)


@pytest.fixture
def fused_family():
    """A family in one converter, registered by the test: the Llama block with the query, key and value
    projections fused in one checkpoint tensor (as Phi-3 stores them), split into Dew's three kernels."""
    separate = {f"layers/self_attn/{proj}/kernel" for proj in ("q_proj", "k_proj", "v_proj")}
    fused = Rule(("layers/self_attn/q_proj/kernel", "layers/self_attn/k_proj/kernel", "layers/self_attn/v_proj/kernel"),
                 "model.layers.{layer}.self_attn.qkv_proj.weight", transpose=(1, 0), axis=1)
    rules = (*(rule for rule in DECODER_RULES if rule.dew[0] not in separate), fused)
    converter = register(Converter("test_fused_qkv", "LlamaConfig", "LlamaForCausalLM", LLAMA_FIELDS, rules))
    yield converter
    del FAMILIES[converter.model_type]


def test_a_new_family_is_one_converter(fused_family, tmp_path):
    model, variables = _model("llama")
    config = fused_family.to_hf_config(model.config)
    out = write_export(tmp_path / "fused", model, fused_family, variables, config, None, None, "5GB")
    with safe_open(str(out / "model.safetensors"), "numpy") as exported:
        names = set(exported.keys())
        qkv = exported.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
    assert "model.layers.0.self_attn.q_proj.weight" not in names and qkv.shape == (32 + 16 + 16, 32)
    np.testing.assert_array_equal(qkv[32:48].T, np.asarray(variables["params"]["layers_0to1"]["self_attn"]["k_proj"]
                                                           ["kernel"][1]))
    again = load_pretrained(out)
    assert again.config["model_type"] == "test_fused_qkv"
    _assert_same_weights(again.variables, variables)
