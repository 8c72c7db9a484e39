"""Llama 4's text decoder (`llama4_text`) against transformers' `Llama4ForCausalLM` on tiny random checkpoints,
in float32: logits (unpadded, and left-padded rows against transformers fed each row alone), each Llama 4
knob mattering, cached greedy continuations against `generate`, and save -> transformers reload."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dew.interop import load_pretrained
from dew.interop.families import family_for
from dew.nn.transformer import CausalTransformer
from dew.sampling import Sampling
from tests.compiled import compiled
from tests.interop.conftest import save_checkpoint, scatter_weights, torch, transformers
from tests.tolerances import LIBRARY_ULPS, assert_within, decoder_ulps, rotary_frequency_ulps, ulp_bound

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
             max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
             attn_implementation="eager")
CASES = {
    # layers 1 and 3 sparse, layer 3 NoPE with a temperature that rises every 2 positions, the rotated layers
    # chunked by 3 with the L2 query/key norm
    "chunked-nope-temperature": dict(interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=3,
                                     floor_scale=2, attn_scale=0.5, use_qk_norm=True),
    # every layer sparse, NoPE every second layer without a temperature, no chunks, no query/key norm
    "unchunked-plain": dict(interleave_moe_layer_step=1, no_rope_layer_interval=2, attention_chunk_size=None,
                            attn_temperature_tuning=False, use_qk_norm=False),
}
TOKENS = np.random.default_rng(0).integers(3, 97, (2, 11)).astype(np.int32)


def llama4_ulps(config, seq_len: int) -> float:
    """Ulps of the logits' size between Dew's and transformers' fp32 logits: `decoder_ulps` over the widest
    feed-forward (the dense `intermediate_size_mlp`), plus per layer what Llama 4 adds along the chain: the
    L2 norm of queries and keys (a `head_dim`-term mean of squares, an rsqrt, a product), the temperature (a
    division, a floor, a log1p, a product and a sum, then the query's product), and in a sparse layer the
    router's width-term logit, its sigmoid, the weighted input, the top-k and shared experts' sum (k + 1
    terms) and the shared expert (gate and up over the width, the activation, down over its width). Their
    rounding walks randomly (sqrt(6 N)); rsqrt, log1p and the sigmoid's exp from two libraries add
    LIBRARY_ULPS each, per layer."""
    width, layers, head_dim = config.hidden_size, config.num_hidden_layers, config.head_dim
    chain = decoder_ulps(layers=layers, width=width, mlp_width=max(config.intermediate_size_mlp,
                                                                     config.intermediate_size),
                         heads=config.num_attention_heads, head_dim=head_dim, seq_len=seq_len,
                         frequency_ulps=rotary_frequency_ulps())
    sparse = (width + 1) + 3 + (config.num_experts_per_tok + 1) + (2 * width + 3 + config.intermediate_size)
    extra = layers * ((head_dim + 3) + 6 + sparse)
    return chain + math.sqrt(6 * extra) + 3 * LIBRARY_ULPS * layers


def _bound(model, theirs, seq_len):
    assert np.abs(theirs).max() > 2.0  # weights large enough for a wrong convention to show
    return ulp_bound(llama4_ulps(model.config, seq_len), np.abs(theirs).max())


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    """(case, transformers model, its directory, Dew's load of it)."""
    config = transformers.Llama4TextConfig(**SHAPE, **CASES[request.param])
    torch.manual_seed(0)
    model = scatter_weights(transformers.Llama4ForCausalLM(config).eval(), std=0.4)
    directory = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, directory, load_pretrained(directory, dtype="float32", max_seq_len=64)


def _theirs(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()


def test_config_reads_as_layer_specs(loaded):
    case, model, directory, bundle = loaded
    config = bundle.model.config
    specs = config.layer_specs
    nope = [i for i, rotated in enumerate(model.config.no_rope_layers) if not rotated]
    assert [i for i, spec in enumerate(specs) if not spec.mixer.rotary] == nope
    assert config.sparse_layers == tuple(model.config.moe_layers)
    chunk = model.config.attention_chunk_size
    assert [spec.mixer.chunk for spec in specs] == [None if i in nope or chunk is None else chunk for i in range(4)]
    assert all(spec.mixer.qk_norm == (model.config.use_qk_norm and i not in nope) for i, spec in enumerate(specs))
    assert family_for(config).model_type == "llama4_text"  # the only family computing these layers


def test_logits_match_transformers(loaded):
    case, model, _, bundle = loaded
    ours = np.asarray(jax.jit(bundle.model.apply)(bundle.variables, TOKENS))
    theirs = _theirs(model, TOKENS)
    # bounds 1.4e-3 (chunked, logits up to 9.0) and 1.1e-3 (plain, up to 7.2); observed 1.5e-5 and 2.3e-5
    assert_within(ours, theirs, _bound(model, theirs, TOKENS.shape[1]), case)

    # each Llama 4 knob matters: switched off, Dew's logits leave the tolerance
    c = bundle.model.config
    changes = {"nope": dict(nope=None), "weighted_inputs": dict(mixture=dataclasses.replace(c.mixture,
                                                                                           weighted_inputs=False))}
    if c.attention_chunk_size is not None:
        changes["chunks"] = dict(layer_types=None, attention_chunk_size=None)
        changes["temperature"] = dict(nope=dataclasses.replace(c.nope, floor_scale=None))
    if c.qk_norm:
        changes["qk_norm"] = dict(qk_norm=False)
    for name, change in changes.items():
        changed = np.asarray(compiled(CausalTransformer(dataclasses.replace(c, **change)).apply, bundle.variables, TOKENS))
        assert np.abs(changed - theirs).max() > 10 * _bound(model, theirs, TOKENS.shape[1]), name


def test_left_padded_rows_match_transformers_fed_singly(loaded):
    """transformers scales NoPE queries by the padded slot index, not the position, so its reference run
    takes each row alone; Dew's padded batch reads positions and chunks from each row's first real token."""
    case, model, _, bundle = loaded
    short = TOKENS[1, :7]
    tokens = np.stack([TOKENS[0], np.concatenate([np.zeros(4, np.int32), short])])
    mask = tokens != 0
    mask[0] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, tokens, attention_mask=mask, positions=positions))
    for row, alone in enumerate([TOKENS[0], short]):
        theirs = _theirs(model, alone[None])[0]
        assert_within(ours[row][mask[row]], theirs, _bound(model, theirs, TOKENS.shape[1]), f"{case} row {row}")


def test_cached_greedy_continuation_matches_generate(loaded):
    """12 new tokens cross chunk boundaries and temperature steps in the cache."""
    case, model, _, bundle = loaded
    prompt = [int(t) for t in TOKENS[0, :5]]
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ours = bundle.text_generation(Sampling(temperature=0.0))([prompt], 12)
    assert [int(t) for t in ours.continuations()[0]] == theirs, case


def test_save_reloads_in_transformers(loaded, tmp_path):
    case, model, directory, bundle = loaded
    saved = bundle.save(tmp_path / "export")
    source, written = load_file(directory / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(source)
    for name, tensor in source.items():  # the query and key rows back in transformers' pair order
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == "llama4_text" and config["no_rope_layers"] == model.config.no_rope_layers
    again = transformers.Llama4ForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    np.testing.assert_array_equal(_theirs(again, TOKENS), _theirs(model, TOKENS))
