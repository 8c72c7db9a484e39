"""Copy Dew decoder weights into a transformers model through the family's tensor rules (test oracle)."""

from __future__ import annotations

import numpy as np
import torch

from dew.interop import tensors
from dew.interop.families import FAMILIES


def copy_into_torch(variables, torch_model, num_layers: int) -> None:
    """Set the torch model's weights from Dew's `variables` (stacked runs or per layer), named and
    transposed as `Pretrained.save` writes them, through the family of `torch_model`'s config."""
    params = variables["params"]
    family = FAMILIES[torch_model.config.model_type]
    plan = tensors.plan(family.rules, params, family.model_type)
    layers = {name.split(".")[2] for name in plan.tensors if name.startswith("model.layers.")}
    assert len(layers) == num_layers, f"the Dew tree has {len(layers)} layers, the caller expects {num_layers}"
    state = {name: torch.from_numpy(np.array(build(), dtype=np.float32, copy=True))
             for name, _, build in tensors.export_tensors(plan, params)}
    missing, unexpected = torch_model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and "lm_head.weight" not in state)]
    assert not missing and not unexpected, (missing, unexpected)
