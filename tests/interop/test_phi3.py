"""Phi-3 (dew.interop.families.phi3): fused projections split at load and fused again at save.

Its logits and greedy tokens against transformers are tests/interop/test_families.py's case
phi3-fused-window (observed 7.2e-6 on logits up to 6.0, against a bound of 4.6e-4)."""

from __future__ import annotations

import numpy as np
from safetensors import safe_open

from dew.interop import load_pretrained
from tests.interop.conftest import assert_logits_match, save_checkpoint, torch_model, transformers


def test_a_phi3_load_saves_fused_tensors_that_transformers_loads_with_equal_logits(tmp_path):
    model = torch_model("phi3-fused-window")
    bundle = load_pretrained(save_checkpoint(model, tmp_path / "source"))
    assert bundle.model.config.sliding_window == 5
    out = bundle.save(tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), "numpy") as exported:
        assert "model.layers.1.self_attn.qkv_proj.weight" in exported.keys()
        assert "model.layers.1.mlp.gate_up_proj.weight" in exported.keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Phi3ForCausalLM"
    assert_logits_match(bundle, reloaded, np.random.default_rng(3).integers(0, 97, (2, 12)))
