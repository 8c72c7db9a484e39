"""Gemma 3n's vision side against transformers on the same random weights, read through Dew's tensor rules: the
MobileNet-v5 tower (transformers' TimmWrapperModel over timm's `mobilenetv5_300m_enc`, shrunk through its
`model_args`) and the multimodal embedder (`Gemma3nMultimodalEmbedder`), vision and audio; the published 300M
block list read and laid out as timm lays it out (shapes only); the config reader and the rules' way back."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from dew.interop import tensors
from dew.interop.vision import projector_prefix, projector_rules, tower_prefix, tower_rules
from dew.nn.vision import (Gemma3nEmbedder, Gemma3nEmbedderConfig, Gemma3nProjectorModule, MobileNetV5Config,
                           tower_config)
from dew.nn.vision.mobilenet import divisible
from tests.interop.timm_oracle import import_timm
from tests.nn.test_vision import _randomize, _read, _shapes
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Every block type the published encoder uses, each stage starting with a stride-2 block as there: edge residuals,
# universal inverted residuals with and without each depthwise convolution, multi-query attention with shrunk
# (v2) and full keys, and the fusion adapter over the last two stages (a 4 x 4 and a 2 x 2 grid from 64 pixels).
TINY_STAGES = (
    ("er_r1_k3_s2_e4_c8", "er_r1_k3_s1_e4_c8"),
    ("uir_r1_a3_k5_s2_e6_c16", "uir_r1_a5_k0_s1_e4_c16"),
    ("uir_r1_a5_k5_s2_e6_c16", "uir_r1_a0_k0_s1_e1_c16", "mqa_r1_k3_h2_v2_s1_d8_c16", "uir_r1_a0_k0_s1_e2_c16"),
    ("uir_r1_a5_k5_s2_e6_c24", "mqa_r1_k3_h2_s1_d8_c24", "uir_r1_a0_k0_s1_e2_c24"),
)
TINY_ARGS = {"stem_size": 8, "msfa_output_resolution": 2}
IMAGE = 64


def _timm():
    try:
        return import_timm()
    except ImportError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def gemma3n_tower():
    """(timm's encoder, the vision_config record, Dew's config, Dew's parameters read from its state dict).

    transformers' TimmWrapperModel would build the encoder with `timm.create_model(architecture, pretrained=False,
    num_classes=0, **model_args)` and run its `forward_features`; it refuses to start without a torchvision it can
    import, so the test makes that same call itself and names the tensors as a Gemma 3n checkpoint does."""
    timm = _timm()
    from timm.models._efficientnet_builder import decode_arch_def

    model_args = {"block_args": decode_arch_def([list(stage) for stage in TINY_STAGES]), **TINY_ARGS}
    # timm's builder pops keys from the block dicts it is given, so the record keeps its own copy
    record = json.loads(transformers.Gemma3nVisionConfig(model_args=copy.deepcopy(model_args)).to_json_string())
    model = timm.create_model(record["architecture"], pretrained=False, num_classes=0, **model_args).eval()
    _randomize(model, seed=0)
    with torch.no_grad():  # layer scales start at 1e-5, which would hide every residual branch
        for name, value in model.named_parameters():
            if name.endswith("gamma"):
                value.copy_(1 + 0.3 * torch.randn(value.shape, generator=torch.Generator().manual_seed(1)))
    config = dataclasses.replace(tower_config("gemma3n", record, "vision_config"), image_size=IMAGE)
    arrays = {f"model.vision_tower.timm_model.{name}": value.numpy() for name, value in model.state_dict().items()}
    prefix = tower_prefix("gemma3n", set(arrays), "the state dict")
    params = _read(tower_rules("gemma3n", config, prefix), _shapes(config.build(), _pixels()), arrays)
    return model, record, config, params


def _pixels(images: int = 2, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (images, 3, IMAGE, IMAGE)).astype(np.float32)


def _tower_ulps(config: MobileNetV5Config) -> float:
    """Ulps of the tokens' size by which two fp32 evaluations of the tower may differ: every rounding on the
    path, counted as `vision_tower_ulps` counts them (a `t`-term product or sum t - 1 roundings and one for its
    bias or scale, a norm over `C` channels 2C + 4, GELU 3, a softmax over T keys 2T + 1, a residual add 1),
    walking randomly (six standard deviations), plus the libraries' transcendentals (an rsqrt per norm, a tanh per
    GELU, an exp per softmax) in full."""
    roundings, transcendentals = 0, 0

    def norm(C):
        nonlocal roundings, transcendentals
        roundings += 2 * C + 4
        transcendentals += 1

    def conv_norm(terms, C, act):
        nonlocal roundings, transcendentals
        roundings += terms + 1 + 3 * act
        transcendentals += act
        norm(C)

    channels = config.channels()
    conv_norm(27 + 1, channels[0], True)
    side, C = IMAGE // 2, channels[0]
    for stage in config.blocks:
        for block in stage:
            out = divisible(block.channels)
            side //= block.stride
            if block.kind == "er":
                mid = divisible(C * block.expansion)
                conv_norm(block.kernel**2 * C, mid, True)
                conv_norm(mid, out, False)
            elif block.kind == "uir":
                mid = divisible(C * block.expansion)
                if block.start:
                    conv_norm(block.start**2, C, False)
                conv_norm(C, mid, True)
                if block.kernel:
                    conv_norm(block.kernel**2, mid, True)
                conv_norm(mid, out, False)
            else:
                keys = (side // block.kv_stride) ** 2
                norm(C)
                if block.kv_stride > 1:
                    conv_norm(block.kernel**2, C, False)
                roundings += 3 * C + block.key_dim + 1 + 2 * keys + 1 + keys + block.heads * block.key_dim
                transcendentals += 1
            roundings += 2  # the layer scale, the residual add
            C = out
    fused = sum(channels[f] for f in config.fusion_features)
    conv_norm(fused, divisible(2 * fused), True)
    conv_norm(divisible(2 * fused), config.hidden_size, False)
    roundings += 4  # the average pool
    norm(config.hidden_size)
    return math.sqrt(6 * roundings) + LIBRARY_ULPS * transcendentals


def test_tower_matches_transformers(gemma3n_tower):
    """fp32, a batch of two 64-pixel images through 11 blocks of every kind: each soft token equals transformers'
    (timm's) within the tower's rounding count (`_tower_ulps`: 457 ulps of the tokens' largest size). Observed:
    1.4e-4 of size 10.8 (111 ulps); the norms amplify early roundings, and timm's fp32 tokens lie 2.1e-4 from its
    own float64 evaluation, Dew's 6.6e-5."""
    model, record, config, params = gemma3n_tower
    pixels = _pixels()
    with torch.no_grad():
        out = model.forward_features(torch.from_numpy(pixels)).numpy()
    R = config.msfa_output_resolution
    assert out.shape == (2, config.hidden_size, R, R)
    theirs = out.reshape(2, config.hidden_size, R * R).transpose(0, 2, 1)  # as Gemma3nModel.get_image_features does
    ours = jax.jit(config.build().apply)({"params": params}, pixels)
    assert ours.shape == (2, R * R, config.hidden_size) == (2, config.geometry().patches, 2048)
    assert_within(ours, theirs, ulp_bound(_tower_ulps(config), np.abs(theirs).max()), "soft tokens")


def test_the_published_encoder_is_read_and_laid_out_as_timm_lays_it_out():
    """The 300M encoder's block list (Dew's default, what a Gemma 3n record names) against timm's own, built on
    the meta device: every tensor's name and shape, through the rules, from shapes alone."""
    timm = _timm()
    config = tower_config("gemma3n", transformers.Gemma3nVisionConfig().to_dict(), "vision_config")
    assert config == MobileNetV5Config()
    theirs = timm.create_model("mobilenetv5_300m_enc", device="meta").state_dict()
    shapes = _shapes(config.build(), jax.ShapeDtypeStruct((1, 3, 768, 768), np.float32))
    ours = tensors.plan(tower_rules("gemma3n", config, "model.vision_tower.timm_model."), shapes).tensors
    assert ours == {f"model.vision_tower.timm_model.{name}": tuple(value.shape) for name, value in theirs.items()}
    assert config.geometry().patches == 256


def test_the_config_round_trips_and_refuses_what_it_does_not_compute(gemma3n_tower):
    _, record, config, _ = gemma3n_tower
    # a record holds no image size (the processor's): the one read back is the default
    assert MobileNetV5Config.from_hf(config.to_hf(), "vision_config") == dataclasses.replace(config, image_size=768)
    assert config.to_hf()["model_args"]["block_args"] == record["model_args"]["block_args"]
    assert MobileNetV5Config().to_hf()["model_args"] is None
    with pytest.raises(ValueError, match=r"architecture is 'mobilenetv4_conv_small'; Dew builds timm's"):
        MobileNetV5Config.from_hf({**record, "architecture": "mobilenetv4_conv_small"}, "vision_config")
    with pytest.raises(ValueError, match=r"model_args \['layer_scale_init_value'\] are timm arguments"):
        MobileNetV5Config.from_hf({**record, "model_args": {"layer_scale_init_value": None}}, "vision_config")
    with pytest.raises(ValueError, match=r"hidden_size is 1024, but timm's mobilenetv5_300m_enc always outputs 2048"):
        MobileNetV5Config.from_hf({**record, "hidden_size": 1024}, "vision_config")
    with pytest.raises(ValueError, match=r"has option 'se0.25', which Dew does not build"):
        MobileNetV5Config(stages=(("er_r1_k3_s2_e4_c8_se0.25",),))
    with pytest.raises(ValueError, match=r"stage 0 block 1 .* each stage starts with a stride-2 er or uir block"):
        MobileNetV5Config(stages=(("er_r1_k3_s2_e4_c8", "uir_r1_a3_k0_s2_e4_c8"),))
    with pytest.raises(ValueError, match=r"pools evenly to msfa_output_resolution 3"):
        MobileNetV5Config(stages=TINY_STAGES, msfa_output_resolution=3, image_size=64)


def test_the_rules_write_back_what_they_read(gemma3n_tower):
    """Export gives transformers' state dict back, bit for bit."""
    model, _, config, params = gemma3n_tower
    plan = tensors.plan(tower_rules("gemma3n", config, ""), params)
    exported = {name: np.asarray(build()) for name, _, build in tensors.export_tensors(plan, params)}
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    assert sorted(exported) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


@pytest.mark.parametrize("modality", ["vision", "audio"])
def test_embedder_matches_transformers(modality):
    """fp32: soft features (vision's scaled by sqrt(hidden) first, as get_image_features does; audio's not), the
    same features unscaled through `Gemma3nProjectorModule.soft_embeddings` (the guide's audio path) and hard ids,
    each within the rounding count of two RMSNorms over `hidden` and `text` terms (2n + 4 each, an rsqrt each), a
    `hidden`-term projection and the scaling (observed: 6.0e-7 of size 2.2, vision; unscaled 4.2e-7 of size 1.4,
    bound 8.7e-6; the scaling moves transformers' own soft tokens by 0.85)."""
    hidden, text = 48, 32
    # a large epsilon against small features: only then does the norm see the vision scaling
    part = {"hidden_size": hidden, "vocab_size": 8, "rms_norm_eps": 0.5}
    vision = transformers.Gemma3nVisionConfig(**part, vocab_offset=100)
    audio = transformers.Gemma3nAudioConfig(**part, vocab_offset=108)
    text_config = transformers.Gemma3nTextConfig(hidden_size=text, vocab_size=128)
    reference = transformers.models.gemma3n.modeling_gemma3n.Gemma3nMultimodalEmbedder(
        vision if modality == "vision" else audio, text_config).eval()
    _randomize(reference, seed=3)
    record = {f"{modality}_config": (vision if modality == "vision" else audio).to_dict(),
              "text_config": {"hidden_size": text}}
    config = Gemma3nEmbedderConfig.from_hf(record, "config.json", modality)
    assert (config.vocab_offset, config.feature_scale) == ((100, math.sqrt(hidden)) if modality == "vision" else (108, 1))
    arrays = {name: value.numpy() for name, value in reference.state_dict().items()}
    module = Gemma3nProjectorModule(config)  # the guide's name for what config.build() makes
    assert Gemma3nProjectorModule is Gemma3nEmbedder and isinstance(config.build(), Gemma3nProjectorModule)
    shapes = _shapes(module, jax.ShapeDtypeStruct((1, 1, hidden), np.float32))
    params = _read(projector_rules("gemma3n", config, ""), shapes, arrays)
    both = {f"model.embed_{part}.embedding_projection.weight" for part in ("vision", "audio")}
    assert projector_prefix("gemma3n", both, "the checkpoint") == "model.embed_vision."

    rng = np.random.default_rng(4)
    features = 0.3 * rng.normal(size=(2, 5, hidden)).astype(np.float32)
    ids = config.vocab_offset + np.array([[0, 7, 3], [5, 5, 1]])
    with torch.no_grad():
        scaled = torch.from_numpy(features) * (hidden**0.5 if modality == "vision" else 1.0)
        soft = reference(inputs_embeds=scaled).numpy()
        unscaled = reference(inputs_embeds=torch.from_numpy(features)).numpy()
        hard = reference(input_ids=torch.from_numpy(ids)).numpy()
    ours_soft = module.apply({"params": params}, features)
    ours_hard = module.apply({"params": params}, ids, method="embed")
    # soft_embeddings: transformers' embedder over the features as they are, the way audio goes through it
    ours_unscaled = module.apply({"params": params}, features, method="soft_embeddings")
    ulps = math.sqrt(6 * (2 * (2 * hidden + 4) + hidden + 2 * text + 4 + 1)) + 2 * LIBRARY_ULPS
    assert_within(ours_soft, soft, ulp_bound(ulps, np.abs(soft).max()), "soft tokens")
    assert_within(ours_unscaled, unscaled, ulp_bound(ulps, np.abs(unscaled).max()), "unscaled soft tokens")
    if modality == "audio":  # a call scales audio by 1: it is soft_embeddings exactly
        np.testing.assert_array_equal(ours_soft, ours_unscaled)
    assert_within(ours_hard, hard, ulp_bound(ulps, np.abs(hard).max()), "hard tokens")
    assert modality == "audio" or np.abs(unscaled - soft).max() > 0.1  # the scaling shows
