"""Qwen 3.5's vision tower and patch merger against transformers' `Qwen3_5VisionModel` on the same random
weights, read through Dew's tensor rules (dew.interop.vision): images of different grids (one of two frames)
padded to one patch count; the config reader and the rules' way back."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from dew.interop import tensors
from dew.interop.vision import projector_rules, tower_rules
from dew.nn.vision import Qwen35MergerConfig, Qwen35VisionConfig
from dew.nn.vision.qwen35 import patch_layout
from tests.compiled import compiled
from tests.nn.test_vision import _randomize, _read, _shapes
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
             temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16,
             hidden_act="gelu_pytorch_tanh")
GRIDS = [(1, 4, 6), (1, 2, 2), (2, 4, 2)]  # a wide image, the smallest, and two frames


@pytest.fixture(scope="module")
def qwen_tower():
    """(transformers' tower, Dew's tower and merger configs, their parameters read from its state dict)."""
    reference = transformers.Qwen3_5VisionConfig(**SHAPE, attn_implementation="eager")
    model = transformers.Qwen3_5VisionModel(reference).eval()
    _randomize(model, seed=0)
    record = json.loads(reference.to_json_string())
    config = Qwen35VisionConfig.from_hf(record, "vision_config")
    merger = Qwen35MergerConfig.from_hf({"vision_config": record, "text_config": {"hidden_size": 48}}, "config.json")
    arrays = {name: value.numpy() for name, value in model.state_dict().items()}
    example = config.example(np.float32)
    tower_inputs = (example["pixel_values"][0], example["image_grid_thw"][0])
    tower_params = _read(tower_rules("qwen3_5", config, ""), _shapes(config.build(), *tower_inputs),
                         {k: v for k, v in arrays.items() if not k.startswith("merger.")})
    merged_shape = jax.ShapeDtypeStruct((1, 4, config.hidden_size), np.float32)
    merger_params = _read(projector_rules("qwen3_5", merger, "merger."), _shapes(merger.build(), merged_shape),
                          {k: v for k, v in arrays.items() if k.startswith("merger.")})
    return model, config, merger, tower_params, merger_params


def test_tower_and_merger_match_transformers(qwen_tower):
    """fp32, images padded to 24 patches: each real patch's state and each soft token equal transformers'
    within the tower's rounding count (`vision_tower_ulps`; the interpolated position adds four products
    and a four-term sum, the merger a LayerNorm, fc1 over 128 terms, the erf and fc2 over 128; observed:
    patch states 2.3e-6 of size 7.8, tokens 9.5e-7 of size 2.1)."""
    model, config, merger, tower_params, merger_params = qwen_tower
    rng = np.random.default_rng(5)
    images = [rng.uniform(-1, 1, (math.prod(grid), config.patch_features)).astype(np.float32) for grid in GRIDS]
    with torch.no_grad():
        out = model(torch.from_numpy(np.concatenate(images)), grid_thw=torch.tensor(GRIDS))
    their_states, their_tokens = out.last_hidden_state.numpy(), out.pooler_output.numpy()

    X = max(map(len, images))
    pixels = np.zeros((len(images), X, config.patch_features), np.float32)
    for n, patches in enumerate(images):
        pixels[n, :len(patches)] = patches
    states = compiled(config.build().apply, {"params": tower_params}, pixels, np.asarray(GRIDS, np.int32))
    tokens = np.asarray(compiled(merger.build().apply, {"params": merger_params}, states))
    states = np.asarray(states)
    ours_states = np.concatenate([states[n, :len(p)] for n, p in enumerate(images)])
    ours_tokens = np.concatenate([tokens[n, :len(p) // 4] for n, p in enumerate(images)])

    E = config.hidden_size
    tower_ulps = vision_tower_ulps(layers=config.depth, width=E, mlp_width=config.intermediate_size,
                                   heads=config.num_heads, patches=X, patch_inputs=config.patch_features) + 8
    assert_within(ours_states, their_states, ulp_bound(tower_ulps, np.abs(their_states).max()), "patch states")
    merger_ulps = tower_ulps + math.sqrt(6 * (2 * E + 4 + 2 * (4 * E + 1))) + 2 * LIBRARY_ULPS
    assert_within(ours_tokens, their_tokens, ulp_bound(merger_ulps, np.abs(their_tokens).max() * 4), "soft tokens")


def test_padding_changes_no_real_patch(qwen_tower):
    """An image's states are the same alone and beside a larger one (its padding reads nothing real)."""
    _, config, _, tower_params, _ = qwen_tower
    patches = np.random.default_rng(6).normal(size=(4, config.patch_features)).astype(np.float32)
    tower = config.build()
    alone = tower.apply({"params": tower_params}, patches[None], np.asarray([[1, 2, 2]], np.int32))
    padded = np.zeros((2, 8, config.patch_features), np.float32)
    padded[0, :4] = patches
    beside = tower.apply({"params": tower_params}, padded, np.asarray([[1, 2, 2], [0, 2, 2]], np.int32))
    np.testing.assert_allclose(np.asarray(beside)[0, :4], np.asarray(alone)[0], rtol=0, atol=1e-6)
    assert np.isfinite(np.asarray(beside)).all()


def test_patch_layout_is_the_processors_merge_block_order():
    """Patch k of a 4 x 6 grid sits where transformers' `get_vision_position_ids` puts it."""
    from transformers.vision_utils import get_vision_position_ids

    layout = patch_layout(np.asarray([[1, 4, 6]]), 24, 2)
    theirs = get_vision_position_ids(torch.tensor([[1, 4, 6]]), 2).numpy()
    np.testing.assert_array_equal(np.asarray(layout["row"])[0], theirs[:, 0])
    np.testing.assert_array_equal(np.asarray(layout["col"])[0], theirs[:, 1])


def test_the_config_round_trips_and_refuses_what_it_does_not_compute():
    record = transformers.Qwen3_5VisionConfig(**SHAPE).to_dict()
    config = Qwen35VisionConfig.from_hf(record, "vision_config")
    assert Qwen35VisionConfig.from_hf(config.to_hf(), "vision_config") == config
    assert transformers.Qwen3_5VisionConfig(**config.to_hf()).to_dict()["rope_parameters"] == record["rope_parameters"]
    with pytest.raises(ValueError, match=r"field 'deepstack_visual_indexes' = \[1\] is not a field"):
        Qwen35VisionConfig.from_hf({**record, "deepstack_visual_indexes": [1]}, "vision_config")
    with pytest.raises(ValueError, match=r"out_hidden_size 48 differs from text_config hidden_size 64"):
        Qwen35MergerConfig.from_hf({"vision_config": record, "text_config": {"hidden_size": 64}}, "config.json")


def test_the_rules_write_back_what_they_read(qwen_tower):
    """Export gives transformers' state dict back, bit for bit."""
    model, config, merger, tower_params, merger_params = qwen_tower
    exported = {}
    for rules, params in ((tower_rules("qwen3_5", config, ""), tower_params),
                          (projector_rules("qwen3_5", merger, "merger."), merger_params)):
        plan = tensors.plan(rules, params)
        exported.update({name: np.asarray(build()) for name, _, build in tensors.export_tensors(plan, params)})
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
