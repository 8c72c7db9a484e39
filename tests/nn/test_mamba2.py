"""The Mamba2 mixer: the chunked scan against the step-by-step recurrence (float64), one layer against
transformers' `Mamba2Mixer` (outputs and gradients, float32), and its recurrent cache: a padded
prefill leaves each row's state as its own prompt would, decode steps continue it, and a reset row
starts from zeros."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dew.nn.mamba2 import Mamba2, Mamba2Mixer, ssd
from dew.nn.recurrent import document_starts
from dew.nn.transformer import LINEAR, CausalTransformer, DecoderConfig
from dew.run_config import to_json
from dew.sharding import with_names
from dew.training.mesh import Layout, MeshSpec
from tests.compiled import compiled
from tests.recurrent_cases import (
    KNOBS, check_a_reset_row_starts_from_zeros, check_gradients_match_torch, check_greedy_mixed_batch,
    check_packed_documents_do_not_see_each_other, check_padded_prefill_then_decode, context, order_one,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

WIDTH = 32


def reference_scan(x, dt, A, B, C, starts, state):
    """The recurrence one step at a time in float64: `S = exp(dt A) S + dt x (outer) B`, `y = S C`,
    the state zeroed first at a start."""
    x, dt, A, B, C, state = (np.asarray(t, np.float64) for t in (x, dt, A, B, C, state))
    Bn, S, H, P = x.shape
    R = H // B.shape[2]
    B, C = np.repeat(B, R, axis=2), np.repeat(C, R, axis=2)  # heads g*R ... read group g
    y = np.zeros_like(x)
    state = state.copy()
    for t in range(S):
        state = np.where(np.asarray(starts)[:, t, None, None, None], 0.0, state)
        decay = np.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", state, C[:, t])
    return y, state


@pytest.mark.parametrize("seq_len,chunk", [(16, 4), (13, 4), (13, 32), (7, 1)])
def test_chunked_scan_equals_the_recurrence(x64, seq_len, chunk):
    """Chunks that divide the sequence, that do not, one longer than it and chunks of one; with two
    groups, a document restart, padded positions (dt 0) and a carried-in state, in float64: only the
    order of the sums differs, a few hundred roundings of 1.1e-16 of terms up to about 10, so 1e-12."""
    rng = np.random.default_rng(seq_len * 100 + chunk)
    Bn, H, P, G, N = 2, 4, 3, 2, 5
    x = rng.normal(size=(Bn, seq_len, H, P))
    dt = rng.uniform(0.01, 0.5, (Bn, seq_len, H))
    dt[1, :3] = 0.0  # padding
    A = -rng.uniform(0.5, 4.0, H)
    B, C = rng.normal(size=(Bn, seq_len, G, N)), rng.normal(size=(Bn, seq_len, G, N))
    starts = np.zeros((Bn, seq_len), bool)
    starts[0, seq_len // 2] = True
    state = rng.normal(size=(Bn, H, P, N))
    y, final = compiled(ssd, *(jnp.asarray(t) for t in (x, dt, A, B, C, starts, state)), chunk)
    y_ref, final_ref = reference_scan(x, dt, A, B, C, starts, state)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(final), final_ref, rtol=0, atol=1e-12)


def test_document_starts_skip_padding_and_continue_the_cache():
    real = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0]], bool)
    segments = jnp.asarray([[0, 0, 1, 1, 2, 2], [1, 1, 0, 1, 2, 0]], jnp.int32)
    starts = document_starts(real, segments)
    np.testing.assert_array_equal(np.asarray(starts), [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0]])


# ---- one layer against transformers ------------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPES = {"one-group": dict(num_heads=4, head_dim=16, n_groups=1), "two-groups": dict(num_heads=4, head_dim=16,
                                                                                      n_groups=2)}


def hf_config(n_groups: int, chunk: int = 8, **fields):
    return transformers.Mamba2Config(
        hidden_size=WIDTH, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=n_groups, conv_kernel=4,
        chunk_size=chunk, num_hidden_layers=1, vocab_size=50, use_bias=False, use_conv_bias=True, **fields)


def shape_of(config) -> Mamba2:
    return Mamba2(num_heads=config.num_heads, head_dim=config.head_dim, state_size=config.state_size,
                  n_groups=config.n_groups, conv_kernel=config.conv_kernel, chunk_size=config.chunk_size,
                  use_bias=config.use_bias, use_conv_bias=config.use_conv_bias)


def hf_layer(config):
    """transformers' mixer with weights of order one, so that a wrong product shows."""
    layer = transformers.models.mamba2.modeling_mamba2.Mamba2Mixer(config, layer_idx=0).eval()
    return order_one(torch, layer)


def dew_params(layer) -> dict:
    """The layer's weights as the Dew mixer's parameters ([in, out] kernels; the convolution as torch's)."""
    w = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    params = {"in_proj": {"kernel": w["in_proj.weight"].T}, "out_proj": {"kernel": w["out_proj.weight"].T},
              "conv1d": {"kernel": w["conv1d.weight"], "bias": w["conv1d.bias"]},
              "A_log": w["A_log"], "dt_bias": w["dt_bias"], "D": w["D"], "norm": {"scale": w["norm.weight"]}}
    return jax.tree_util.tree_map(jnp.asarray, {"params": params})


def layer_bound(config, seq_len: int, magnitude: float, libraries: int = 2) -> float:
    """Two float32 evaluations of one layer, in other orders (and with another library's exp, softplus
    and rsqrt when `libraries` is 2), at outputs of `magnitude`: the projections (`hidden` and `I`
    terms), the convolution (K), the scan's scores (`state` terms), its sums over a chunk's positions
    and over the state (`chunk` and `state` terms, twice: within and between chunks, one product per
    chunk of the carried state), the gated norm (`I / groups` terms) walk randomly (six standard
    deviations of their count); each transcendental (softplus's exp and log, the decays' exp, silu
    twice, rsqrt) may differ by `LIBRARY_ULPS`, and a decay's argument, a sum of up to `chunk` terms
    of size up to |dt A| <= 4, carries their rounding into the exponential, relative in full."""
    I, L = config.num_heads * config.head_dim, min(config.chunk_size, seq_len)
    roundings = (WIDTH + config.conv_kernel + 2 * (config.state_size + L) + 2 * config.state_size
                 + seq_len // L + I // config.n_groups + I)
    library = (libraries - 1) * LIBRARY_ULPS * 6
    return ulp_bound(math.sqrt(6 * roundings) + library + 4 * L, magnitude)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request):
    config = hf_config(SHAPES[request.param]["n_groups"])
    layer = hf_layer(config)
    return config, layer, dew_params(layer), Mamba2Mixer(shape_of(config), config.layer_norm_epsilon)


@pytest.mark.parametrize("seq_len", [16, 13])
def test_layer_matches_transformers(pair, seq_len):
    """One and two groups (transformers 5.x normalizes the gated output per group of I / n_groups, as
    mamba_ssm's `RMSNormGated(group_size=d_ssm // ngroups)` does, so both agree and Dew follows them),
    at a multiple of the chunk (8) and not (observed: 9.5e-7 of outputs up to 3.3, against bounds near 5e-5)."""
    config, layer, params, mixer = pair
    x = np.random.default_rng(seq_len).normal(size=(2, seq_len, WIDTH)).astype(np.float32)
    with torch.no_grad():
        expected = layer(torch.from_numpy(x)).numpy()
    ours, _, _ = jax.jit(mixer.apply)(params, jnp.asarray(x), None, context(np.ones((2, seq_len))), KNOBS)
    magnitude = float(np.abs(expected).max())
    assert magnitude > 1.0
    assert_within(ours, expected, layer_bound(config, seq_len, magnitude), "layer outputs")


def test_layer_gradients_match_torch(pair):
    """The gradient of `sum(out * w)` for every parameter and the input, against torch's autograd
    through transformers' torch path (observed: 8.1e-7 relative to each gradient's largest entry;
    the backward pass rounds about as often as the forward, so twice the forward's bound)."""
    config, layer, params, mixer = pair
    check_gradients_match_torch(torch, layer, params, mixer, WIDTH, dew_params_grads,
                                lambda scale: 2 * layer_bound(config, 13, scale))


def dew_params_grads(grads) -> dict:
    """Dew's parameter gradients under transformers' names and layouts."""
    g = jax.tree_util.tree_map(np.asarray, grads)
    return {"in_proj.weight": g["in_proj"]["kernel"].T, "out_proj.weight": g["out_proj"]["kernel"].T,
            "conv1d.weight": g["conv1d"]["kernel"], "conv1d.bias": g["conv1d"]["bias"],
            "A_log": g["A_log"], "dt_bias": g["dt_bias"], "D": g["D"], "norm.weight": g["norm"]["scale"]}


# ---- the recurrent cache ---------------------------------------------------------------------------


def test_padded_prefill_then_decode_equals_each_row_alone(pair):
    """The same computation in other chunks: one library's bound."""
    config, _, params, mixer = pair
    check_padded_prefill_then_decode(mixer, params, mixer.shape, WIDTH,
                                     lambda n, m: layer_bound(config, n, m, libraries=1))


def test_a_reset_row_starts_from_zeros(pair):
    _, _, params, mixer = pair
    check_a_reset_row_starts_from_zeros(mixer, params, mixer.shape, WIDTH)


def test_packed_documents_do_not_see_each_other(pair):
    config, _, params, mixer = pair
    check_packed_documents_do_not_see_each_other(mixer, params, WIDTH,
                                                 lambda n, m: layer_bound(config, n, m, libraries=1))


# ---- a whole decoder of Mamba2 layers --------------------------------------------------------------


RECURRENT = Mamba2(num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4, chunk_size=4)


@pytest.fixture(scope="module")
def decoder():
    config = DecoderConfig(vocab_size=64, emb_features=WIDTH, num_layers=3, mlp_features=0, max_seq_len=64,
                           layer_types=(LINEAR,) * 3, recurrent=RECURRENT, norm_eps=1e-5, scan_layers=2)
    model = CausalTransformer(config)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    # Larger weights make the argmax depend on the context, so a state error would show.
    return model, jax.tree_util.tree_map(lambda x: x * 3.0, variables)


@pytest.fixture(scope="module")
def hybrid():
    """Mamba2 layers around an attention layer, every layer with an MLP: one decoder, two kinds of cache."""
    config = DecoderConfig(vocab_size=64, emb_features=WIDTH, num_layers=3, num_heads=4, mlp_features=48,
                           max_seq_len=64, layer_types=(LINEAR, "full_attention", LINEAR), recurrent=RECURRENT)
    model = CausalTransformer(config)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return model, jax.tree_util.tree_map(lambda x: x * 3.0, variables)


def test_a_mamba2_decoder_has_no_feed_forward_and_scans_its_layers(decoder):
    model, variables = decoder
    run = variables["params"]["layers_0to2"]
    assert set(run) == {"input_layernorm", "self_attn"}
    assert run["self_attn"]["in_proj"]["kernel"].shape == (3, WIDTH, 2 * 32 + 2 * 2 * 8 + 4)
    cache = model.init_cache(2, 16)
    assert cache.capacity == 16 and cache.runs[0].state.shape == (3, 2, 4, 8, 8)


@pytest.mark.parametrize("stack", ["decoder", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_greedy_cached_generation_of_a_mixed_batch_equals_the_uncached_argmax(stack, request):
    """Prompts of 3, 9 and 2 tokens left-padded together, then 10 steps through the state (and, in the
    hybrid stack, the attention layer's cache beside it)."""
    check_greedy_mixed_batch(*request.getfixturevalue(stack))


def test_the_mixers_parameters_carry_logical_axis_names(decoder):
    """So `Layout` places them like any other parameter (the stacked layer axis first)."""
    model, variables = decoder
    names = model.logical_names()["params"]["layers_0to2"]["self_attn"]
    assert names["in_proj"]["kernel"] == PartitionSpec("layers", "embed", "mlp")
    assert names["out_proj"]["kernel"] == PartitionSpec("layers", "mlp", "embed")
    assert names["conv1d"]["kernel"] == PartitionSpec("layers", "mlp", None, None)
    assert names["A_log"] == PartitionSpec("layers", "heads")
    assert names["norm"]["scale"] == PartitionSpec("layers", "norm")
    shardings = Layout().shardings(MeshSpec().build(), with_names(variables["params"], model.logical_names()["params"]))
    assert jax.tree_util.tree_structure(shardings) == jax.tree_util.tree_structure(variables["params"])


def test_a_recurrent_config_reads_back_from_run_json():
    """run.json records the shape as a dict (its open time-step bound as null); it reads back as it was."""
    config = DecoderConfig(vocab_size=64, emb_features=WIDTH, num_layers=2, mlp_features=0,
                           layer_types=(LINEAR,) * 2, recurrent=RECURRENT)
    back = DecoderConfig(**json.loads(json.dumps(to_json(config))))
    assert back == config and back.layer_specs == config.layer_specs


@pytest.mark.parametrize("fields, says", [
    (dict(layer_types=(LINEAR, LINEAR)), r"recurrent is None and layer_types names 2 'linear_attention' layers"),
    (dict(recurrent=RECURRENT), r"recurrent is the mixer of the linear_attention layers: give layer_types"),
    (dict(mlp_features=-1), r"mlp_features is -1; use 0 for layers without a feed-forward"),
])
def test_a_recurrent_config_missing_its_half_is_refused_by_name(fields, says):
    with pytest.raises(ValueError, match=says):
        DecoderConfig(vocab_size=64, emb_features=WIDTH, num_layers=2, **fields)
