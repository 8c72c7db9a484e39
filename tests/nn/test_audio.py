"""Gemma 3n's and Gemma 4's audio towers against transformers' own on the same random weights, read through
Dew's tensor rules (dew.interop.audio): clips of different lengths in one batch, float32; the config readers
and the refusals."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import tensors
from dew.interop.audio import audio_prefix, audio_rules, audio_weights
from dew.nn.audio import TOWERS, Gemma3nAudio, audio_config
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Tiny towers: width 32 over 4 heads, 2 layers, chunks of 4 frames reading 4 frames back (Gemma 3n also one
# frame ahead), 16 mel bins. Three clips of 64, 41 and 23 frames: after the 4x subsampling 16, 11 and 6
# frames, so the last chunk of each clip is partly padding and the shortest clip's queries read padding keys.
GEMMA3N = dict(input_feat_size=16, hidden_size=32, conf_num_attention_heads=4, conf_num_hidden_layers=2,
               conf_attention_chunk_size=4, conf_attention_context_left=5, conf_attention_context_right=1,
               conf_reduction_factor=2, sscp_conv_channel_size=[8, 4], conf_attention_logit_cap=5.0)
LENGTHS = (64, 41, 23)


def _randomize(module, seed: int) -> None:
    """Every weight drawn afresh: matrices scaled by their rows' length so activations stay near one, norms'
    weights and per-dimension scales away from their neutral values, so that a swapped or dropped one shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, value in module.named_parameters():
            noise = torch.randn(value.shape, generator=generator)
            if value.ndim == 1:
                value.copy_((1 + 0.3 * noise) if "norm" in name else 0.5 * noise)
            else:
                value.copy_(noise * value[0].numel() ** -0.5)


def _clips(features: int, seed: int = 1):
    """Log-mel-like frames `[3, 64, features]` (padding frames hold other values, as an extractor's may)
    and the mask of `LENGTHS`."""
    rng = np.random.default_rng(seed)
    frames = rng.normal(size=(len(LENGTHS), max(LENGTHS), features)).astype(np.float32)
    mask = np.arange(max(LENGTHS))[None] < np.asarray(LENGTHS)[:, None]
    return frames, mask


def _state(model) -> dict:
    return {name: value.detach().numpy() for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def gemma3n():
    """(transformers' encoder, its audio_config record, Dew's config, Dew's variables read from its tensors)."""
    reference = transformers.Gemma3nAudioConfig(**GEMMA3N)
    model = transformers.Gemma3nAudioEncoder(reference).eval()
    _randomize(model, seed=0)
    record = json.loads(reference.to_json_string())
    config = audio_config("gemma3n_audio", record)
    return model, record, config, audio_weights("gemma3n_audio", config, _state(model), prefix="")


def _gemma3n_ulps(config: Gemma3nAudio) -> float:
    """Ulps of the outputs' size by which two fp32 evaluations of the tower may differ. The subsampling
    convolutions sum 9 and 9*8 terms, and each cumulative group norm sums up to T*F*C values twice; each
    conformer layer rounds in two feed-forwards (width and 4*width-term products, three norms each of a
    width-term mean), the q/k/v and position projections (width terms), the scores (head_dim terms, a
    tanh), a softmax over the context (chunk+past+future terms) and its weighted values, the output
    projection, the GLU, a K-term convolution, two norms and the last projection. The rounding errors walk
    randomly (six standard deviations); the libraries' transcendentals (per layer five rsqrts, the softplus,
    the tanh, the exp, two SiLUs, a sigmoid) add up in full."""
    width, layers = config.hidden_size, config.conf_num_hidden_layers
    context = config.conf_attention_chunk_size + config.conf_attention_context_left + config.conf_attention_context_right
    norm = width + 3
    per_layer = (2 * (2 * norm + width + 4 * width + 2) + 2 * norm + 4 * width + width // config.conf_num_attention_heads
                 + 2 * context + 4 + width + norm + config.conf_conv_kernel_size + 2 * width + 2)
    subsample = 9 + 9 * config.sscp_conv_channel_size[0] + 4 * max(LENGTHS) * 16 * 8 + width * 4
    roundings = subsample + layers * per_layer
    return math.sqrt(6 * roundings) + LIBRARY_ULPS * (10 * layers + 4)


# fp32 outputs (largest 2.8) of a 2-layer width-32 tower: _gemma3n_ulps gives 552 ulps of the largest (the
# group norms' long running sums dominate), a bound of 1.8e-4. The largest difference observed: 1.5e-6.
def test_gemma3n_matches_transformers(gemma3n):
    model, _, config, variables = gemma3n
    frames, mask = _clips(config.input_feat_size)
    ours = jax.jit(config.build().apply)(variables, jnp.asarray(frames), jnp.asarray(mask))
    with torch.no_grad():  # transformers' encoder takes the padding mask (true at padding)
        theirs = model(torch.from_numpy(frames), torch.from_numpy(~mask))
    their_mask = ~theirs.audio_mel_mask.numpy()
    np.testing.assert_array_equal(np.asarray(ours.mask), their_mask)
    assert their_mask.sum(axis=1).tolist() == [8, 6, 3]  # every clip's own length, subsampled 8x
    theirs = theirs.last_hidden_state.numpy()
    assert np.abs(theirs).max() > 1.0
    assert_within(ours.features, theirs, ulp_bound(_gemma3n_ulps(config), np.abs(theirs).max()), "features")
    assert not np.asarray(ours.features)[~their_mask].any()


def test_config_record_round_trip(gemma3n):
    _, record, config, _ = gemma3n
    assert config.to_hf() == {name: value for name, value in record.items() if name != "transformers_version"}
    assert audio_config("gemma3n_audio", config.to_hf()) == config
    assert sorted(TOWERS) == ["gemma3n_audio"]


@pytest.mark.parametrize("change, message", [
    ({"conf_new_knob": 3}, "'conf_new_knob' = 3 is not a field"),
    ({"model_type": "whisper"}, "model_type 'whisper'"),
    ({"sscp_conv_channel_size": [8, 4, 2]}, "two subsampling convolutions"),
    ({"hidden_size": 30}, "hidden_size 30"),
])
def test_config_refusals(gemma3n, change, message):
    record = {**gemma3n[1], **change}
    with pytest.raises(ValueError, match=message):
        audio_config("gemma3n_audio", record)
    with pytest.raises(ValueError, match="no audio tower 'whisper'"):
        audio_config("whisper", record)


def test_weights_round_trip_and_refusals(gemma3n):
    model, _, config, variables = gemma3n
    state = _state(model)
    rules = audio_rules("gemma3n_audio", config, "model.audio_tower.")
    exported = {name: build() for name, _, build in tensors.export_tensors(tensors.plan(rules, variables), variables)}
    assert sorted(exported) == sorted("model.audio_tower." + name for name in state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported["model.audio_tower." + name], value)
    assert audio_prefix("gemma3n_audio", exported, "the export") == "model.audio_tower."
    with pytest.raises(ValueError, match="under none of them"):
        audio_prefix("gemma3n_audio", ["lm_head.weight"], "a text checkpoint")
    with pytest.raises(ValueError, match=r"have no place in Dew's tower"):
        audio_weights("gemma3n_audio", config, {**state, "conformer.9.norm.weight": state["conformer.0.norm.weight"]},
                      prefix="")
    with pytest.raises(ValueError, match="needs the tensors"):
        audio_weights("gemma3n_audio", config, {k: v for k, v in state.items() if "conformer.1." not in k}, prefix="")
    with pytest.raises(TypeError, match="made from a Gemma3nAudio"):
        audio_rules("gemma3n_audio", object())


def test_refuses_features_of_another_shape(gemma3n):
    _, _, config, variables = gemma3n
    frames, mask = _clips(config.input_feat_size + 1)
    with pytest.raises(ValueError, match=r"\[B, T, 16\] log-mel frames"):
        config.build().apply(variables, jnp.asarray(frames), jnp.asarray(mask))
    with pytest.raises(ValueError, match="boolean mask"):
        config.build().apply(variables, jnp.asarray(frames[..., :16]), jnp.asarray(mask, jnp.int32))
