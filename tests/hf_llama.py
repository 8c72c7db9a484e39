"""Copy Dew decoder weights into a transformers model through the interop tensor mapping (test oracle)."""

from __future__ import annotations

import numpy as np
import torch

from dew.interop.hf_decoders import tensor_plan
from dew.nn.stack import unstack_variables


def copy_into_torch(variables, torch_model, num_layers: int) -> None:
    """Set the torch model's weights from Dew's `variables` (stacked runs split into layers first),
    named and transposed as `Pretrained.save` writes them."""
    params = unstack_variables(variables)["params"]
    layers = sum(key.startswith("layers_") for key in params)
    assert layers == num_layers, f"the Dew tree has {layers} layers, the caller expects {num_layers}"
    state = {}
    for name, path, transposed in tensor_plan(params):
        leaf = params
        for key in path:
            leaf = leaf[key]
        array = np.asarray(leaf, dtype=np.float32)
        state[name] = torch.from_numpy(np.array(array.T if transposed else array, copy=True))
    missing, unexpected = torch_model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and "lm_head" not in params)]
    assert not missing and not unexpected, (missing, unexpected)
