"""SmolLM3 (dew.interop.families.smollm3): layers without rotary positions, read from `no_rope_layers` or
`no_rope_layer_interval`, written back, and read from llama.cpp's GGUF (which fixes every fourth layer NoPE).

Its logits and greedy tokens against transformers are tests/interop/test_families.py's case
smollm3-nope-window (observed 6.0e-6 on logits up to 5.8, against a bound of 4.5e-4; the same weights with
every layer rotating differ by 2.5)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from tests.interop.conftest import assert_logits_match, save_checkpoint, torch_model, transformers


def test_a_smollm3_load_saves_a_checkpoint_transformers_loads_with_equal_logits(tmp_path):
    model = torch_model("smollm3-nope-window")
    bundle = load_pretrained(save_checkpoint(model, tmp_path / "source"))
    assert bundle.model.config.nope.layers == (1,)
    out = bundle.save(tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert written["no_rope_layers"] == [1, 0] and written["use_sliding_window"] is True
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "SmolLM3ForCausalLM"
    assert_logits_match(bundle, reloaded, np.random.default_rng(3).integers(0, 97, (2, 12)))


def test_the_interval_sets_the_nope_layers_when_the_list_is_absent(tmp_path):
    """transformers fills no_rope_layers from the interval: layer i rotates unless (i + 1) % interval is 0."""
    model = torch_model("smollm3-nope-window", num_hidden_layers=4, no_rope_layers=None, no_rope_layer_interval=2,
                        use_sliding_window=False)
    directory = save_checkpoint(model, tmp_path / "interval")
    config = json.loads((directory / "config.json").read_text())
    config.pop("no_rope_layers")
    (directory / "config.json").write_text(json.dumps(config))
    bundle = load_pretrained(directory)
    assert bundle.model.config.nope.layers == (1, 3)
    assert_logits_match(bundle, model, np.random.default_rng(4).integers(0, 97, (2, 12)))


def test_a_smollm3_gguf_reads_as_the_same_model(tmp_path):
    """llama.cpp's smollm3 writes Llama's names and rows and no NoPE metadata: its graph makes every fourth layer
    NoPE. float32 tensors, so the GGUF load is the safetensors load exactly."""
    gguf_test = pytest.importorskip("tests.interop.test_gguf")
    model = torch_model("smollm3-nope-window", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                        use_sliding_window=False, max_position_embeddings=32)
    source = load_pretrained(save_checkpoint(model, tmp_path / "source"))
    tensors = [(gguf_test._gguf_name(name), gguf_test.permuted(name, tensor.numpy(), model.config, "smollm3"), None)
               for name, tensor in model.state_dict().items()]
    (tmp_path / "gguf").mkdir()
    path = gguf_test.write_gguf(model, tmp_path / "gguf" / "tiny.f32.gguf", tensors=tensors)
    bundle = load_pretrained(path.parent, gguf_file=path.name)
    assert bundle.model.config.nope.layers == (3,)
    tokens = jnp.asarray(gguf_test.TOKENS_IN, jnp.int32)
    np.testing.assert_array_equal(np.asarray(bundle.model.apply(bundle.variables, tokens)),
                                  np.asarray(source.model.apply(source.variables, tokens)))
