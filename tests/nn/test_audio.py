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
from flax import linen as nn

from dew.interop import tensors
from dew.interop.audio import audio_prefix, audio_rules, audio_weights
from dew.nn.audio import CONSTANTS, TOWERS, audio_config
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Tiny towers: width 32 over 4 heads, 2 layers, chunks of 4 frames reading 4 frames back (Gemma 3n also one
# frame ahead), 16 mel bins. Three clips of 64, 41 and 23 frames: after the 4x subsampling 16, 11 and 6
# frames, so the last chunk of each clip is partly padding and the shortest clip's queries read padding keys.
GEMMA3N = dict(input_feat_size=16, hidden_size=32, conf_num_attention_heads=4, conf_num_hidden_layers=2,
               conf_attention_chunk_size=4, conf_attention_context_left=5, conf_attention_context_right=1,
               conf_reduction_factor=2, sscp_conv_channel_size=[8, 4], conf_attention_logit_cap=5.0)
# Gemma 4's: the same widths over 8 mel bins, chunks of 4 frames reading 3 frames back and one ahead (a
# context of 4 + 4 + 2 slots whose relative table holds 6 positions), every projection clipped.
GEMMA4 = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, subsampling_conv_channels=[8, 4],
              attention_chunk_size=4, attention_context_left=5, attention_context_right=2, attention_logit_cap=5.0,
              output_proj_dims=24)
LENGTHS = (64, 41, 23)


def _randomize(module, seed: int) -> None:
    """Every weight drawn afresh: matrices scaled by their rows' length so activations stay near one, norms'
    weights, per-dimension scales and biases away from their neutral values, so that a swapped or dropped one
    shows. Clipping bounds (Gemma 4's buffers) near the values' spread, so that some values clip: inputs
    at about +-2, outputs at about +-1.5."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, value in module.named_parameters():
            noise = torch.randn(value.shape, generator=generator)
            if value.ndim == 1:
                value.copy_((1 + 0.3 * noise) if "norm" in name else 0.5 * noise)
            else:
                value.copy_(noise * value[0].numel() ** -0.5)
        for name, value in module.named_buffers():
            bound = name.rsplit(".", 1)[-1]
            if bound in ("input_min", "input_max", "output_min", "output_max"):
                size = (2.0 if bound.startswith("input") else 1.5) + 0.2 * torch.rand((), generator=generator)
                value.copy_(-size if bound.endswith("min") else size)


def _clips(features: int, seed: int = 1):
    """Log-mel-like frames `[3, 64, features]` (padding frames hold other values, as an extractor's may)
    and the mask of `LENGTHS`."""
    rng = np.random.default_rng(seed)
    frames = rng.normal(size=(len(LENGTHS), max(LENGTHS), features)).astype(np.float32)
    mask = np.arange(max(LENGTHS))[None] < np.asarray(LENGTHS)[:, None]
    return frames, mask


def _state(model) -> dict:
    return {name: value.detach().numpy() for name, value in model.state_dict().items()}


# Each tower: transformers' config and model classes, the test config, the weights' seed.
CASES = {"gemma3n_audio": ("Gemma3nAudioConfig", "Gemma3nAudioEncoder", GEMMA3N, 0),
         "gemma4_audio": ("Gemma4AudioConfig", "Gemma4AudioModel", GEMMA4, 3)}


@pytest.fixture(scope="module", params=sorted(CASES))
def tower(request):
    """(kind, transformers' tower, its audio_config record, Dew's config, Dew's variables read from its tensors)."""
    config_class, model_class, fields, seed = CASES[request.param]
    reference = getattr(transformers, config_class)(**fields)
    model = getattr(transformers, model_class)(reference).eval()
    _randomize(model, seed)
    record = json.loads(reference.to_json_string())
    config = audio_config(request.param, record)
    return request.param, model, record, config, audio_weights(request.param, config, _state(model), prefix="")


def _run_transformers(kind, model, frames, mask):
    """transformers' features and mask (true at audio frames) for `frames` and `mask`."""
    with torch.no_grad():
        if kind == "gemma3n_audio":  # Gemma 3n's encoder takes the padding mask (true at padding)
            out = model(torch.from_numpy(frames), torch.from_numpy(~mask))
            return out.last_hidden_state.numpy(), ~out.audio_mel_mask.numpy()
        out = model(torch.from_numpy(frames), attention_mask=torch.from_numpy(mask))
        return out.last_hidden_state.numpy(), out.attention_mask.numpy()


def _conformer_ulps(config, kind: str) -> float:
    """Ulps of the outputs' size by which two fp32 evaluations of a tower may differ. The subsampling
    convolutions sum 9 and 9 * channels terms; Gemma 3n's cumulative group norms sum up to T*F*C values
    twice each (Gemma 4's LayerNorms 2C), the input projection F'*C' terms. Each conformer layer rounds in
    two feed-forwards (width- and 4*width-term products, two norms each of a width-term mean, a scaled add),
    two norms around the attention, the q/k/v and position projections (width terms), the scores (head_dim
    terms and the tanh cap), a softmax over the context (chunk+past+future terms) and its weighted values,
    the output projection, the light convolution's norms, projections and K-term convolution, and the last
    norm; Gemma 4 ends in a width-term output projection with a bias. The rounding errors walk randomly
    (six standard deviations); the libraries' transcendentals (per layer some ten rsqrts, softplus, tanh,
    exp, SiLU and sigmoid evaluations) add up in full."""
    fields = CASES[kind][2]
    width, layers, heads = fields["hidden_size"], 2, 4
    context, kernel = 4 + 5 + fields.get("conf_attention_context_right", fields.get("attention_context_right")), 5
    channels = fields.get("sscp_conv_channel_size", fields.get("subsampling_conv_channels"))
    mel = config.mel_features
    norm = width + 3
    per_layer = (2 * (2 * norm + width + 4 * width + 2) + 2 * norm + 4 * width + width // heads + 4 + 2 * context
                 + width + 2 * norm + 3 * width + kernel + 2)
    groups = (2 * max(LENGTHS) * mel * channels[0] if kind == "gemma3n_audio" else 2 * (2 * channels[0] + 4))
    subsample = 9 + 9 * channels[0] + groups + (mel // 4) * channels[1]
    roundings = subsample + layers * per_layer + (width + 1)
    return math.sqrt(6 * roundings) + LIBRARY_ULPS * (10 * layers + 4)


# fp32 outputs of 2-layer width-32 towers over three clip lengths, at the audio frames (zero elsewhere):
# Gemma 3n (largest 2.8): 428 ulps of the largest (its group norms' long running sums dominate), a bound of
# 1.4e-4; Gemma 4 (largest 3.7, its clipping bounds engaged: unbounded, the outputs move by 1.9): 205 ulps,
# 9.1e-5. The largest differences observed: Gemma 3n 1.5e-6, Gemma 4 1.7e-6.
def test_tower_matches_transformers(tower):
    kind, model, _, config, variables = tower
    frames, mask = _clips(config.mel_features)
    ours = jax.jit(config.build().apply)(variables, jnp.asarray(frames), jnp.asarray(mask))
    theirs, their_mask = _run_transformers(kind, model, frames, mask)
    np.testing.assert_array_equal(np.asarray(ours.mask), their_mask)
    # every clip's own length at the tower's rate: Gemma 3n keeps one frame in 8 (4x convolutions, reduction 2)
    assert their_mask.sum(axis=1).tolist() == ([8, 6, 3] if kind == "gemma3n_audio" else [16, 11, 6])
    assert np.abs(theirs).max() > 1.0
    bound = ulp_bound(_conformer_ulps(config, kind), np.abs(theirs).max())
    assert_within(np.asarray(ours.features)[their_mask], theirs[their_mask], bound, "features at audio frames")
    assert not np.asarray(ours.features)[~their_mask].any()


def test_config_record_round_trip(tower):
    kind, _, record, config, _ = tower
    inert = {"transformers_version", "initializer_range"}
    assert config.to_hf() == {name: value for name, value in record.items() if name not in inert}
    assert audio_config(kind, config.to_hf()) == config
    assert sorted(TOWERS) == ["gemma3n_audio", "gemma4_audio"]


@pytest.mark.parametrize("change, message", [
    ({"conf_new_knob": 3}, "'conf_new_knob' = 3 is not a field"),
    ({"model_type": "whisper"}, "model_type 'whisper'"),
    ({"hidden_size": 30}, "hidden_size 30"),
])
def test_config_refusals(tower, change, message):
    kind, _, record, _, _ = tower
    with pytest.raises(ValueError, match=message):
        audio_config(kind, {**record, **change})
    with pytest.raises(ValueError, match="no audio tower 'whisper'"):
        audio_config("whisper", record)


def test_config_refusals_of_each_tower():
    with pytest.raises(ValueError, match="two subsampling convolutions"):
        audio_config("gemma3n_audio", {**GEMMA3N, "sscp_conv_channel_size": [8, 4, 2]})
    with pytest.raises(ValueError, match="hidden_act is 'tanh'"):
        audio_config("gemma4_audio", {**GEMMA4, "hidden_act": "tanh"})
    with pytest.raises(ValueError, match="attention_context_left is 1"):
        audio_config("gemma4_audio", {**GEMMA4, "attention_context_left": 1})


def test_weights_round_trip_and_refusals(tower):
    kind, model, _, config, variables = tower
    state = _state(model)
    rules = audio_rules(kind, config, "model.audio_tower.")
    exported = {name: build() for name, _, build in tensors.export_tensors(tensors.plan(rules, variables), variables)}
    assert sorted(exported) == sorted("model.audio_tower." + name for name in state)
    for name, value in state.items():
        np.testing.assert_array_equal(exported["model.audio_tower." + name], value)
    # Gemma 4's clipping bounds are constants, one per layer, beside the parameters
    assert (CONSTANTS in variables) == (kind == "gemma4_audio")
    assert audio_prefix(kind, exported, "the export") == "model.audio_tower."
    with pytest.raises(ValueError, match="under none of them"):
        audio_prefix(kind, ["lm_head.weight"], "a text checkpoint")
    extra = "conformer.9.norm.weight" if kind == "gemma3n_audio" else "layers.9.norm_out.weight"
    with pytest.raises(ValueError, match=r"have no place in Dew's tower"):
        audio_weights(kind, config, {**state, extra: np.ones(32, np.float32)}, prefix="")
    layer = ".1." if kind == "gemma3n_audio" else "layers.1."
    with pytest.raises(ValueError, match="needs the tensors"):
        audio_weights(kind, config, {k: v for k, v in state.items() if layer not in k}, prefix="")
    with pytest.raises(TypeError, match="made from a"):
        audio_rules(kind, object())


def test_refuses_features_of_another_shape(tower):
    kind, _, _, config, variables = tower
    frames, mask = _clips(config.mel_features + 4)
    fits = r"\[B, T, 16\] log-mel frames" if kind == "gemma3n_audio" else "reads 2 .* give frames of 8 bins"
    with pytest.raises(ValueError, match=fits):
        config.build().apply(variables, jnp.asarray(frames), jnp.asarray(mask))
    with pytest.raises(ValueError, match="boolean mask"):
        config.build().apply(variables, jnp.asarray(frames[..., :config.mel_features]), jnp.asarray(mask, jnp.int32))


@pytest.mark.parametrize("tower", ["gemma4_audio"], indirect=True)
def test_unbounded_clipping_reads_and_a_nan_bound_is_refused(tower):
    """A Gemma 4 tower saved with a linear left unclipped keeps transformers' infinite bounds: they read as
    bounds that clip nothing; a NaN bound is refused."""
    kind, model, _, config, _ = tower
    state = _state(model)
    name = "layers.0.self_attn.q_proj.input_max"
    variables = audio_weights(kind, config, {**state, name: np.array(np.inf, np.float32)}, prefix="")
    assert variables[CONSTANTS]["layers_0to1"]["self_attn"]["q_proj"]["input_max"][0] == np.inf
    with pytest.raises(ValueError, match=f"tensor '{name}' holds a NaN"):
        audio_weights(kind, config, {**state, name: np.array(np.nan, np.float32)}, prefix="")


@pytest.mark.parametrize("kind", sorted(CASES))
def test_published_sizes_map_every_tensor(kind):
    """At the published checkpoints' sizes (transformers' defaults: 128 mel bins, 12 layers, width 1536 or
    1024), the rules tie every tensor of transformers' tower to a Dew leaf of its shape (shapes only: the
    reference is built on torch's meta device, Dew's through eval_shape)."""
    config_class, model_class = CASES[kind][:2]
    reference = getattr(transformers, config_class)()
    with torch.device("meta"):
        shapes = {name: tuple(value.shape) for name, value in getattr(transformers, model_class)(reference)
                  .state_dict().items()}
    config = audio_config(kind, json.loads(reference.to_json_string()))
    frames = np.zeros((1, 64, config.mel_features), np.float32)
    ours = nn.unbox(jax.eval_shape(config.build().init, jax.random.key(0), frames, np.ones((1, 64), bool)))
    plan = tensors.plan(audio_rules(kind, config, ""), ours)
    assert {name: tuple(shape) for name, shape in plan.tensors.items()} == shapes
