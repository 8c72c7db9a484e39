"""Copy Dew decoder weights into a transformers Llama-family model (test oracle only)."""

from __future__ import annotations

import numpy as np
import torch


def copy_into_torch(params, torch_model, num_layers: int) -> None:
    """Set the torch model's weights from Dew's `params` tree (kernels are `[in, out]`, torch's `[out, in]`)."""
    p = params["params"]
    state = {"model.embed_tokens.weight": p["embed_tokens"]["embedding"], "model.norm.weight": p["norm"]["scale"]}
    if "lm_head" in p:
        state["lm_head.weight"] = np.asarray(p["lm_head"]["kernel"]).T
    for i in range(num_layers):
        layer = p[f"layers_{i}"]
        prefix = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[prefix + f"self_attn.{name}.weight"] = np.asarray(layer["self_attn"][name]["kernel"]).T
        for name in ("q_norm", "k_norm"):
            if name in layer["self_attn"]:
                state[prefix + f"self_attn.{name}.weight"] = layer["self_attn"][name]["scale"]
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[prefix + f"mlp.{name}.weight"] = np.asarray(layer["mlp"][name]["kernel"]).T
        state[prefix + "input_layernorm.weight"] = layer["input_layernorm"]["scale"]
        state[prefix + "post_attention_layernorm.weight"] = layer["post_attention_layernorm"]["scale"]
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}
    missing, unexpected = torch_model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and "lm_head" not in p)]
    assert not missing and not unexpected, (missing, unexpected)
