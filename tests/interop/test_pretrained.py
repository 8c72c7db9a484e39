"""`load_pretrained` around the weights: dtypes, tokenizer, generation defaults, options."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import generation_defaults, load_pretrained
from dew.sampling import Sampling
from tests.interop.conftest import save_checkpoint, torch, torch_model, transformers


@pytest.fixture(scope="module")
def bundle(llama_checkpoint):
    directory, _ = llama_checkpoint
    return load_pretrained(directory, max_seq_len=40)


def test_bundle_carries_tokenizer_config_and_defaults(bundle, llama_checkpoint):
    directory, _ = llama_checkpoint
    assert bundle.revision is None
    assert bundle.config["model_type"] == "llama"
    assert bundle.model.config.max_seq_len == 40  # overrides max_position_embeddings 64
    assert bundle.model.config.param_dtype == jnp.float32  # config.json says float32
    assert bundle.tokenizer.encode("w5 w17") == [5, 17]
    assert bundle.generation == Sampling(temperature=0.0, eos_token_ids=(2,), pad_id=2)


def test_text_generation_uses_the_tokenizer_and_stops_at_eos(bundle, llama_checkpoint):
    _, model = llama_checkpoint
    result = bundle.text_generation()("w5 w17 w3", 8)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([[5, 17, 3]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    eos = theirs.index(2) + 1 if 2 in theirs else len(theirs)
    assert result.continuations()[0] == theirs[:eos]
    assert result.text[0].startswith("w5 w17 w3")


def test_bf16_checkpoint_loads_in_its_own_dtype(tmp_path):
    model = torch_model("qwen3-qk-norm").to(torch.bfloat16)
    directory = save_checkpoint(model, tmp_path / "bf16")
    bundle = load_pretrained(directory)
    assert bundle.model.config.param_dtype == jnp.bfloat16
    assert bundle.variables["params"]["layers_0"]["self_attn"]["q_norm"]["scale"].dtype == jnp.bfloat16
    widened = load_pretrained(directory, param_dtype="float32")
    kernel = widened.variables["params"]["layers_1"]["mlp"]["up_proj"]["kernel"]
    expected = model.model.layers[1].mlp.up_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(np.asarray(kernel), expected)


def test_generation_config_maps_to_sampling():
    config = {"eos_token_id": 7, "pad_token_id": None}
    sampled, budget = generation_defaults(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "eos_token_id": [1, 4], "max_new_tokens": 12}, config)
    assert sampled == Sampling(temperature=0.7, top_k=50, top_p=0.9, eos_token_ids=(1, 4), pad_id=1)
    assert budget == 12
    greedy, budget = generation_defaults({"repetition_penalty": 1.3, "pad_token_id": 0}, config)
    assert greedy == Sampling(temperature=0.0, repetition_penalty=1.3, eos_token_ids=(7,), pad_id=0)
    assert budget is None
    with pytest.warns(UserWarning, match="'num_beams': 4"):
        generation_defaults({"num_beams": 4}, config)


def test_attention_impl_names_a_kernel_and_refuses_one_the_backend_cannot_run(llama_checkpoint):
    """An unknown name lists Dew's kernels; splash (TPU) and cuDNN (GPU) are refused on the CPU with the backend
    they need; a kernel the backend runs lands in the model's config, where its attention reads it."""
    with pytest.raises(ValueError, match="'flash' is not an attention kernel of Dew's.*'splash'"):
        load_pretrained(llama_checkpoint[0], attention_impl="flash")
    for impl, backend in (("splash", "TPU"), ("cudnn", "GPU")):
        with pytest.raises(ValueError, match=f"attention_impl: attention {impl!r} runs on a {backend}"):
            load_pretrained(llama_checkpoint[0], attention_impl=impl)
    assert load_pretrained(llama_checkpoint[0], attention_impl="xla").model.config.attention == "xla"


def test_pipeline_loads_a_published_checkpoint(bundle, llama_checkpoint):
    import dew

    task = dew.pipeline(llama_checkpoint[0], max_seq_len=40)
    assert task("w5 w17 w3", 6).tokens.tolist() == bundle.text_generation()("w5 w17 w3", 6).tokens.tolist()


def test_a_deep_checkpoint_loads_in_the_models_own_stacked_form(deep_llama_checkpoint, tmp_path):
    """Eight like layers scan as one run: the load fills `layers_0to7` directly, bit for bit the checkpoint's
    tensors transposed and stacked, and a save writes them back under their per-layer names, unchanged."""
    from safetensors import safe_open

    directory, _ = deep_llama_checkpoint
    bundle = load_pretrained(directory)
    params = bundle.variables["params"]
    assert sorted(params) == ["embed_tokens", "layers_0to7", "lm_head", "norm"]
    with safe_open(str(directory / "model.safetensors"), "numpy") as checkpoint:
        per_layer = {"params": {
            "embed_tokens": {"embedding": checkpoint.get_tensor("model.embed_tokens.weight")},
            "norm": {"scale": checkpoint.get_tensor("model.norm.weight")},
            "lm_head": {"kernel": checkpoint.get_tensor("lm_head.weight").T},
            **{f"layers_{i}": {
                "input_layernorm": {"scale": checkpoint.get_tensor(f"model.layers.{i}.input_layernorm.weight")},
                "post_attention_layernorm": {
                    "scale": checkpoint.get_tensor(f"model.layers.{i}.post_attention_layernorm.weight")},
                **{block: {proj: {"kernel": checkpoint.get_tensor(f"model.layers.{i}.{block}.{proj}.weight").T}
                           for proj in projections}
                   for block, projections in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                              ("mlp", ("gate_proj", "up_proj", "down_proj")))},
            } for i in range(8)},
        }}
        stacked = bundle.model.stack_variables(per_layer)
        assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(bundle.variables)
        for (path, ours), theirs in zip(jax.tree_util.tree_leaves_with_path(bundle.variables),
                                        jax.tree_util.tree_leaves(stacked)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=jax.tree_util.keystr(path))
        out = bundle.save(tmp_path / "export")
        with safe_open(str(out / "model.safetensors"), "numpy") as exported:
            assert sorted(exported.keys()) == sorted(checkpoint.keys())
            for name in checkpoint.keys():
                np.testing.assert_array_equal(exported.get_tensor(name), checkpoint.get_tensor(name), err_msg=name)


def test_scan_layers_and_remat_change_how_a_load_compiles_not_what_it_computes(deep_llama_checkpoint):
    directory = deep_llama_checkpoint[0]
    scanned = load_pretrained(directory, max_seq_len=40)
    unrolled = load_pretrained(directory, max_seq_len=40, scan_layers=0, remat="full")
    assert "layers_0to7" in scanned.variables["params"] and "layers_7" in unrolled.variables["params"]
    tokens = np.arange(1, 9, dtype=np.int32).reshape(1, 8)
    ours = np.asarray(scanned.model.apply(scanned.variables, tokens))
    theirs = np.asarray(unrolled.model.apply(unrolled.variables, tokens))
    # The same operations, fused differently inside a loop body, through 8 layers: 64 ulps of the largest
    # logit (4.0e-5 at 5.3; observed 1.4e-5).
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=64 * float(np.abs(theirs).max()) * np.finfo(np.float32).eps)


@pytest.mark.parametrize("generation", [
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 50, "top_p": 1.0},
    {"do_sample": False, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2},
    {"do_sample": True, "temperature": 0.7, "top_k": 20},
], ids=["unset", "neutral", "false", "sampling"])
def test_sampling_fields_without_do_sample_are_not_applied_and_said_so_as_in_transformers(generation):
    theirs = transformers.GenerationConfig(**generation)
    try:
        theirs.validate(strict=True)
        flagged = set()
    except ValueError as error:
        flagged = set(re.findall(r"- `(\w+)`: `do_sample` is not set to `True`", str(error)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampling, _ = generation_defaults(generation, {}, where="gen/generation_config.json")
    said = [str(warning.message) for warning in caught]
    assert sampling.greedy == (theirs.get_generation_mode() == "greedy_search")
    assert sampling.repetition_penalty == generation.get("repetition_penalty")  # applied either way, as there
    if flagged:
        (message,) = said
        listed = ", ".join(f"{name} {generation[name]!r}" for name in generation if name in flagged)
        assert message.startswith(f"gen/generation_config.json sets {listed} but not do_sample true, so, as in "
                                  "transformers, generation is greedy and they are not applied")
    else:
        assert said == []


@pytest.mark.parametrize("generation, says", [
    ({"do_sample": True, "temperature": "0.7"},
     " field 'temperature' = '0.7' is not a finite number (or null), as transformers' GenerationConfig declares it: "
     "write 0.7 without quotes"),
    ({"eos_token_id": "2"}, " field 'eos_token_id' = '2' is not a token id or a list of token ids (or null)"),
    ({"eos_token_id": [1, "2"]}, " field 'eos_token_id' = [1, '2'] is not a token id or a list of token ids"),
    ({"do_sample": "yes"}, " field 'do_sample' = 'yes' is not true or false (or null)"),
    ({"max_new_tokens": 0}, " field 'max_new_tokens' = 0 is not a positive integer (or null)"),
    ({"do_sample": True, "temperature": -1.0}, ": temperature is -1.0; use 0 for greedy or a positive value"),
], ids=["string-temperature", "string-eos", "string-in-eos-list", "string-do-sample", "no-tokens",
        "negative-temperature"])
def test_generation_config_values_of_the_wrong_kind_are_refused_naming_the_file(generation, says):
    with pytest.raises(ValueError, match=f"^gen/generation_config.json{re.escape(says)}"):
        generation_defaults(generation, {}, where="gen/generation_config.json")
