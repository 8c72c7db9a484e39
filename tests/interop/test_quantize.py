"""int8 weights for generation (dew.nn.quantize, `load_pretrained(..., quantize="int8")`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.runs import pipeline
from dew.interop import load_pretrained
from dew.kernels.int8 import dequantize
from dew.nn.quantize import EMBED_SCALE, GROUP, QUANT_COLLECTION, int8_groups, linear_paths, quantize_int8
from dew.sampling import Sampling, generate
from tests.compiled import compiled
from tests.tolerances import decoder_ulps, ulp_bound

SHAPE = dict(vocab_size=96, emb_features=32, num_layers=9, num_heads=4, num_kv_heads=2, mlp_features=64,
             max_seq_len=32)
# Groups of at most 12 inputs: the width 32 splits into 11 + 11 + 10, the MLP's 64 into 5 x 11 + 9, so
# the tiny models' products meet several groups, a shorter last one, and groups off the vector steps.
TINY_GROUP = 12


def dequantized_params(model, quantized) -> dict:
    """The float model whose weights are exactly what the int8 ones stand for: `q * scale` in float32."""
    params = jax.tree_util.tree_map(lambda x: x, quantized["params"])
    quant = quantized[QUANT_COLLECTION]
    for path in linear_paths(model, quantized):
        module, scales = params, quant
        for name in path:
            module, scales = module[name], scales[name]
        module["kernel"] = dequantize(module["kernel"], scales["kernel_scale"], axis=-2)
    table = params["embed_tokens"]
    table["embedding"] = dequantize(table["embedding"], quant[EMBED_SCALE], axis=-1)
    if "lm_head" in params:
        params["lm_head"]["kernel"] = dequantize(params["lm_head"]["kernel"], quant["lm_head"]["kernel_scale"], axis=-2)
    return {"params": params}


@functools.cache
def built(tie_embeddings: bool):
    model = models.build("causal_transformer", **SHAPE, tie_embeddings=tie_embeddings)
    variables = compiled(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return model, variables, quantize_int8(model, variables, group=TINY_GROUP)


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny(request):
    return built(request.param)


@pytest.fixture
def tied():
    return built(True)


def test_groups_round_to_half_a_step_and_zero_groups_divide_by_nothing():
    weight = np.array([[1.0, 0.0, -0.3], [-2.54, 0.0, 0.2], [0.5, 0.0, 0.0]], np.float32)  # [in 3, out 3]
    q, scale = int8_groups(weight, axis=-2, group=2)  # 2 groups of 2 inputs, the second holding one
    np.testing.assert_array_equal(scale, np.float32([[2.54 / 127, 1.0, 0.3 / 127], [0.5 / 127, 1.0, 1.0]]))
    assert q.dtype == np.int8 and q[1, 0] == -127 and q[0, 2] == -127 and q[2, 0] == 127 and np.all(q[:, 1] == 0)
    # Each weight lies within half a step of its int8 grid point (plus float32's own rounding).
    step = np.float32(np.asarray(dequantize(np.ones_like(q), scale, axis=-2)))
    assert np.all(np.abs(np.asarray(dequantize(q, scale, axis=-2)) - weight) <= step / 2 * (1 + 1e-6))
    # Widths that GROUP does not divide split into equal groups of at most GROUP, the last shorter.
    q, scale = int8_groups(np.ones((2, GROUP * 2 + 1), np.float32), axis=-1)
    assert scale.shape == (2, 3) and q.shape == (2, GROUP * 2 + 1)
    # 100 groups of 129 inputs would be groups of 2, of which 65 cover them: the scales are another weight's.
    with pytest.raises(ValueError, match=r"scales of shape \(2, 100\) do not fit an int8 weight of shape \(2, 129\)"):
        dequantize(q, np.ones((2, 100), np.float32), axis=-1)


def test_the_int8_model_computes_its_dequantized_weights(tiny):
    model, variables, quantized = tiny
    weights = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(quantized["params"])
               if jax.tree_util.keystr(path).endswith(("['kernel']", "['embedding']"))]
    assert weights and all(leaf.dtype == jnp.int8 for leaf in weights)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, SHAPE["vocab_size"])
    ours = np.asarray(compiled(model.apply, quantized, tokens))
    reference = np.asarray(compiled(model.apply, dequantized_params(model, quantized), tokens))
    # The same function as float32 weights q * scale, rounded in another order: every product term
    # takes one more rounding (q * scale, or the scale on the sum), at most doubling each sum's
    # roundings, so twice one library's own reordering allowance. Observed: about 2e-7 on logits of 0.5.
    ulps = 2 * decoder_ulps(layers=9, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=12, libraries=1)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=ulp_bound(ulps, np.abs(reference).max()))
    # And it is not the float model: int8 rounding moves the logits by far more than that allowance.
    floats = np.asarray(compiled(model.apply, variables, tokens))
    assert np.abs(ours - floats).max() > 10 * ulp_bound(ulps, np.abs(reference).max())


def test_scanned_and_per_layer_int8_variables_agree_and_generate(tied):
    model, _, quantized = tied
    tokens = jax.random.randint(jax.random.key(2), (1, 6), 0, SHAPE["vocab_size"])
    per_layer = model.unstack_variables(quantized)
    # One scale per output and group of inputs: [G, out] ([layers, G, out] stacked when scanned).
    down_proj = per_layer[QUANT_COLLECTION]["layers_3"]["mlp"]["down_proj"]
    assert down_proj["kernel_scale"].shape == (6, SHAPE["emb_features"])
    assert quantized[QUANT_COLLECTION]["embed_tokens_scale"].shape == (SHAPE["vocab_size"], 3)
    np.testing.assert_array_equal(model.apply(per_layer, tokens), model.apply(quantized, tokens))
    greedy = Sampling(temperature=0.0)
    ours = generate(model, quantized, tokens.tolist(), 8, key=jax.random.key(0), sampling=greedy)
    full = generate(model, dequantized_params(model, quantized), tokens.tolist(), 8, key=jax.random.key(0),
                    sampling=greedy)
    np.testing.assert_array_equal(ours.tokens, full.tokens)


def test_quantizing_twice_is_refused(tied):
    model, _, quantized = tied
    with pytest.raises(ValueError, match="already int8"):
        quantize_int8(model, quantized)


def test_load_pretrained_int8_generates_and_refuses_saving_and_bad_values(llama_checkpoint, tmp_path):
    directory, _ = llama_checkpoint
    floats = load_pretrained(directory)
    bundle = load_pretrained(directory, quantize="int8")
    expected = quantize_int8(floats.model, floats.variables)
    for a, b in zip(jax.tree_util.tree_leaves(bundle.variables), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(a, b)
    result = bundle.text_generation(Sampling(temperature=0.0))("hello", 4)
    # dew.pipeline (what dew generate and dew serve load through) quantizes the same way.
    task = pipeline(directory, quantize="int8")
    assert task.params[QUANT_COLLECTION].keys() == expected[QUANT_COLLECTION].keys()
    again = task.with_sampling(Sampling(temperature=0.0))("hello", 4)
    assert again.continuations() == result.continuations() and len(result.continuations()[0]) >= 1
    with pytest.raises(ValueError, match="int8 weights .* made for generation"):
        bundle.save(tmp_path / "export")
    with pytest.raises(ValueError, match=r"quantize='int4' is not a weight format Dew builds: use one of "
                                         r"\('int8', 'gguf'\)"):
        load_pretrained(directory, quantize="int4")


def test_linear_paths_are_traced_once_per_model_and_tree_whatever_the_dtypes(tied, monkeypatch):
    # a bfloat16 load asks twice, before and after its kernels become uint16 bits: one trace
    from dew import compilation_cache
    from dew.nn import quantize

    model, variables, _ = tied
    trace, traced = quantize._traced_linear_paths, []
    monkeypatch.setattr(quantize, "_LINEAR_PATHS", {})
    # the in-process memo alone: the suite's JAX cache would answer from a trace another test kept there
    # (tests/nn/test_kept_traces.py tests that keeping)
    monkeypatch.setattr(compilation_cache, "_root", lambda: None)
    monkeypatch.setattr(quantize, "_traced_linear_paths", lambda *args: traced.append(args) or trace(*args))
    first = linear_paths(model, variables)
    bits = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), variables)
    assert linear_paths(model, bits) == first == trace(model, variables)
    assert len(traced) == 1
    assert first and {path[-1] for path in first} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"}
    shallower = models.build("causal_transformer", **{**SHAPE, "num_layers": 2}, tie_embeddings=True)
    linear_paths(shallower, shallower.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    assert len(traced) == 2  # another model is traced


def test_uint16_bits_are_xla_bitcasts_bits_in_the_same_memory_on_the_cpu():
    from dew.nn.quantize import uint16_bits

    weights = jax.device_put(np.random.default_rng(0).standard_normal((8, 64), np.float32).astype(jnp.bfloat16))
    bits = uint16_bits(weights)
    assert bits.dtype == jnp.uint16 and bits.sharding == weights.sharding
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(jax.lax.bitcast_convert_type(weights, jnp.uint16)))
    assert bits.unsafe_buffer_pointer() == weights.unsafe_buffer_pointer()  # a view, not a copy
