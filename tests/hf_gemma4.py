"""transformers' Gemma 4 text layers at test sizes, the Dew specs computing them and their weights (test oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dew.nn.attention import AttentionSpec
from dew.nn.rotary import RopeScaling


def gemma4_config(**overrides):
    """transformers' Gemma 4 text config at test sizes: sliding layers of 4 heads of 8 over 2 key/value
    heads, full layers of 4 heads of 16 over 1, reading the key projection as values."""
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                  attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                  hidden_size_per_layer_input=0, rope_parameters={
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                         "rope_theta": 1_000_000.0}})
    config = transformers.Gemma4TextConfig(**{**fields, **overrides})
    config._attn_implementation = "eager"
    return config


def gemma4_spec(config, index: int, causal: bool = True) -> AttentionSpec:
    """The `AttentionSpec` computing transformers' Gemma 4 attention of layer `index`."""
    full = config.layer_types[index] == "full_attention"
    layer = config.per_layer_config[index]
    rope = config.rope_parameters[config.layer_types[index]]
    scaling = RopeScaling("proportional", rope.get("factor", 1.0), rotated_fraction=rope["partial_rotary_factor"]) \
        if rope["rope_type"] == "proportional" else RopeScaling()
    return AttentionSpec(config.num_attention_heads, layer.num_key_value_heads, layer.head_dim, causal=causal,
                         window=None if full else config.sliding_window, rope_theta=rope["rope_theta"],
                         rope_scaling=scaling, qk_norm=True, query_scale=1.0, value_norm=True,
                         keys_as_values=full and config.attention_k_eq_v)


def random_gemma4_weights(variables, seed: int):
    """`variables` redrawn so that every output is of order one: kernels N(0, 1/fan_in), every other value
    (norm, router and output scales) 1 + N(0, 0.1^2) (init would leave them one, hiding a misplaced scale)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "kernel" in name or "experts" in name:
            fan_in = leaf.shape[-2]
            return jnp.asarray(rng.normal(size=leaf.shape) / np.sqrt(fan_in), leaf.dtype)
        return jnp.asarray(1.0 + 0.1 * rng.normal(size=leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, variables)


def to_torch(x):
    """A float32 torch tensor holding a copy of `x`."""
    return torch.from_numpy(np.array(x, np.float32, copy=True))


def attention_state(params) -> dict:
    """transformers' Gemma 4 attention weights from Dew's `self_attn` parameters."""
    state = {f"{name}.weight": to_torch(np.asarray(params[name]["kernel"]).T)
             for name in ("q_proj", "k_proj", "v_proj", "o_proj") if name in params}
    state.update({f"{name}.weight": to_torch(params[name]["scale"]) for name in ("q_norm", "k_norm")})
    return state
