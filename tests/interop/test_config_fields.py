"""Fields transformers' modeling code reads without its config class declaring them (`head_dim` for Qwen2,
OLMo 2 and OLMo 3; the mask code's `is_causal` for every family), and the fields that change nothing."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.hf_decoders import FAMILIES, decoder_kwargs
from tests.interop.conftest import SHAPE, save_checkpoint, torch, torch_model

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
TOKENS = np.random.default_rng(5).integers(0, SHAPE["vocab_size"], (2, 12))
DEFAULT_HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # 8


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
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


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_is_causal_true_loads_and_false_is_refused(model_type):
    assert decoder_kwargs({"model_type": model_type, "is_causal": True}) == decoder_kwargs({"model_type": model_type})
    with pytest.raises(ValueError, match=r"'is_causal' = False .* bidirectional encoder\) is not built"):
        decoder_kwargs({"model_type": model_type, "is_causal": False})
