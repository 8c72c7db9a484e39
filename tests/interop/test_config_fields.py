"""Fields transformers' modeling code reads without its config class declaring them (`head_dim` for Qwen2,
OLMo 2 and OLMo 3; the mask code's `is_causal` for every family), and the fields that change nothing."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.families import FAMILIES, decoder_kwargs
from tests.interop.conftest import SHAPE, save_checkpoint, torch, torch_model, transformers

# The transformers module that holds each family's modeling code.
_MODULES = {"gemma3_text": "gemma3"}
_GETATTR = re.compile(r"getattr\((?:self\.)?config,\s*\"(\w+)\"")

# fp32 on both sides. A logit is the end of about ten chained stages (embedding, per layer a norm, attention
# with 16-wide heads over at most 12 keys and a width-48 MLP, the final norm and the head), each a sum of at
# most 64 products that XLA and torch round in different orders: a relative drift of at most
# 64 * eps_fp32 (7.6e-6) of the largest logit (5.6-7.5 here), so 4.3e-5 to 5.7e-5. Largest differences
# observed on an AMD EPYC with AVX-512, head_dim 16 / head_dim 8: qwen2-bias-window 4.8e-6 / 6.9e-6,
# olmo2 5.0e-6 / 5.3e-6, olmo3-window 3.6e-6 / 4.5e-6.
RELATIVE_TOLERANCE = 64 * np.finfo(np.float32).eps
# The families transformers has modeling code for (LLaDA and Dream ship theirs as remote code: tests/diffusion).
# DiffusionGemma is not a decoder family: tests/interop/test_diffusion_gemma.py reads its fields.
TRANSFORMERS_FAMILIES = sorted(name for name, family in FAMILIES.items()
                               if hasattr(transformers, family.config_class) and name != "diffusion_gemma")
TOKENS = np.random.default_rng(5).integers(0, SHAPE["vocab_size"], (2, 12))
DEFAULT_HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # 8


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_every_field_the_modeling_code_reads_with_getattr_is_read(model_type):
    module = _MODULES.get(model_type, model_type)
    source = Path(importlib.import_module(f"transformers.models.{module}.modeling_{module}").__file__).read_text()
    read = set(_GETATTR.findall(source))
    assert read, module  # the pattern still finds transformers' reads
    assert {name for name in read if not FAMILIES[model_type].reads(name)} == set()


@pytest.mark.parametrize("case", ["qwen2-bias-window", "olmo2", "olmo3-window"])
@pytest.mark.parametrize("head_dim", [16, DEFAULT_HEAD_DIM])
def test_head_dim_read_with_getattr_matches_transformers(case, head_dim, tmp_path):
    model = torch_model(case, head_dim=head_dim)
    directory = save_checkpoint(model, tmp_path / case)
    config = json.loads((directory / "config.json").read_text())
    assert config["head_dim"] == head_dim  # transformers keeps the undeclared field and writes it back
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == SHAPE["num_attention_heads"] * head_dim
    if head_dim == DEFAULT_HEAD_DIM:
        assert decoder_kwargs(config) == decoder_kwargs({k: v for k, v in config.items() if k != "head_dim"})
    bundle = load_pretrained(directory)
    assert bundle.model.config.head_dim == head_dim
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    largest = np.abs(theirs).max()
    assert largest > 2.0  # order-one weights: a wrong head layout shows
    np.testing.assert_allclose(ours, theirs, atol=RELATIVE_TOLERANCE * largest, rtol=0, err_msg=case)


@pytest.mark.parametrize("model_type", ["qwen2", "olmo2", "olmo3"])
def test_head_dim_null_reads_as_the_default(model_type):
    # transformers' rotary code reads `getattr(config, "head_dim", None) or hidden_size // num_attention_heads`
    assert decoder_kwargs({"model_type": model_type, "head_dim": None}) == decoder_kwargs({"model_type": model_type})


# Families whose transformers defaults do not make a model transformers runs, and the field that completes one.
_COMPLETING = {"deepseek_v2": {"num_experts_per_tok": 2}}  # its MoE layers pick top-None experts by default


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_is_causal_true_loads_and_false_is_refused(model_type):
    plain = {"model_type": model_type, **_COMPLETING.get(model_type, {})}
    assert decoder_kwargs({**plain, "is_causal": True}) == decoder_kwargs(plain)
    with pytest.raises(ValueError, match=r"'is_causal' = False .* bidirectional encoder\) is not built"):
        decoder_kwargs({**plain, "is_causal": False})


# Fields published configs carry that change no computation, each with a value seen on the Hub.
METADATA = {
    "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.Custom"},
    "tokenizer_class": "LlamaTokenizer",
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "custom_pipelines": {"text-generation": {"impl": "pipeline_custom.Pipeline", "pt": ["AutoModelForCausalLM"]}},
    "unsloth_version": "2024.9", "unsloth_fixed": True,
    "_attn_implementation_autoset": True, "gradient_checkpointing": False, "is_decoder": True,
    "torchscript": False, "use_bfloat16": False, "finetuning_task": None, "prefix": None,
    "pruned_heads": {}, "pretraining_tp": 1,
}


@pytest.mark.parametrize("name", sorted(METADATA))
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_metadata_fields_change_nothing(model_type, name):
    plain = {"model_type": model_type}
    assert decoder_kwargs({**plain, name: METADATA[name]}) == decoder_kwargs(plain)


def test_published_config_with_metadata_loads_and_computes_the_same(llama_checkpoint, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(llama_checkpoint[0], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **METADATA, "max_window_layers": 28,
                                                       "use_sliding_window": False, "attention_dropout": 0.1}))
    bundle, plain = load_pretrained(directory), load_pretrained(llama_checkpoint[0])
    assert bundle.model.config.attention_dropout == 0.1
    tokens = jnp.asarray(TOKENS, jnp.int32)
    np.testing.assert_array_equal(np.asarray(bundle.model.apply(bundle.variables, tokens)),
                                  np.asarray(plain.model.apply(plain.variables, tokens)))
    assert bundle.text_generation()([[5, 17, 3]], 4).tokens.shape == (1, 7)


@pytest.mark.parametrize("source", [
    {"model_type": "llama", "max_window_layers": 28},
    {"model_type": "llama", "max_window_layers": 28, "use_sliding_window": False, "sliding_window": None},
    {"model_type": "qwen2", "max_window_layers": 21, "use_sliding_window": False, "sliding_window": 131072},
    {"model_type": "mistral", "max_window_layers": 28, "sliding_window": None},
    {"model_type": "gemma", "use_sliding_window": False},
], ids=["llama", "llama-window-off", "qwen2-window-off", "mistral-no-window", "gemma-window-off"])
def test_qwen_window_switches_load_where_no_window_is_in_effect(source):
    kwargs = decoder_kwargs(source)
    assert kwargs.get("sliding_window") is None
    plain = {k: v for k, v in source.items() if k not in ("max_window_layers", "use_sliding_window")}
    if source["model_type"] != "qwen2":
        assert kwargs == decoder_kwargs(plain)


@pytest.mark.parametrize("source, message", [
    ({"model_type": "mistral", "max_window_layers": 28, "sliding_window": 4096},
     r"'max_window_layers' = 28 is Qwen's window switch, which transformers' MistralConfig never reads: it windows "
     r"every sliding layer at 4096"),
    ({"model_type": "ministral", "use_sliding_window": False},
     r"'use_sliding_window' = False .* MinistralConfig never reads: it windows every sliding layer at 4096"),
    ({"model_type": "llama", "use_sliding_window": True}, r"'use_sliding_window' = True .* it applies no window"),
    ({"model_type": "llama", "attention_chunk_size": 8192}, r"'attention_chunk_size' = 8192 is not a field"),
    ({"model_type": "llama", "per_layer_config": {"0": {"intermediate_size": 8}}}, r"'per_layer_config' = .* not a field"),
    ({"model_type": "llama", "pruned_heads": {"0": [1]}}, r"'pruned_heads' = \{'0': \[1\]\} is not a field"),
    ({"model_type": "llama", "use_mrope": True}, r"'use_mrope' = True is not a field"),
])
def test_computational_fields_are_still_refused_by_name(source, message):
    with pytest.raises(ValueError, match=message):
        decoder_kwargs(source)


def test_attention_dropout_loads_for_inference_and_saves_back(tmp_path):
    """transformers applies attention dropout only in training mode: an eval model with rate 0.1 computes
    what Dew's inference computes (same fp32 bound as the head_dim tests)."""
    model = torch_model("llama", attention_dropout=0.1)
    directory = save_checkpoint(model, tmp_path / "dropout")
    bundle = load_pretrained(directory)
    assert bundle.model.config.attention_dropout == 0.1
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=RELATIVE_TOLERANCE * np.abs(theirs).max(), rtol=0)
    again = load_pretrained(bundle.save(tmp_path / "export"))
    assert again.config["attention_dropout"] == 0.1 and again.model.config.attention_dropout == 0.1
