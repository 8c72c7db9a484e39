"""Llama 4's vision tower and projector against transformers' `Llama4VisionModel` and `Llama4MultiModalProjector`
on the same random weights, read through Dew's tensor rules (dew.interop.vision); the config reader and the
rules' way back."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import tensors
from dew.interop.vision import projector_prefix, projector_rules, tower_prefix, tower_rules
from dew.nn.vision import Llama4ProjectorConfig, Llama4VisionConfig, projector_config, tower_config
from tests.compiled import compiled
from tests.nn.test_vision import _randomize, _read, _shapes
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The grid (4 x 4 patches of 7 folded to 2 x 2 tokens, 2 x 2 patches of 14 folded to one), the depth and
# the rotary base; heads of 16 features (4 turned by column, 4 by row).
SHAPES = {
    "image28-patch7": dict(image_size=28, patch_size=7, num_hidden_layers=2),
    "image28-patch14-theta100": dict(image_size=28, patch_size=14, num_hidden_layers=1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
}
WIDTHS = dict(hidden_size=32, num_attention_heads=2, intermediate_size=128, projector_input_dim=24,
              projector_output_dim=24, vision_output_dim=24)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tower(request):
    """(transformers' tower, its config record, Dew's config, Dew's parameters read from its state dict)."""
    reference = transformers.Llama4VisionConfig(**WIDTHS, **SHAPES[request.param], attn_implementation="eager")
    model = transformers.Llama4VisionModel(reference).eval()
    _randomize(model, seed=0)
    record = json.loads(reference.to_json_string())
    config = Llama4VisionConfig.from_hf(record, "vision_config")
    arrays = {name: value.numpy() for name, value in model.state_dict().items()}
    params = _read(tower_rules("llama4", config, ""), _shapes(config.build(), _pixels(config)), arrays)
    return model, record, config, params


def _pixels(config, tiles: int = 3, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (tiles, config.num_channels, config.image_size, config.image_size)).astype(np.float32)


def _bound(config: Llama4VisionConfig, magnitude) -> float:
    """`vision_tower_ulps` over the patches and the class slot, plus the rotation of queries and keys (its
    table's two pow, cos and sin from two libraries, LIBRARY_ULPS each of angles up to `side * f`, and three
    roundings), and the adapter: fc1 over the shuffled width and its erf, fc2 over its width and its erf."""
    side = config.patches_per_side
    ulps = vision_tower_ulps(layers=config.num_hidden_layers, width=config.hidden_size,
                             mlp_width=config.intermediate_size, heads=config.num_attention_heads,
                             patches=side * side + 1, patch_inputs=config.num_channels * config.patch_size**2)
    ulps += config.num_hidden_layers * 2 * (3 * LIBRARY_ULPS * side + 3)
    ulps += math.sqrt(6 * (config.intermediate_size + config.projector_input_dim + 6)) + 2 * LIBRARY_ULPS
    return ulp_bound(ulps, magnitude)


# fp32 adapter states (largest 1.7 and 2.2): bounds 7.3e-5 and 5.1e-5; largest differences observed
# image28-patch7 1.1e-6, image28-patch14-theta100 1.4e-6.
@pytest.mark.parametrize("jit", [False, True])
def test_tower_matches_transformers(tower, jit):
    model, _, config, params = tower
    pixels = _pixels(config)
    apply = config.build().apply
    ours = np.asarray((jax.jit(apply) if jit else apply)({"params": params}, jnp.asarray(pixels)))
    with torch.no_grad():
        theirs = model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()
    assert ours.shape == theirs.shape == (3, config.tokens, config.projector_output_dim)
    assert np.abs(theirs).max() > 1.0
    assert_within(ours, theirs, _bound(config, np.abs(theirs).max()), "adapter states")


def test_pixel_gradient_matches_torch_autograd(tower):
    """Twice the forward's ulps (each product's two transposed products), of the largest gradient."""
    model, _, config, params = tower
    pixels = _pixels(config)
    weights = np.random.default_rng(2).normal(size=(3, config.tokens, config.projector_output_dim)).astype(np.float32)
    module = config.build()
    ours = np.asarray(compiled(jax.grad(lambda x: jnp.sum(module.apply({"params": params}, x) * weights)), jnp.asarray(pixels)))
    pixels_torch = torch.from_numpy(pixels).requires_grad_()
    (model(pixel_values=pixels_torch).last_hidden_state * torch.from_numpy(weights)).sum().backward()
    theirs = pixels_torch.grad.numpy()
    assert_within(ours, theirs, 2 * _bound(config, np.abs(theirs).max()), "pixel gradient")


def test_rules_give_back_the_state_dict(tower):
    model, _, config, params = tower
    prefix = "vision_model."
    plan = tensors.plan(tower_rules("llama4", config, prefix), params)
    exported = {name: np.ascontiguousarray(build()) for name, _, build in tensors.export_tensors(plan, params)}
    state = {f"{prefix}{name}": value.numpy() for name, value in model.state_dict().items()}
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert tower_prefix("llama4", [f"model.{name}" for name in state], "model.safetensors") == "model.vision_model."


def test_tower_config_round_trip(tower):
    _, record, config, _ = tower
    assert Llama4VisionConfig.from_hf(config.to_hf(), "vision_config") == config
    written = transformers.Llama4VisionConfig(**config.to_hf())
    assert written.rope_parameters["rope_theta"] == config.rope_theta
    assert tower_config("llama4", record, "vision_config") == config
    assert config.tokens == (config.patches_per_side // 2) ** 2


@pytest.mark.parametrize("record, message", [
    ({"use_cls_token": False}, r"field 'use_cls_token' = False is not a field"),
    ({"hidden_size": 24, "num_attention_heads": 4, "intermediate_size": 96}, r"heads of 6.0 features; .* multiple of 4"),
    ({"intermediate_size": 100}, r"intermediate_size is 100; .* only with 128, the pixel shuffle's width"),
    ({"projector_output_dim": 16}, r"projector_output_dim is 16; .* only with 24"),
    ({"image_size": 21}, r"a grid of 3 x 3 patches .* does not fold into 2 x 2 blocks"),
    ({"pixel_shuffle_ratio": 0.4}, r"pixel_shuffle_ratio is 0.4; it is 1 / n"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"rope_parameters .* reads only rope_theta"),
])
def test_tower_config_refuses_what_dew_cannot_compute(record, message):
    base = {**WIDTHS, "image_size": 28, "patch_size": 7}
    with pytest.raises(ValueError, match=f"^vision_config.*{message}"):
        Llama4VisionConfig.from_hf({**base, **record}, "vision_config")


def test_tower_config_reads_fields_transformers_ignores():
    """transformers' tower uses torch's LayerNorm epsilon and erf GELU whatever the record says."""
    config = Llama4VisionConfig.from_hf({**WIDTHS, "image_size": 28, "patch_size": 7, "norm_eps": 1e-6,
                                         "hidden_act": "silu", "projector_dropout": 0.1}, "vision_config")
    assert config.image_size == 28


# fp32 soft tokens: one 24-term product each, sqrt(6 * 24) ulps of the sum of term magnitudes.
def test_projector_matches_transformers():
    reference = transformers.Llama4Config(vision_config={**WIDTHS, "image_size": 28, "patch_size": 7},
                                          text_config={"hidden_size": 40, "num_attention_heads": 4, "head_dim": 10})
    module = transformers.models.llama4.modeling_llama4.Llama4MultiModalProjector(reference).eval()
    _randomize(module, seed=3)
    config = projector_config("llama4", json.loads(reference.to_json_string()), "config.json")
    assert config == Llama4ProjectorConfig(24, 40)
    states = np.random.default_rng(4).normal(size=(3, 4, 24)).astype(np.float32)
    arrays = {name: value.numpy() for name, value in module.state_dict().items()}
    params = _read(projector_rules("llama4", config, ""), _shapes(config.build(), states), arrays)
    ours = np.asarray(compiled(config.build().apply, {"params": params}, jnp.asarray(states)))
    with torch.no_grad():
        theirs = module(torch.from_numpy(states)).numpy()
    magnitude = np.abs(states) @ np.abs(arrays["linear_1.weight"].T)
    assert_within(ours, theirs, ulp_bound(math.sqrt(6 * 24), magnitude), "soft tokens")
    names = [f"multi_modal_projector.{name}" for name in arrays]
    assert projector_prefix("llama4", names, "model.safetensors") == "multi_modal_projector."
    plan = tensors.plan(projector_rules("llama4", config, "multi_modal_projector."), params)
    exported = {name: np.asarray(build()) for name, _, build in tensors.export_tensors(plan, params)}
    np.testing.assert_array_equal(exported["multi_modal_projector.linear_1.weight"], arrays["linear_1.weight"])
