"""The gated MLP with Gemma 3n's activation sparsity against transformers' `Gemma3nTextMLP`, and a bad sparsity."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import linen as nn

from dew.nn.mlp import DenseSpec
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WIDTH, FEATURES = 32, 64


@pytest.mark.parametrize("sparsity", [0.95, 0.0])
def test_sparse_gate_matches_gemma3n(sparsity):
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    config = transformers.Gemma3nTextConfig(hidden_size=WIDTH, intermediate_size=[FEATURES], num_hidden_layers=1,
                                            activation_sparsity_pattern=[sparsity])
    mlp = DenseSpec(FEATURES, "gelu_tanh", sparsity=sparsity).module(dtype=np.float32, param_dtype=np.float32,
                                                                      name="mlp")
    x = jax.random.normal(jax.random.key(0), (2, 7, WIDTH))
    # kernels N(0, 0.2^2) rather than init's 0.02, so the gate is of order one
    params = jax.tree_util.tree_map(lambda leaf: leaf * 10.0, nn.meta.unbox(mlp.init(jax.random.key(1), x)))
    ours = np.asarray(mlp.apply(params, x))

    reference = Gemma3nTextMLP(config, 0).eval()
    state = {f"{name}.weight": torch.from_numpy(np.array(params["params"][name]["kernel"]).T.copy())
             for name in ("gate_proj", "up_proj", "down_proj")}
    reference.load_state_dict(state, strict=True)
    with torch.no_grad():
        theirs = reference(torch.from_numpy(np.asarray(x))).numpy()
    if sparsity:
        gate = np.asarray(x) @ np.asarray(params["params"]["gate_proj"]["kernel"])
        assert (gate > 0).mean() > 0.3  # most of the gate would pass a plain GELU ...
        kept = reference._gaussian_topk(torch.from_numpy(gate)).numpy() > 0
        assert kept.mean() < 0.15  # ... and about 5% passes the cutoff
    # The gate and up over the width, the cutoff (a width-64 mean and std, a product, a sum, a subtraction; the
    # quantile from two libraries), the activation and the product, down over 64: each rounding walks randomly
    # (sqrt(6 N) ulps of the output's size; gate and output are both of order one here), the quantile and GELU's
    # tanh add LIBRARY_ULPS each. Observed 3.0e-7 (0.95) and 4.8e-7 (0) on outputs up to 1.0 and 6.1.
    roundings = 2 * WIDTH + 2 * FEATURES + 6 + 3 + 1 + FEATURES
    bound = ulp_bound(math.sqrt(6 * roundings) + 2 * LIBRARY_ULPS, np.abs(theirs).max())
    assert_within(ours, theirs, bound, f"sparsity {sparsity}")


def test_sparsity_outside_its_range_is_refused():
    with pytest.raises(ValueError, match=r"sparsity is 1.0; it is the fraction of gate activations zeroed"):
        DenseSpec(8, sparsity=1.0)
