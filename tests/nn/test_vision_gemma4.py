"""Gemma 4's vision tower and embedder against transformers' `Gemma4VisionModel` and `Gemma4MultimodalEmbedder` on
the same random weights, read through Dew's tensor rules (dew.interop.vision): images of other patch grids padded
to one patch count, with clipped linears whose bounds bite and standardization; the bounds and the
standardization live in the `constants` collection; the config reader's refusals."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import linen as nn

from dew.interop.export import merge_collections, split_collections
from dew.interop.vision import projector_rules, tower_rules
from dew.nn.audio import CONSTANTS
from dew.nn.vision import Gemma4Projector, Gemma4ProjectorConfig, Gemma4ProjectorModule, Gemma4VisionConfig
from tests.nn.test_vision import _randomize, _read
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, pooling_kernel_size=2, patch_size=4, position_embedding_size=16, use_clipped_linears=True,
             standardize=True)
GRIDS = [(4, 6), (2, 2), (6, 2)]  # (rows, columns) of patches: a wide image, the smallest, a tall one
PATCHES = 24  # every image padded to the largest's patch count


def _positions(rows: int, columns: int) -> np.ndarray:
    """(column, row) of each patch in row-major order, padded with (-1, -1) to PATCHES."""
    row, column = np.divmod(np.arange(rows * columns), columns)
    positions = np.full((PATCHES, 2), -1, np.int64)
    positions[:rows * columns] = np.stack([column, row], axis=-1)
    return positions


def set_bounds(model, seed: int) -> None:
    """The clipping bounds and standardization of a transformers Gemma 4 tower drawn so that they bite (an input or
    output bound near the activations' own size clips some of them); some stay infinite, as checkpoints hold them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "output_min", "input_max", "output_max")):
                sign = -1.0 if name.endswith("min") else 1.0
                size = 1.0 + 2.0 * torch.rand((), generator=generator)
                buffer.copy_(sign * size if torch.rand((), generator=generator) < 0.8 else sign * torch.inf)
            elif name.endswith("std_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("std_scale"):
                buffer.copy_(1 + 0.3 * torch.randn(buffer.shape, generator=generator))


@pytest.fixture(scope="module")
def gemma4_tower():
    """(transformers' tower and embedder, Dew's tower and projector configs, their variables read from the state
    dicts)."""
    reference = transformers.Gemma4VisionConfig(**SHAPE, attn_implementation="eager")
    model = transformers.Gemma4VisionModel(reference).eval()
    _randomize(model, seed=0)
    set_bounds(model, seed=1)
    text = transformers.Gemma4TextConfig(hidden_size=48)
    embedder = transformers.models.gemma4.modeling_gemma4.Gemma4MultimodalEmbedder(reference, text).eval()
    _randomize(embedder, seed=2)
    record = json.loads(reference.to_json_string())
    config = Gemma4VisionConfig.from_hf(record, "vision_config")
    projector = Gemma4ProjectorConfig.from_hf({"vision_config": record, "text_config": {"hidden_size": 48}},
                                              "config.json")
    example = config.example(np.float32)
    shapes = jax.eval_shape(config.build().init, jax.random.key(0), example["pixel_values"][0],
                            example["image_position_ids"][0])
    arrays = {name: value.numpy() for name, value in model.state_dict().items()}
    merged = _read(tower_rules("gemma4", config, ""), merge_collections(nn.unbox(shapes)), arrays)
    variables = split_collections(merged, nn.unbox(shapes))
    projector_shapes = jax.eval_shape(projector.build().init, jax.random.key(0),
                                      jax.ShapeDtypeStruct((1, 1, config.hidden_size), np.float32))
    projector_params = _read(projector_rules("gemma4", projector, ""), nn.unbox(projector_shapes)["params"],
                             {name: value.numpy() for name, value in embedder.state_dict().items()})
    return model, embedder, config, projector, variables, projector_params


def test_tower_and_embedder_match_transformers(gemma4_tower):
    """fp32, images padded to 24 patches: each real soft token, and each embedded token, equals transformers'
    within the tower's rounding count (`vision_tower_ulps`, its norms RMS and four a block, plus the q/k/v norms and
    the gated MLP's product, each a handful of roundings; the pool a 4-term mean and the scale; the embedder an RMS
    norm and a product over 32 terms; observed: soft tokens 4.8e-5 of size 32 (bound 6.3e-4), embedded 3.0e-6 of size 3.2)."""
    model, embedder, config, projector, variables, projector_params = gemma4_tower
    rng = np.random.default_rng(5)
    pixels = rng.uniform(0, 1, (len(GRIDS), PATCHES, config.patch_features)).astype(np.float32)
    positions = np.stack([_positions(*grid) for grid in GRIDS])
    for n, (rows, columns) in enumerate(GRIDS):
        pixels[n, rows * columns:] = 0.0  # the processor pads with zero pixels
    with torch.no_grad():
        theirs = model(torch.from_numpy(pixels), pixel_position_ids=torch.from_numpy(positions)).last_hidden_state
        their_embedded = embedder(theirs[None])[0].numpy()
    theirs = theirs.numpy()

    tokens = config.build().apply(variables, pixels, positions.astype(np.int32))
    embedded = np.asarray(projector.build().apply({"params": projector_params}, tokens))
    tokens = np.asarray(tokens)
    counts = [rows * columns // config.block for rows, columns in GRIDS]
    ours = np.concatenate([tokens[n, :count] for n, count in enumerate(counts)])
    ours_embedded = np.concatenate([embedded[n, :count] for n, count in enumerate(counts)])
    assert ours.shape == theirs.shape and np.abs(theirs).max() > 1

    E = config.hidden_size
    ulps = vision_tower_ulps(layers=config.num_hidden_layers, width=E, mlp_width=config.intermediate_size,
                             heads=config.num_attention_heads, patches=PATCHES, patch_inputs=config.patch_features)
    # the extra norms a block (two RMS norms, q/k/v norms over a head), the gate's product, the pool and scale
    ulps += math.sqrt(6 * config.num_hidden_layers * (2 * (2 * E + 4) + 3 * (2 * config.head_dim + 4) + 1) + 6 * 8)
    # the tower's states are of the pooled tokens' size over sqrt(hidden) and the standardization's scale
    assert_within(ours, theirs, ulp_bound(ulps + 8, np.abs(theirs).max()), "soft tokens")
    embed_ulps = ulps + 8 + math.sqrt(6 * (2 * E + 4 + E)) + LIBRARY_ULPS
    assert_within(ours_embedded, their_embedded, ulp_bound(embed_ulps, np.abs(their_embedded).max() * 2), "embedded")


def test_bounds_are_constants_and_bite(gemma4_tower):
    """The clipping bounds and standardization are float32 constants beside the parameters (none of them a
    parameter); finite bounds change the tokens (the same weights without them give others)."""
    model, embedder, config, projector, variables, projector_params = gemma4_tower
    constants = variables[CONSTANTS]
    assert set(constants) == {"layers_0to1", "std_bias", "std_scale"}
    layer = constants["layers_0to1"]["self_attn"]["q_proj"]
    assert set(layer) == {"input_min", "input_max", "output_min", "output_max"} and layer["input_min"].shape == (2,)
    params = "/".join(jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(variables["params"])[0])
    assert "input_min" not in params and "std_" not in params
    pixels = np.random.default_rng(6).uniform(0, 1, (1, PATCHES, config.patch_features)).astype(np.float32)
    positions = _positions(4, 6)[None].astype(np.int32)
    clipped = np.asarray(config.build().apply(variables, pixels, positions))
    free = jax.tree.map(lambda bound: np.where(bound < 0, -np.inf, np.inf).astype(np.float32), constants["layers_0to1"])
    unclipped = np.asarray(config.build().apply(
        {**variables, CONSTANTS: {**constants, "layers_0to1": free}}, pixels, positions))
    assert np.abs(clipped - unclipped).max() > 1e-2


def test_the_projector_module_embeds_audio_frames_as_transformers():
    """`Gemma4ProjectorModule` (the guide's name for `Gemma4Projector`) over an audio tower's frames, its input width
    the audio config's `output_proj_dims`, against transformers' `Gemma4MultimodalEmbedder` built from that audio
    config: fp32, an RMS norm over 24 terms and a 24-term product (observed 9.5e-7 of size 2.9, bound 8.7e-6)."""
    assert Gemma4ProjectorModule is Gemma4Projector
    audio = transformers.Gemma4AudioConfig(hidden_size=32, num_attention_heads=4, output_proj_dims=24)
    text = transformers.Gemma4TextConfig(hidden_size=40)
    embedder = transformers.models.gemma4.modeling_gemma4.Gemma4MultimodalEmbedder(audio, text).eval()
    _randomize(embedder, seed=7)
    config = Gemma4ProjectorConfig(audio.output_proj_dims, text.hidden_size, audio.rms_norm_eps)
    module = Gemma4ProjectorModule(config)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1, 24), np.float32))
    params = _read(projector_rules("gemma4", config, ""), nn.unbox(shapes)["params"],
                   {name: value.numpy() for name, value in embedder.state_dict().items()})
    frames = np.random.default_rng(8).normal(size=(2, 7, 24)).astype(np.float32)
    with torch.no_grad():
        theirs = embedder(torch.from_numpy(frames)).numpy()
    ours = np.asarray(module.apply({"params": params}, frames))
    assert ours.shape == (2, 7, 40)
    assert_within(ours, theirs, ulp_bound(math.sqrt(6 * (2 * 24 + 4 + 24)) + LIBRARY_ULPS, np.abs(theirs).max()),
                  "audio frames")


@pytest.mark.parametrize("record, message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}, "axial rotary"),
    ({"head_dim": 6}, "multiple of 4"),
    ({"num_key_value_heads": 5}, "equal groups"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"vision_use_head": True}, "'vision_use_head'"),
    ({"model_type": "siglip_vision_model"}, "gemma4_vision"),
])
def test_config_refusals_name_the_field(record, message):
    with pytest.raises(ValueError, match=message):
        Gemma4VisionConfig.from_hf(record, "vision_config")


def test_config_round_trips():
    config = Gemma4VisionConfig.from_hf(SHAPE, "vision_config")
    assert Gemma4VisionConfig.from_hf(config.to_hf(), "vision_config") == config
    assert config.example(np.float32)["pixel_values"].shape == (1, 1, 4, 48)
