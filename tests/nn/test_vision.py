"""The SigLIP tower and Gemma 3's projector against transformers' own modules on the same random weights,
read through Dew's tensor rules (dew.interop.vision); their config readers and the rules' way back."""

from __future__ import annotations

import copy
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from dew.interop import tensors
from dew.interop.vision import (PROJECTOR_PREFIXES, TOWER_PREFIXES, projector_prefix, projector_rules, tower_ignorable,
                                tower_prefix, tower_rules)
from dew.nn.vision import (PROJECTORS, TOWERS, GemmaProjectorConfig, SiglipConfig, projector_config, tower_config)
from dew.sharding import Layout, MeshSpec
from tests.compiled import compiled
from tests.interop.test_tensors import ArrayReader
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# One case per knob that changes the computation: the grid (2 x 2 patches of 14, 4 x 4 of 8), the depth,
# the activation (tanh gelu, erf gelu) and the norms' epsilon.
SHAPES = {
    "image28-patch14": dict(image_size=28, patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4),
    "image32-patch8-gelu": dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, hidden_act="gelu", layer_norm_eps=1e-5),
}


def _randomize(module, seed: int) -> None:
    """Every weight drawn afresh: matrices scaled by their rows' length, so activations stay near one; norms'
    weights and every bias away from their neutral values, so that a swapped or dropped one shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, value in module.named_parameters():
            noise = torch.randn(value.shape, generator=generator)
            if "norm" in name and name.endswith("weight"):
                value.copy_(1 + 0.3 * noise)
            elif name.endswith("bias"):
                value.copy_(0.3 * noise)
            else:
                value.copy_(noise * value[0].numel() ** -0.5 if value.ndim >= 2 else noise)


def _read(rules, shapes, arrays: dict) -> dict:
    """Dew parameters for `shapes` (a tree of ShapeDtypeStructs) read through `rules` from `arrays`;
    every array must be read."""
    plan = tensors.plan(rules, shapes)
    assert sorted(plan.tensors) == sorted(arrays)
    reader = ArrayReader(arrays)
    return traverse_util.unflatten_dict({leaf.path: tensors.read_region(reader, leaf, None, np.float32)
                                         for leaf in plan.leaves})


def _shapes(module, *inputs) -> dict:
    return nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *inputs)["params"])


def _pixels(config: SiglipConfig, images: int = 3, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (images, config.num_channels, config.image_size, config.image_size)).astype(np.float32)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def siglip(request):
    """(transformers' tower, its config.json record, Dew's config, Dew's parameters read from its state dict)."""
    reference = transformers.SiglipVisionConfig(**SHAPES[request.param], attn_implementation="eager")
    model = transformers.SiglipVisionModel(reference).eval()
    _randomize(model, seed=0)
    record = json.loads(reference.to_json_string())
    config = SiglipConfig.from_hf(record, "vision_config")
    # the tower's own pooling head (vision_use_head defaults to true) is in the state dict, never read
    arrays = {name: value.numpy() for name, value in model.state_dict().items()
              if not tower_ignorable("siglip", name, "")}
    assert len(arrays) < len(model.state_dict())
    params = _read(tower_rules("siglip", config, ""), _shapes(config.build(), _pixels(config)), arrays)
    return model, record, config, params


def _bound(config: SiglipConfig, magnitude) -> float:
    return ulp_bound(vision_tower_ulps(layers=config.num_hidden_layers, width=config.hidden_size,
                                       mlp_width=config.intermediate_size, heads=config.num_attention_heads,
                                       patches=config.geometry().patches,
                                       patch_inputs=config.num_channels * config.patch_size**2), magnitude)


# fp32 last hidden states (largest 4.7 and 5.1) of 2- and 3-layer width-32 towers over 4 and 16 patches:
# vision_tower_ulps gives 124 and 140 ulps of the largest, bounds of 7.0e-5 and 8.5e-5. The largest
# differences observed: image28-patch14 9.5e-7, image32-patch8-gelu 1.4e-6.
@pytest.mark.parametrize("jit", [False, True])
def test_tower_matches_transformers(siglip, jit):
    model, _, config, params = siglip
    pixels = _pixels(config)
    apply = config.build().apply
    ours = np.asarray((jax.jit(apply) if jit else apply)({"params": params}, jnp.asarray(pixels)))
    with torch.no_grad():
        theirs = model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()
    assert ours.shape == (3, config.geometry().patches, config.hidden_size)
    assert np.abs(theirs).max() > 2.0
    assert_within(ours, theirs, _bound(config, np.abs(theirs).max()), "last hidden state")


# The gradient of sum(states * R) with respect to the pixels (largest 1.1 and 2.7): the backward pass takes
# each forward product's two transposed products, each a sum as long as the forward one, so twice the
# forward's ulps, of the largest gradient: bounds of 3.3e-5 and 9.0e-5. The largest differences observed:
# image28-patch14 6.0e-7, image32-patch8-gelu 1.8e-6.
def test_pixel_gradient_matches_torch_autograd(siglip):
    model, _, config, params = siglip
    pixels = _pixels(config)
    shape = (3, config.geometry().patches, config.hidden_size)
    weights = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    tower = config.build()
    ours = np.asarray(compiled(jax.grad(lambda x: jnp.sum(tower.apply({"params": params}, x) * weights)), jnp.asarray(pixels)))
    pixels_torch = torch.from_numpy(pixels).requires_grad_()
    (model(pixel_values=pixels_torch).last_hidden_state * torch.from_numpy(weights)).sum().backward()
    theirs = pixels_torch.grad.numpy()
    assert_within(ours, theirs, 2 * _bound(config, np.abs(theirs).max()), "pixel gradient")


def test_rules_give_back_the_state_dict(siglip):
    """Dew's parameters exported through the same rules are transformers' tensors, names and values."""
    model, _, config, params = siglip
    plan = tensors.plan(tower_rules("siglip", config, "vision_tower.vision_model."), params)
    exported = {name: np.ascontiguousarray(build()) for name, _, build in tensors.export_tensors(plan, params)}
    state = {f"vision_tower.vision_model.{name}": value.numpy() for name, value in model.state_dict().items()
             if not name.startswith("head.")}
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_rules_under_a_model_scope(siglip):
    """`dew_prefix` puts a tower's rules under a model's `tower/`, beside other modules, scanned layers and all."""
    _, _, config, params = siglip
    rules = tower_rules("siglip", config, "vision_tower.", dew_prefix="tower/")
    plan = tensors.plan(rules, {"tower": params})
    assert "vision_tower.encoder.layers.1.mlp.fc2.weight" in plan.tensors
    assert all(leaf.path[0] == "tower" for leaf in plan.leaves)
    with pytest.raises(ValueError, match="dew_prefix 'tower' must name a scope and end with '/'"):
        tower_rules("siglip", config, "", dew_prefix="tower")


def test_tower_config_round_trip(siglip):
    _, record, config, _ = siglip
    assert config.to_hf()["vision_use_head"] is False  # Dew writes no head, so transformers expects none
    assert SiglipConfig.from_hf(config.to_hf(), "vision_config") == config
    written = transformers.SiglipVisionConfig(**config.to_hf())
    for name, value in record.items():
        if name in {field for field in SiglipConfig.__dataclass_fields__}:
            assert getattr(written, name) == value, name
    assert config.geometry().patches == (config.image_size // config.patch_size) ** 2
    assert tower_config("siglip", record, "vision_config") == config


def test_parameters_carry_names_the_layout_knows(siglip):
    """Every tower and projector parameter is named with logical axes that `dew.sharding.Rules` maps."""
    _, _, config, _ = siglip
    projector = GemmaProjectorConfig(config.hidden_size, 48, config.image_size, config.patch_size, 4)
    patches = config.geometry().patches
    for module, sample in ((config.build(), jnp.zeros((1, 3, config.image_size, config.image_size))),
                           (projector.build(), jnp.zeros((1, patches, config.hidden_size)))):
        boxed = jax.eval_shape(module.init, jax.random.key(0), sample)["params"]
        shardings = Layout().shardings(MeshSpec().build(), boxed)
        assert len(jax.tree_util.tree_leaves(shardings)) == len(jax.tree_util.tree_leaves(nn.unbox(boxed)))


def test_bfloat16_tower_is_as_close_to_float32_as_transformers_bfloat16(siglip):
    """bf16 weights run in bf16 by both: each side's error against the fp32 states of the same bf16 weights.
    Dew keeps norms and activations in float32, rounding each once, so its error must not exceed
    transformers' by more than a quarter, give or take one bf16 ulp of the largest state, which each side's
    last rounding alone may cost (observed: image28-patch14 0.020 vs 0.021, image32-patch8-gelu 0.030 vs 0.031)."""
    model, _, config, params = siglip
    pixels = _pixels(config)
    bf16 = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    ours = config.build(jnp.bfloat16, jnp.bfloat16).apply({"params": bf16}, jnp.asarray(pixels))
    assert ours.dtype == jnp.bfloat16
    rounded = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), bf16)
    truth = np.asarray(config.build().apply({"params": rounded}, jnp.asarray(pixels)))
    with torch.no_grad():
        theirs = copy.deepcopy(model).to(torch.bfloat16)(
            pixel_values=torch.from_numpy(pixels).to(torch.bfloat16)).last_hidden_state.float().numpy()
    our_error = np.abs(np.asarray(ours, np.float32) - truth).max()
    their_error = np.abs(theirs - truth).max()
    assert our_error <= 1.25 * their_error + ulp_bound(1, np.abs(truth).max(), jnp.bfloat16)
    projector = GemmaProjectorConfig(config.hidden_size, 48, config.image_size, config.patch_size, 4)
    projector_params = projector.build().init(jax.random.key(0), truth)
    assert projector.build(jnp.bfloat16).apply(projector_params, ours).dtype == jnp.bfloat16


def _gemma3_config(image_size: int, patch_size: int, tokens: int = 4):
    vision = dict(model_type="siglip_vision_model", image_size=image_size, patch_size=patch_size, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vision_use_head=False)
    text = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, vocab_size=64)
    return transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=tokens)


# fp32 soft tokens (largest 5.1 and 6.3): each rounds in the pooling (k*k terms and a division), the norm
# (a 32-term mean of squares, its rsqrt, an add and three products) and the 32-term product, 25 ulps with
# the rsqrt's LIBRARY_ULPS, of the output's sum of term magnitudes |normed| @ |W| (up to 9.9): bounds of
# 9.7e-6 to 2.9e-5. The largest differences observed: pooling 1 1.4e-6, pooling 2 1.4e-6.
@pytest.mark.parametrize("image_size, patch_size, pooling", [(28, 14, 1), (32, 8, 2)])
def test_projector_matches_transformers(image_size, patch_size, pooling):
    reference = _gemma3_config(image_size, patch_size)
    module = transformers.models.gemma3.modeling_gemma3.Gemma3MultiModalProjector(reference).eval()
    _randomize(module, seed=3)
    config = GemmaProjectorConfig.from_hf(json.loads(reference.to_json_string()), "config.json")
    assert config.pooling == pooling == module.kernel_size
    side = image_size // patch_size
    states = np.random.default_rng(4).normal(size=(3, side * side, 32)).astype(np.float32)
    arrays = {name: value.numpy() for name, value in module.state_dict().items()}
    params = _read(projector_rules("gemma", config, ""), _shapes(config.build(), states), arrays)
    ours = np.asarray(jax.jit(config.build().apply)({"params": params}, jnp.asarray(states)))
    with torch.no_grad():
        theirs = module(torch.from_numpy(states)).numpy()
    assert ours.shape == theirs.shape == (3, 4, 48)
    pooled = states.reshape(3, 2, pooling, 2, pooling, 32).mean(axis=(2, 4)).reshape(3, 4, 32)
    normed = pooled / np.sqrt(np.mean(pooled**2, axis=-1, keepdims=True) + config.eps)
    normed = normed * (1 + arrays["mm_soft_emb_norm.weight"])
    magnitude = np.abs(normed) @ np.abs(arrays["mm_input_projection_weight"])
    ulps = np.sqrt(6 * (pooling**2 + 1 + config.vision_hidden + 4 + config.vision_hidden)) + LIBRARY_ULPS
    assert_within(ours, theirs, ulp_bound(ulps, magnitude), "soft tokens")


def test_projector_rules_give_back_the_state_dict():
    reference = _gemma3_config(32, 8)
    module = transformers.models.gemma3.modeling_gemma3.Gemma3MultiModalProjector(reference)
    _randomize(module, seed=5)
    config = GemmaProjectorConfig.from_hf(reference.to_dict(), "config.json")
    state = {f"model.multi_modal_projector.{name}": value.numpy() for name, value in module.state_dict().items()}
    params = _read(projector_rules("gemma", config, "model.multi_modal_projector."),
                   _shapes(config.build(), jnp.zeros((1, 16, 32))), state)
    plan = tensors.plan(projector_rules("gemma", config, "model.multi_modal_projector."), params)
    exported = {name: np.asarray(build()) for name, _, build in tensors.export_tensors(plan, params)}
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert config.to_hf() == {"mm_tokens_per_image": 4}


@pytest.mark.parametrize("field, value", [("num_patches", 64), ("use_cls_token", True), ("pruned_heads", {"0": [1]})])
def test_tower_config_refuses_a_field_it_does_not_compute(field, value):
    with pytest.raises(ValueError, match=f"vision_config field '{field}' = .* is not a field"):
        SiglipConfig.from_hf({"model_type": "siglip_vision_model", field: value}, "vision_config")


@pytest.mark.parametrize("record, message", [
    ({"hidden_act": "quick_gelu"}, r"hidden_act is 'quick_gelu'; Dew computes a SigLIP tower with \['gelu', "),
    ({"model_type": "siglip2_vision_model"}, "has model_type 'siglip2_vision_model'; a SigLIP tower is"),
    ({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size 30 does not split into num_attention_heads 4"),
    ({"image_size": [224, 224]}, r"image_size is \[224, 224\]; it must be a positive integer"),
])
def test_tower_config_refuses_what_dew_cannot_compute(record, message):
    with pytest.raises(ValueError, match=f"^vision_config.*{message}"):
        SiglipConfig.from_hf(record, "vision_config")


def test_tower_config_records_inert_fields_and_dropout():
    """Bookkeeping and the head switch change nothing; attention dropout is kept (and written) only."""
    record = {"model_type": "siglip_vision_model", "vision_use_head": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.50.0", "pruned_heads": {}, "attention_dropout": 0.1, "image_size": 896,
              "patch_size": 14, "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
              "num_attention_heads": 16}
    config = SiglipConfig.from_hf(record, "vision_config")
    assert config.attention_dropout == 0.1 and config.to_hf()["attention_dropout"] == 0.1
    assert config.geometry().patches == 4096 and config.num_channels == 3


@pytest.mark.parametrize("tokens, message", [
    (8, "mm_tokens_per_image 8 is not a square number"),
    (9, r"a grid of 2 x 2 patches \(image_size 28 / patch_size 14\) does not pool evenly to 3 x 3 soft tokens"),
])
def test_projector_config_refuses_a_grid_it_cannot_pool(tokens, message):
    record = _gemma3_config(28, 14).to_dict()
    record["mm_tokens_per_image"] = tokens
    with pytest.raises(ValueError, match=f"^config.json: {message}"):
        projector_config("gemma", record, "config.json")


def test_projector_config_reads_the_tower_record():
    record = _gemma3_config(28, 14).to_dict()
    record["vision_config"]["num_patches"] = 4
    with pytest.raises(ValueError, match="config.json vision_config field 'num_patches'"):
        GemmaProjectorConfig.from_hf(record, "config.json")


def test_unknown_kinds_are_refused_by_name():
    with pytest.raises(ValueError, match=re.escape(f"no vision tower 'clip': the towers it builds are {sorted(TOWERS)}")):
        tower_config("clip", {}, "vision_config")
    with pytest.raises(ValueError,
                       match=re.escape(f"no vision projector 'llava': the projectors it builds are {sorted(PROJECTORS)}")):
        projector_config("llava", {}, "config.json")
    assert {"siglip", "llama4", "qwen3_5"} <= set(TOWERS) and {"gemma", "llama4", "qwen3_5"} <= set(PROJECTORS)
    with pytest.raises(ValueError, match="no vision tower 'clip'"):
        tower_rules("clip", SiglipConfig(), "")
    with pytest.raises(TypeError, match="rules of 'gemma' are made from a GemmaProjectorConfig, not a SiglipConfig"):
        projector_rules("gemma", SiglipConfig(), "")
    assert set(TOWER_PREFIXES) == set(TOWERS) and set(PROJECTOR_PREFIXES) == set(PROJECTORS)


@pytest.mark.parametrize("prefix", TOWER_PREFIXES["siglip"])
def test_tower_prefix_found_in_each_layout(prefix):
    config = SiglipConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          image_size=28, patch_size=14)
    plan = tensors.plan(tower_rules("siglip", config, prefix), _shapes(config.build(), _pixels(config)))
    names = [*plan.tensors, f"{prefix}head.probe", "language_model.model.embed_tokens.weight"]
    assert tower_prefix("siglip", names, "model.safetensors") == prefix
    assert tower_ignorable("siglip", f"{prefix}head.probe", prefix)
    assert not tower_ignorable("siglip", f"{prefix}post_layernorm.weight", prefix)


def test_prefixes_refused_when_absent_or_doubled():
    with pytest.raises(ValueError, match=r"model.safetensors holds a vision tower \(siglip\) under none of them"):
        tower_prefix("siglip", ["language_model.model.embed_tokens.weight"], "model.safetensors")
    names = [f"{prefix}mm_input_projection_weight" for prefix in PROJECTOR_PREFIXES["gemma"]]
    with pytest.raises(ValueError, match=r"under each of \['multi_modal_projector.', 'model.multi_modal_projector.'\]"):
        projector_prefix("gemma", names, "model.safetensors")
    assert projector_prefix("gemma", names[1:], "model.safetensors") == "model.multi_modal_projector."


def test_tower_refuses_pixels_of_another_size():
    config = SiglipConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          image_size=28, patch_size=14)
    with pytest.raises(ValueError, match=r"pixel_values have shape \(1, 28, 28, 3\); this SigLIP tower reads "
                                         r"\[images, 3, 28, 28\]: resize .* and put channels first"):
        config.build().init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))
