"""Tier 2, the verified mapping (dew.interop.verify): an unregistered model type loads natively once
transformers' own class, shrunk and random, computes the same logits through a registered family."""

from __future__ import annotations

import json
import re
import shutil
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.verify import VerifiedMappingWarning, shrink
from tests.compiled import compiled
from tests.interop.conftest import assert_logits_match, save_checkpoint, scatter_weights, torch, transformers

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny(model_type: str, directory, **fields):
    """A random transformers checkpoint of `model_type` at TINY's sizes, weights of order one: (directory, model)."""
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = scatter_weights(transformers.AutoModelForCausalLM.from_config(config).eval(), std=0.2)
    return save_checkpoint(model, directory), model


@pytest.fixture(scope="module")
def cwm(tmp_path_factory):
    """CWM: the Llama block with a window on alternate layers and Llama 3's rotary scaling (its default)."""
    return tiny("cwm", tmp_path_factory.mktemp("cwm"), sliding_window=4,
                layer_types=["sliding_attention", "full_attention"] * 2)


def test_cwm_loads_through_a_verified_mapping_with_one_warning(cwm):
    directory, model = cwm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bundle = load_pretrained(directory)
    (warning,) = [w for w in caught if issubclass(w.category, VerifiedMappingWarning)]
    assert [w for w in caught if w.category is not VerifiedMappingWarning] == []
    message = str(warning.message)
    assert message.startswith("tier 2: verified mapping: model_type 'cwm' loads as the registered 'llama' family")
    assert f"transformers {transformers.__version__}'s CwmForCausalLM" in message
    assert "max |dlogits|" in message and warning.filename == __file__
    assert bundle.converter.model_type == "llama" and bundle.config["model_type"] == "cwm"
    assert bundle.model.config.layer_window(0) == 4 and bundle.model.config.layer_window(1) is None
    # The real load, at the checkpoint's own sizes, against transformers: 4 layers of width 64 over 12 tokens,
    # llama3's blend in the frequencies (transformers_decoder_ulps); observed 1.2e-5 on logits up to 5.7.
    assert_logits_match(bundle, model, np.random.default_rng(0).integers(0, 256, (2, 12)))


def test_a_verified_load_saves_as_its_own_type_and_loads_again(cwm, tmp_path):
    directory, _ = cwm
    with pytest.warns(VerifiedMappingWarning):
        bundle = load_pretrained(directory)
    saved = bundle.save(tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    assert type(reloaded).__name__ == "CwmForCausalLM"
    with pytest.warns(VerifiedMappingWarning):
        again = load_pretrained(saved)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (1, 9)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(compiled(again.model.apply, again.variables, tokens)),
                                  np.asarray(compiled(bundle.model.apply, bundle.variables, tokens)))


# Refusals of types that stay unregistered, each with what sets it apart: ERNIE 4.5 turns its rotary features
# in adjacent pairs (Llama's names and shapes, a measured difference), Cohere runs attention and the MLP in
# parallel off one norm (no post_attention_layernorm for a candidate to read), and GLM-4 has a fused
# gate_up_proj, half-rotary heads and norms after each sublayer. (SmolLM3 and Granite, the guide's examples,
# are native families now: tests/interop/test_smollm3.py, test_granite.py.)
REFUSALS = {
    "ernie4_5": (dict(), r"llama with windows: max \|dlogits\| \d+\.\d+ against the bound"),
    "cohere": (dict(), r"llama with windows: the checkpoint lacks \d+ tensor\(s\) .* such as "
                       r"\['model\.layers\.0\.post_attention_layernorm\.weight'"),
    "glm4": (dict(head_dim=16), r"llama: field 'rope_parameters' = .*'partial_rotary_factor': 0.5.* LlamaConfig rotates "
                                r"every feature of a head"),
}


@pytest.mark.parametrize("model_type", sorted(REFUSALS))
def test_a_type_that_computes_something_else_is_refused_with_each_candidates_difference(model_type, tmp_path):
    fields, reason = REFUSALS[model_type]
    directory, _ = tiny(model_type, tmp_path / model_type, **fields)
    with pytest.raises(ValueError, match=rf"model_type '{model_type}', which is not a Dew family") as refused:
        load_pretrained(directory)
    message = str(refused.value)
    assert "no registered family computes what" in message and 'fallback="torchax"' in message
    assert re.search(reason, message), message


def test_without_torch_the_refusal_names_the_extra(cwm, monkeypatch):
    directory, _ = cwm
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ValueError, match=r"model_type 'cwm', which is not a Dew family .* needs torch and "
                                         r"transformers: pip install 'dew-ml\[torch\]'"):
        load_pretrained(directory)


def test_a_type_transformers_does_not_know_is_refused_by_name(cwm, tmp_path):
    directory = shutil.copytree(cwm[0], tmp_path / "unknown")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "no_such_type"}))
    with pytest.raises(ValueError, match=r"model_type 'no_such_type', which is neither a Dew family .* nor a type "
                                         rf"transformers {transformers.__version__} builds"):
        load_pretrained(directory)


def test_shrink_keeps_layers_head_ratio_and_windows():
    config = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=30,
                  intermediate_size=11008, vocab_size=128256, sliding_window=8192, eos_token_id=[128001, 128009],
                  layer_types=["full_attention"] * 30, quantization_config={"bits": 4}, dtype="bfloat16")
    small = shrink(config)
    assert (small["num_attention_heads"], small["num_key_value_heads"], small["head_dim"]) == (8, 2, 16)
    assert (small["hidden_size"], small["intermediate_size"], small["vocab_size"]) == (128, 256, 256)
    assert small["num_hidden_layers"] == 30 and small["layer_types"] == config["layer_types"]
    assert small["sliding_window"] == 4 and small["eos_token_id"] == [255, 255]
    assert "quantization_config" not in small and "dtype" not in small
