"""LLaDA and Dream checkpoints: their released layouts load as bidirectional decoders whose fp32 logits match
an independent float64 forward written here from the published architectures, and generate through
native MDLM (Dream predicting each position from the state before it).

transformers has no class for either, so the oracle is this file's numpy forward: LLaDA's Llama block
(OLMo's names: `attn_norm`, `q_proj`, `attn_out`, `ff_norm`, `ff_proj` the SiLU gate, `up_proj`, `ff_out`)
and Dream's Qwen 2 block (query/key/value biases), each attending in both directions with rotate-half
rotary positions, RMS norms and the untied head. The fixtures are written by
tools/make_diffusion_fixtures.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import dew
from dew.diffusion.discrete import DiscreteProcess
from dew.inference import MaskedGeneration
from dew.interop import load_pretrained
from dew.interop.families import FAMILIES, family_for, family_of
from dew.objectives.base import Step
from dew.objectives.diffusion import MaskedDiffusionObjective
from tests.tolerances import decoder_ulps, ulp_bound

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
LLADA, DREAM = FIXTURES / "llada-tiny", FIXTURES / "dream-tiny"
TOKENS = np.asarray([[5, 17, 3, 88, 41, 9, 120, 126, 64, 2, 77, 31]])  # the two mask ids among them


def _rms(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate(x_THD, theta):
    """Rotate-half rotary positions 0..T-1, the layout LLaDA's and Dream's code apply."""
    T, _, D = x_THD.shape
    angles = np.arange(T)[:, None] * (1.0 / theta ** (np.arange(0, D, 2) / D))[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    rotated = np.concatenate([-x_THD[..., D // 2:], x_THD[..., : D // 2]], axis=-1)
    return x_THD * cos + rotated * sin


def _attend_both_ways(q_THD, k_TKD, v_TKD):
    """Softmax attention with no mask: every position reads every position."""
    groups = q_THD.shape[1] // k_TKD.shape[1]
    k_THD, v_THD = np.repeat(k_TKD, groups, axis=1), np.repeat(v_TKD, groups, axis=1)
    scores = np.einsum("thd,shd->hts", q_THD, k_THD) / math.sqrt(q_THD.shape[-1])
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v_THD)


def _block(x, w, names, heads, kv_heads, theta, eps):
    """One pre-norm block in float64: attention then the SiLU-gated MLP, each added to the residual."""
    linear = lambda h, name: h @ w[names[name] + ".weight"].T + w.get(names[name] + ".bias", 0.0)
    T, width = x.shape
    h = _rms(x, w[names["attn_norm"] + ".weight"], eps)
    q = linear(h, "q").reshape(T, heads, -1)
    k, v = linear(h, "k").reshape(T, kv_heads, -1), linear(h, "v").reshape(T, kv_heads, -1)
    x = x + linear(_attend_both_ways(_rotate(q, theta), _rotate(k, theta), v).reshape(T, width), "o")
    h = _rms(x, w[names["ff_norm"] + ".weight"], eps)
    gate = linear(h, "gate")
    return x + (gate / (1.0 + np.exp(-gate)) * linear(h, "up")) @ w[names["down"] + ".weight"].T


def reference_logits(directory: Path, ids) -> np.ndarray:
    """float64 logits `[T, V]` of one row of ids, from the checkpoint's own files."""
    config = json.loads((directory / "config.json").read_text())
    w = {name: value.astype(np.float64) for name, value in load_file(str(directory / "model.safetensors")).items()}
    if config["model_type"] == "llada":
        prefix, layers = "model.transformer.", config["n_layers"]
        shape = (config["n_heads"], config["n_kv_heads"], config["rope_theta"], config["rms_norm_eps"])
        block = lambda i: {key: f"{prefix}blocks.{i}.{name}" for key, name in (
            ("attn_norm", "attn_norm"), ("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "attn_out"),
            ("ff_norm", "ff_norm"), ("gate", "ff_proj"), ("up", "up_proj"), ("down", "ff_out"))}
        embed, final, head = prefix + "wte.weight", prefix + "ln_f.weight", prefix + "ff_out.weight"
    else:
        layers = config["num_hidden_layers"]
        shape = (config["num_attention_heads"], config["num_key_value_heads"], config["rope_theta"],
                 config["rms_norm_eps"])
        block = lambda i: {key: f"model.layers.{i}.{name}" for key, name in (
            ("attn_norm", "input_layernorm"), ("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
            ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"), ("ff_norm", "post_attention_layernorm"),
            ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))}
        embed, final, head = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
    x = w[embed][np.asarray(ids)]
    for i in range(layers):
        x = _block(x, w, block(i), *shape)
    return _rms(x, w[final], shape[3]) @ w[head].T


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny"])
def loaded(request):
    return request.param, load_pretrained(FIXTURES / request.param, dtype="float32", attention_impl="xla")


def _bound(bundle, length: int, logits) -> float:
    """fp32 against float64: Dew's one fp32 evaluation lies within the two-evaluation bound of
    `decoder_ulps` (two libraries' transcendentals, the random walk of its roundings) from the exact
    logits, of which the float64 forward is within 1e-13: that bound, of the largest logit."""
    c = bundle.model.config
    ulps = decoder_ulps(layers=c.num_layers, width=c.emb_features, mlp_width=c.mlp_features, heads=c.num_heads,
                        head_dim=c.head_dim, seq_len=length)
    return ulp_bound(ulps, np.abs(logits).max())


def test_fp32_logits_match_the_float64_forward(loaded):
    """2-layer width-32 decoders over 12 tokens, logits up to 4.4 and 4.9: the bound is 650 ulps of the
    largest, 3.4e-4 and 3.8e-4. Observed: llada-tiny 4.7e-6, dream-tiny 4.0e-6."""
    name, bundle = loaded
    assert not bundle.model.config.causal and isinstance(family_of(bundle.config).process(bundle.config),
                                                         DiscreteProcess)
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS, jnp.int32)), np.float64)[0]
    theirs = reference_logits(FIXTURES / name, TOKENS[0])
    assert np.abs(theirs).max() > 2.0
    np.testing.assert_allclose(ours, theirs, atol=_bound(bundle, TOKENS.shape[1], theirs), rtol=0, err_msg=name)
    # Bidirectional: the first position's logits change with the last token.
    later = TOKENS.copy()
    later[0, -1] = 30
    assert np.abs(reference_logits(FIXTURES / name, later[0])[0] - theirs[0]).max() > 1e-3


def test_the_clean_prediction_reads_the_family_s_position(loaded):
    """One evaluation unmasks every response position with its argmax: LLaDA's from the position's own
    logits, Dream's from the position before it (its logits shifted right by one)."""
    name, bundle = loaded
    process = family_of(bundle.config).process(bundle.config)
    prompt = [5, 17, 3, 88]
    drawn = process.generate(bundle.model, bundle.variables, [prompt], 6, key=jax.random.key(0), steps=1)
    theirs = reference_logits(FIXTURES / name, prompt + [process.mask_id] * 6)
    theirs[:, process.mask_id] = -np.inf
    rows = np.arange(4, 10) - process.logits_shift
    top2 = np.sort(theirs[rows], -1)[:, -2:]
    # Each argmax is decided by more than twice the fp32 bound, so it cannot flip on another CPU.
    assert (top2[:, 1] - top2[:, 0] > 2 * _bound(bundle, 10, theirs[:, :process.mask_id])).all()
    assert drawn.continuations()[0] == list(np.argmax(theirs[rows], -1))
    assert process.logits_shift == (1 if name == "dream-tiny" else 0)


def test_the_guides_llada_tiny_example_as_written(capsys):
    from dew.interop import load_pretrained

    bundle = load_pretrained(str(LLADA), dtype="float32", attention_impl="xla")
    task = bundle.text_generation()
    result = task([[1, 2, 3]], 8, seed=7, steps=16, n=2)
    print(result.host().tokens)
    assert isinstance(task, MaskedGeneration)
    assert isinstance(dew.pipeline(str(LLADA), dtype="float32", attention_impl="xla"), MaskedGeneration)
    with pytest.raises(ValueError, match="generates by masked diffusion, which takes no autoregressive sampling"):
        bundle.text_generation(sampling=bundle.generation)
    tokens = result.host().tokens
    assert tokens.shape == (2, 11) and (tokens[:, :3] == [1, 2, 3]).all() and not (tokens == 120).any()
    assert list(result.refinements) == [16, 16] and task.eos_token_ids == (121,)
    assert "[[" in capsys.readouterr().out


def test_a_dream_state_before_predicts_in_training_too(loaded):
    """The objective scores each masked position from the state its family predicts it from."""
    name, bundle = loaded
    process = family_of(bundle.config).process(bundle.config)
    objective = MaskedDiffusionObjective(bundle.model, process, seq_len=12, ema_decay=None)
    tokens = np.random.default_rng(0).integers(0, 120, (4, 12))  # clean text: no mask id
    key = jax.random.key(3)
    stats, _ = objective.loss(bundle.variables, {"text": jnp.asarray(tokens, jnp.int32)}, Step(jnp.int32(0), key))
    time_key, mask_key = jax.random.split(key)
    t = np.asarray(process.sample_times(time_key, 4), np.float64)
    noisy, masked = process.corrupt(mask_key, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, bool),
                                    jnp.asarray(t, jnp.float32))
    expected, bound = 0.0, 0.0
    for row in range(4):
        logits = reference_logits(FIXTURES / name, np.asarray(noisy)[row])
        logits = np.concatenate([logits[:1], logits[:-1]]) if process.logits_shift else logits
        # The fp32 logits' bound moves a cross entropy by at most twice it (the target's logit, the normaliser).
        bound += 2 * _bound(bundle, 12, logits) * np.asarray(masked)[row].sum() / t[row]
        logits[:, process.mask_id] = -np.inf
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        expected += np.sum(-log_probs[np.arange(12), tokens[row]] * np.asarray(masked)[row]) / t[row]
    # Observed: 2.4e-5 (llada-tiny) and 4.2e-7 (dream-tiny) on totals of 222 and 227, against bounds of 0.03.
    assert np.asarray(masked).sum() > 10
    np.testing.assert_allclose(float(stats.loss.total), expected, atol=bound, rtol=0)
    # And the other alignment scores differently, by more than ten bounds (2.4 for dream-tiny): the shift is
    # not lost in the rounding.
    flipped = DiscreteProcess(process.mask_id, logits_shift=1 - process.logits_shift)
    other = MaskedDiffusionObjective(bundle.model, flipped, seq_len=12, ema_decay=None)
    moved = other.loss(bundle.variables, {"text": jnp.asarray(tokens, jnp.int32)}, Step(jnp.int32(0), key))[0]
    assert abs(float(moved.loss.total) - expected) > 10 * bound


def test_a_save_keeps_the_mask_id_and_the_weights(loaded, tmp_path):
    name, bundle = loaded
    out = bundle.save(tmp_path / name)
    again = load_pretrained(out, dtype="float32", attention_impl="xla")
    assert again.config["mask_token_id"] == bundle.config["mask_token_id"]
    assert family_of(again.config) is family_of(bundle.config)
    for ours, theirs in zip(jax.tree_util.tree_leaves(again.variables), jax.tree_util.tree_leaves(bundle.variables)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("model_type, change, message", [
    ("llada", {"block_type": "sequential"}, "field 'block_type' = 'sequential'.*Dew loads block_type 'llama'"),
    ("llada", {"activation_type": "swiglu"}, "field 'activation_type' = 'swiglu'"),
    ("llada", {"include_bias": True}, "LLaDA's biases on every projection and on the head are not built"),
    ("llada", {"clip_qkv": 8.0}, "field 'clip_qkv' = 8.0 is not a field"),
    ("Dream", {"use_sliding_window": True, "sliding_window": 16}, "Dream's attention attends to every key"),
    ("Dream", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "reads rope_theta and rope_scaling"),
])
def test_config_fields_dew_cannot_compute_are_refused(model_type, change, message):
    directory = LLADA if model_type == "llada" else DREAM
    config = {**json.loads((directory / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        FAMILIES[model_type].decoder_kwargs(config)


def test_a_bare_decoder_config_is_never_written_as_a_masked_family(loaded):
    # Its bidirectional decoder is LLaDA's or Dream's, but a DecoderConfig holds no mask id to write.
    name, bundle = loaded
    converter = family_of(bundle.config)
    assert converter.differences(bundle.model.config) == [
        "no mask id (a masked-diffusion checkpoint needs one, and a DecoderConfig holds none)"]
    with pytest.raises(ValueError, match="no transformers family computes this model"):
        family_for(bundle.model.config)


def test_a_config_without_a_mask_id_cannot_sample():
    config = {key: value for key, value in json.loads((LLADA / "config.json").read_text()).items()
              if key != "mask_token_id"}
    FAMILIES["llada"].decoder_kwargs(config)  # the decoder does not need it
    with pytest.raises(ValueError, match="names no mask_token_id: set it to the id the model was trained to unmask"):
        FAMILIES["llada"].process(config)


def test_generation_controls_mdlm_cannot_follow_are_refused(tmp_path):
    import shutil

    copy = tmp_path / "dream"
    shutil.copytree(DREAM, copy)
    neutral = {"eos_token_id": 125, "pad_token_id": 125, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6}
    (copy / "generation_config.json").write_text(json.dumps(neutral))
    task = dew.pipeline(str(copy), dtype="float32")
    assert task.max_new_tokens == 6 and task.eos_token_ids == (125,)
    for name, value in (("alg", "entropy"), ("temperature", 0.2), ("use_cache", True)):
        (copy / "generation_config.json").write_text(json.dumps({**neutral, name: value}))
        with pytest.raises(ValueError, match=f"sets {name}={value!r}, which masked generation cannot follow"):
            dew.pipeline(str(copy), dtype="float32")
