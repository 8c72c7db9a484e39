"""Config discipline: each family reads what its transformers class declares, and refuses the rest by name."""

from __future__ import annotations

import dataclasses

import pytest

from dew.interop.families import FAMILIES, decoder_kwargs
from dew.interop.hf_decoders import param_dtype_name
from dew.nn.rotary import RopeScaling
from tests.interop.conftest import sized, transformers

_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "ministral": "MinistralConfig", "qwen2": "Qwen2Config",
            "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
            "gemma3_text": "Gemma3TextConfig", "olmo2": "Olmo2Config", "olmo3": "Olmo3Config", "mixtral": "MixtralConfig",
            "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "mamba2": "Mamba2Config",
            "qwen3_next": "Qwen3NextConfig", "qwen3_5_text": "Qwen3_5TextConfig", "phi3": "Phi3Config",
            "smollm3": "SmolLM3Config", "granite": "GraniteConfig", "llama4_text": "Llama4TextConfig",
            "gemma4_text": "Gemma4TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
            "gemma3n_text": "Gemma3nTextConfig"}

SMOLLM2 = {  # SmolLM2-135M's config.json as published (transformers 4 spellings and nanotron leftovers)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
    "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152,
}


def test_families_cover_the_issue():
    # and the masked-diffusion families whose code is remote, not transformers' (tests/diffusion/test_checkpoints.py),
    # DiffusionGemma, which is no decoder family (tests/interop/test_diffusion_gemma.py), DeepSeek's,
    # whose configs carry fields of DeepSeek's own code beside transformers' (tests/interop/test_deepseek.py),
    # and the multimodal models around a text family: Gemma 3, Llama 4, Qwen 3.5 (dense and experts) and Gemma 3n
    # with images, Gemma 4 with images and audio (tests/interop/test_gemma3.py, tests/interop/test_llama4.py,
    # tests/interop/test_qwen35.py, tests/interop/test_gemma3n.py, tests/interop/test_gemma4.py)
    assert set(FAMILIES) == set(_CLASSES) | {"llada", "Dream", "diffusion_gemma", "deepseek_v2", "deepseek_v3",
                                             "deepseek_v32", "gemma3", "llama4", "qwen3_5", "qwen3_5_moe", "gemma4",
                                             "gemma3n"}


@pytest.mark.parametrize("model_type", sorted(_CLASSES))
def test_family_declares_what_transformers_declares(model_type):
    config_class = getattr(transformers, _CLASSES[model_type])
    base = {field.name for field in dataclasses.fields(transformers.PreTrainedConfig)}
    declared = {field.name: field.default for field in dataclasses.fields(config_class) if field.name not in base}
    assert dict(FAMILIES[model_type].fields) == declared
    # transformers' own serialisation of its default config reads like an empty config (the defaults).
    assert decoder_kwargs(config_class().to_dict()) == decoder_kwargs(sized(model_type))


def test_old_and_new_spellings_read_alike():
    new = {k: v for k, v in SMOLLM2.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new.update(rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, dtype="bfloat16")
    assert decoder_kwargs(SMOLLM2) == decoder_kwargs(new)
    assert decoder_kwargs(SMOLLM2)["rope_theta"] == 100000.0
    assert param_dtype_name(SMOLLM2) == param_dtype_name(new) == "bfloat16"
    assert param_dtype_name({"dtype": "float16", "torch_dtype": "float32"}) == "float16"  # dtype wins


GEMMA2_2B = {  # google/gemma-2-2b's config.json as published
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
}
GEMMA3_1B = {  # google/gemma-3-1b-pt's config.json as published
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}


@pytest.mark.parametrize("source", [GEMMA2_2B, GEMMA3_1B], ids=["gemma-2-2b", "gemma-3-1b"])
def test_published_gemma_configs_read_as_transformers_reads_them(source):
    config_class = {"gemma2": transformers.Gemma2Config, "gemma3_text": transformers.Gemma3TextConfig}
    resaved = config_class[source["model_type"]](**source).to_dict()  # transformers 5's own spelling of it
    assert decoder_kwargs(source) == decoder_kwargs(resaved)
    assert decoder_kwargs(source)["layer_types"][:6] == (
        ("sliding_attention", "full_attention") * 3 if source is GEMMA2_2B
        else ("sliding_attention",) * 5 + ("full_attention",))


def test_qwen25_inert_mrope_flag():
    qwen = {**sized("qwen2"), "use_mrope": False, "use_sliding_window": False, "sliding_window": 131072,
            "max_window_layers": 21, "rope_theta": 1000000.0}
    assert decoder_kwargs(qwen).get("sliding_window") is None
    with pytest.raises(ValueError, match="'use_mrope' = True"):
        decoder_kwargs({**qwen, "use_mrope": True})


@pytest.mark.parametrize("source, message", [
    ({**sized("llama"), "sliding_window": 4096}, "sliding_window 4096 but transformers' LlamaConfig attends to every key"),
    ({**sized("llama"), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "'rope_parameters' .* rope_type 'dynamic' is not built; Dew builds default, linear, llama3, yarn"),
    ({**sized("qwen2"), "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0],
                                                 "long_factor": [2.0]}},
     "rope_type 'longrope' is not built; Dew builds default, linear, llama3, yarn"),
    ({**sized("llama"), "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
     "'rope_parameters' .* low_freq_factor None and high_freq_factor None: both are needed"),
    ({**sized("llama"), "rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     "rope_type 'linear' reads \\['factor'\\], not \\['low_freq_factor'\\]"),
    ({**sized("llama"), "rope_scaling": {"type": "linear"}}, "rope_type 'linear' needs a factor"),
    ({**sized("llama"), "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rotates every feature of a head"),
    ({**sized("llama"), "partial_rotary_factor": 0.5}, "'partial_rotary_factor' = 0.5.*every feature"),
    ({**sized("llama"), "rope_parameters": {"full_attention": {"rope_type": "default"}}},
     "transformers' LlamaConfig gives every layer one rotary setting"),
    ({**sized("olmo3"), "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "transformers' Olmo3Config reads one setting per layer type and ignores a flat one"),
    ({**sized("olmo3"), "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": False}},
     "always truncates in a per-layer-type one"),
    ({**sized("gemma3_text"), "sliding_window": None}, "'sliding_window' = None .* sliding layers rotate with"),
    ({**sized("llama"), "hidden_act": "relu"}, "'hidden_act' = 'relu'.*activations Dew has"),
    ({**sized("llama"), "mup_scale": 2.0}, "field 'mup_scale' = 2.0 is not a field of transformers' LlamaConfig"),
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox', which is not a Dew family: native families are"),
    ({"hidden_size": 32}, "no model_type"),
    ({**sized("llama"), "quantization": {"group_size": 64, "bits": 4}}, "MLX-quantized"),
    ({**sized("gemma2"), "use_bidirectional_attention": True}, "bidirectional Gemma"),
])
def test_refusals_name_the_field(source, message):
    with pytest.raises(ValueError, match=message):
        decoder_kwargs(source)


def test_window_read_only_where_the_family_applies_it():
    assert decoder_kwargs({**sized("llama"), "sliding_window": None}).get("sliding_window") is None
    assert decoder_kwargs({**sized("mistral"), "sliding_window": 7})["sliding_window"] == 7
    assert decoder_kwargs({**sized("mistral"), "sliding_window": None})["sliding_window"] is None


def test_gemma_legacy_gelu_is_the_tanh_form():
    assert decoder_kwargs({**sized("gemma"), "hidden_act": "gelu"})["activation"] == "gelu_tanh"


def test_gemma3_legacy_rotary_and_pattern():
    kwargs = decoder_kwargs({**sized("gemma3_text"), "num_hidden_layers": 4, "rope_theta": 1e6,
                             "rope_local_base_freq": 1e4, "sliding_window_pattern": 2})
    assert kwargs["layer_types"] == ("sliding_attention", "full_attention") * 2
    assert (kwargs["rope_theta"], kwargs["local_rope_theta"]) == (1e6, 1e4)


# The rotary scalings of published configs (Llama 3.2, Qwen3's long-context recipe, Gemma 3 4B, OLMo 3) and
# a DeepSeek-style YaRN that leaves the factor to the lengths.
UNSCALED = RopeScaling()


@pytest.mark.parametrize("source, full, sliding", [
    ({**sized("llama"), "max_position_embeddings": 131072, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
     RopeScaling("llama3", 32.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0), None),
    ({**sized("qwen3"), "max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     RopeScaling("yarn", 4.0, 32768), None),
    ({**sized("llama"), "max_position_embeddings": 163840,
      "rope_parameters": {"type": "yarn", "factor": None, "original_max_position_embeddings": 4096, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
     RopeScaling("yarn", 40.0, 4096, mscale=1.0, mscale_all_dim=1.0), None),
    ({**sized("llama"), "rope_scaling": {"type": "linear", "factor": 2.0}}, RopeScaling("linear", 2.0), None),
    ({**sized("gemma3_text"), "num_hidden_layers": 6, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
     RopeScaling("linear", 8.0), UNSCALED),
    ({**sized("olmo3"), "num_hidden_layers": 4, "max_position_embeddings": 65536,
      "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                       "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1}},
     RopeScaling("yarn", 8.0, 8192, attention_factor=1.2079441541679836), UNSCALED),
], ids=["llama-3.2", "qwen3-yarn", "deepseek-style-yarn", "llama-linear", "gemma-3-4b", "olmo-3"])
def test_rotary_scalings_read_as_transformers_resolves_them(source, full, sliding):
    kwargs = decoder_kwargs(source)
    assert kwargs["rope_scaling"] == full
    assert kwargs.get("local_rope_scaling") == sliding  # Gemma 3 and OLMo 3 scale only their full layers
    resaved = getattr(transformers, _CLASSES[source["model_type"]])(**source).to_dict()
    assert decoder_kwargs(resaved) == kwargs


def test_olmo3_older_rope_theta_is_the_full_layers_only():
    # transformers' Olmo3Config gives sliding layers its default 500000 whatever the older rope_theta says.
    kwargs = decoder_kwargs({**sized("olmo3"), "num_hidden_layers": 4, "rope_theta": 1000.0})
    assert (kwargs["rope_theta"], kwargs["local_rope_theta"]) == (1000.0, 500000.0)
    resaved = transformers.Olmo3Config(num_hidden_layers=4, rope_theta=1000.0).to_dict()
    assert decoder_kwargs(resaved) == kwargs


def test_tensor_names():
    """The shared decoder rules name Dew's parameters as transformers does, per layer and in a stacked run."""
    import jax
    import numpy as np

    from dew.interop import tensors
    from dew.interop.families.llama import DECODER_RULES

    leaf = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
    params = {"embed_tokens": {"embedding": leaf(97, 32)}, "norm": {"scale": leaf(32)},
              "lm_head": {"kernel": leaf(32, 97)}, "layers_3": {"self_attn": {"q_proj": {"bias": leaf(16)}}},
              "layers_0to2": {"self_attn": {"q_proj": {"kernel": leaf(3, 32, 16)}}}}
    plan = tensors.plan(DECODER_RULES, params)
    assert plan.tensors == {
        "lm_head.weight": (97, 32), "model.embed_tokens.weight": (97, 32),
        **{f"model.layers.{i}.self_attn.q_proj.weight": (16, 32) for i in range(3)},
        "model.layers.3.self_attn.q_proj.bias": (16,), "model.norm.weight": (32,),
    }
    assert list(plan.tensors)[2:5] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)]
