"""Fields transformers' modeling code reads without its config class declaring them (`head_dim` for Qwen2,
OLMo 2 and OLMo 3; the mask code's `is_causal` for every family), and the fields that change nothing."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from huggingface_hub.errors import StrictDataclassFieldValidationError

from dew.interop import load_pretrained
from dew.interop.families import FAMILIES, decoder_kwargs
from dew.interop.hf_decoders import FIELD_KINDS, expected, reference_sizes
from tests.interop.conftest import SHAPE, save_checkpoint, sized, torch, torch_model, transformers

# The transformers module that holds each family's modeling code.
_MODULES = {"gemma3_text": "gemma3", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "llama4_text": "llama4",
            "gemma4_text": "gemma4", "gemma3n_text": "gemma3n"}
_GETATTR = re.compile(r"getattr\((?:self\.)?config,\s*\"(\w+)\"")
# Families whose modeling code reads every config field by attribute (the pattern finds nothing there).
_NO_GETATTR = {"mamba2"}

# fp32 on both sides. A logit is the end of about ten chained stages (embedding, per layer a norm, attention
# with 16-wide heads over at most 12 keys and a width-48 MLP, the final norm and the head), each a sum of at
# most 64 products that XLA and torch round in different orders: a relative drift of at most
# 64 * eps_fp32 (7.6e-6) of the largest logit (5.6-7.5 here), so 4.3e-5 to 5.7e-5. Largest differences
# observed on an AMD EPYC with AVX-512, head_dim 16 / head_dim 8: qwen2-bias-window 4.8e-6 / 6.9e-6,
# olmo2 5.0e-6 / 5.3e-6, olmo3-window 3.6e-6 / 4.5e-6.
RELATIVE_TOLERANCE = 64 * np.finfo(np.float32).eps
# The families transformers has modeling code for (LLaDA and Dream ship theirs as remote code: tests/diffusion).
# DiffusionGemma is not a decoder family: tests/interop/test_diffusion_gemma.py reads its fields; nor is Gemma 3
# with images, whose decoder is gemma3_text's and whose own fields tests/interop/test_gemma3.py reads.
TRANSFORMERS_FAMILIES = sorted(name for name, family in FAMILIES.items()
                               if not getattr(family, "multimodal", False)
                               and hasattr(transformers, family.config_class) and name != "diffusion_gemma")
TOKENS = np.random.default_rng(5).integers(0, SHAPE["vocab_size"], (2, 12))
DEFAULT_HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]  # 8


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_every_field_the_modeling_code_reads_with_getattr_is_read(model_type):
    module = _MODULES.get(model_type, model_type)
    source = Path(importlib.import_module(f"transformers.models.{module}.modeling_{module}").__file__).read_text()
    read = set(_GETATTR.findall(source))
    assert bool(read) != (model_type in _NO_GETATTR), module  # the pattern still finds transformers' reads
    assert {name for name in read if not FAMILIES[model_type].reads(name)} == set()


@pytest.mark.parametrize("case", ["qwen2-bias-window", "olmo2", "olmo3-window"])
@pytest.mark.parametrize("head_dim", [16, DEFAULT_HEAD_DIM])
def test_head_dim_read_with_getattr_matches_transformers(case, head_dim, tmp_path):
    model = torch_model(case, head_dim=head_dim)
    directory = save_checkpoint(model, tmp_path / case)
    config = json.loads((directory / "config.json").read_text())
    assert config["head_dim"] == head_dim  # transformers keeps the undeclared field and writes it back
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == SHAPE["num_attention_heads"] * head_dim
    if head_dim == DEFAULT_HEAD_DIM:
        assert decoder_kwargs(config) == decoder_kwargs({k: v for k, v in config.items() if k != "head_dim"})
    bundle = load_pretrained(directory)
    assert bundle.model.config.head_dim == head_dim
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    largest = np.abs(theirs).max()
    assert largest > 2.0  # order-one weights: a wrong head layout shows
    np.testing.assert_allclose(ours, theirs, atol=RELATIVE_TOLERANCE * largest, rtol=0, err_msg=case)


@pytest.mark.parametrize("model_type", ["qwen2", "olmo2", "olmo3"])
def test_head_dim_null_reads_as_the_default(model_type):
    # transformers' rotary code reads `getattr(config, "head_dim", None) or hidden_size // num_attention_heads`
    assert decoder_kwargs({**sized(model_type), "head_dim": None}) == decoder_kwargs(sized(model_type))


# Families whose transformers defaults do not make a model transformers runs, and the field that completes one.
_COMPLETING = {"deepseek_v2": {"num_experts_per_tok": 2}}  # its MoE layers pick top-None experts by default


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_is_causal_true_loads_and_false_is_refused(model_type):
    plain = {**sized(model_type), **_COMPLETING.get(model_type, {})}
    assert decoder_kwargs({**plain, "is_causal": True}) == decoder_kwargs(plain)
    with pytest.raises(ValueError, match=r"'is_causal' = False .* bidirectional encoder\) is not built"):
        decoder_kwargs({**plain, "is_causal": False})


# Fields published configs carry that change no computation, each with a value seen on the Hub.
METADATA = {
    "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.Custom"},
    "tokenizer_class": "LlamaTokenizer",
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "custom_pipelines": {"text-generation": {"impl": "pipeline_custom.Pipeline", "pt": ["AutoModelForCausalLM"]}},
    "unsloth_version": "2024.9", "unsloth_fixed": True,
    "_attn_implementation_autoset": True, "gradient_checkpointing": False, "is_decoder": True,
    "torchscript": False, "use_bfloat16": False, "finetuning_task": None, "prefix": None,
    "pruned_heads": {}, "pretraining_tp": 1,
}


@pytest.mark.parametrize("name", sorted(METADATA))
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_metadata_fields_change_nothing(model_type, name):
    plain = sized(model_type)
    assert decoder_kwargs({**plain, name: METADATA[name]}) == decoder_kwargs(plain)


def test_published_config_with_metadata_loads_and_computes_the_same(llama_checkpoint, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(llama_checkpoint[0], directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **METADATA, "max_window_layers": 28,
                                                       "use_sliding_window": False, "attention_dropout": 0.1}))
    bundle, plain = load_pretrained(directory), load_pretrained(llama_checkpoint[0])
    assert bundle.model.config.attention_dropout == 0.1
    tokens = jnp.asarray(TOKENS, jnp.int32)
    np.testing.assert_array_equal(np.asarray(bundle.model.apply(bundle.variables, tokens)),
                                  np.asarray(plain.model.apply(plain.variables, tokens)))
    assert bundle.text_generation()([[5, 17, 3]], 4).tokens.shape == (1, 7)


@pytest.mark.parametrize("source", [
    {**sized("llama"), "max_window_layers": 28},
    {**sized("llama"), "max_window_layers": 28, "use_sliding_window": False, "sliding_window": None},
    {**sized("qwen2"), "max_window_layers": 21, "use_sliding_window": False, "sliding_window": 131072},
    {**sized("mistral"), "max_window_layers": 28, "sliding_window": None},
    {**sized("gemma"), "use_sliding_window": False},
], ids=["llama", "llama-window-off", "qwen2-window-off", "mistral-no-window", "gemma-window-off"])
def test_qwen_window_switches_load_where_no_window_is_in_effect(source):
    kwargs = decoder_kwargs(source)
    assert kwargs.get("sliding_window") is None
    plain = {k: v for k, v in source.items() if k not in ("max_window_layers", "use_sliding_window")}
    if source["model_type"] != "qwen2":
        assert kwargs == decoder_kwargs(plain)


@pytest.mark.parametrize("source, message", [
    ({**sized("mistral"), "max_window_layers": 28, "sliding_window": 4096},
     r"'max_window_layers' = 28 is Qwen's window switch, which transformers' MistralConfig never reads: it windows "
     r"every sliding layer at 4096"),
    ({**sized("ministral"), "use_sliding_window": False},
     r"'use_sliding_window' = False .* MinistralConfig never reads: it windows every sliding layer at 4096"),
    ({**sized("llama"), "use_sliding_window": True}, r"'use_sliding_window' = True .* it applies no window"),
    ({**sized("llama"), "attention_chunk_size": 8192}, r"'attention_chunk_size' = 8192 is not a field"),
    ({**sized("llama"), "per_layer_config": {"0": {"intermediate_size": 8}}}, r"'per_layer_config' = .* not a field"),
    ({**sized("llama"), "pruned_heads": {"0": [1]}}, r"'pruned_heads' = \{'0': \[1\]\} is not a field"),
    ({**sized("llama"), "use_mrope": True}, r"'use_mrope' = True is not a field"),
])
def test_computational_fields_are_still_refused_by_name(source, message):
    with pytest.raises(ValueError, match=message):
        decoder_kwargs(source)


def test_attention_dropout_loads_for_inference_and_saves_back(tmp_path):
    """transformers applies attention dropout only in training mode: an eval model with rate 0.1 computes
    what Dew's inference computes (same fp32 bound as the head_dim tests)."""
    model = torch_model("llama", attention_dropout=0.1)
    directory = save_checkpoint(model, tmp_path / "dropout")
    bundle = load_pretrained(directory)
    assert bundle.model.config.attention_dropout == 0.1
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=RELATIVE_TOLERANCE * np.abs(theirs).max(), rtol=0)
    again = load_pretrained(bundle.save(tmp_path / "export"))
    assert again.config["attention_dropout"] == 0.1 and again.model.config.attention_dropout == 0.1


# ---- values of the wrong kind, and the fields a config must name ---------------------------------------------

# One value of each JSON kind, inside every range transformers checks (initializer_range's [0, 1]).
PROBES = [None, True, 1, 0.5, "1", ["a"], [1], {"rope_type": "default"}]


def _transformers_accepts(config_class, name: str, value) -> bool:
    """Whether the strict config class takes `value` for `name` (it validates each field's type on assignment)."""
    try:
        config_class(**{name: value})
    except StrictDataclassFieldValidationError as error:
        return f"'{name}'" not in str(error)
    except Exception:  # noqa: BLE001 - a later check of the whole config: the value's type was taken
        return True
    return True


def test_every_field_a_family_reads_has_a_kind():
    # DiffusionGemma reads its fields itself (tests/interop/test_diffusion_gemma.py), and Gemma 3 with images
    # through gemma3_text's family and its tower's reader (tests/interop/test_gemma3.py)
    read = {name for model_type, family in FAMILIES.items()
            if model_type != "diffusion_gemma" and not getattr(family, "multimodal", False)
            for name in (*family.fields, *family.getattr_fields)}
    assert read - set(FIELD_KINDS) == set()


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_field_kinds_take_what_transformers_takes_and_refuse_what_it_refuses(model_type):
    family = FAMILIES[model_type]
    config_class = getattr(transformers, family.config_class)
    declared = {field.name for field in dataclasses.fields(config_class)}
    for name, default in family.fields.items():
        if default is None:  # read as the architecture's rule (head_dim from hidden_size, ...)
            assert family.field_kind(name).endswith("?"), name
        if name not in declared:  # DeepSeek's own code's fields: transformers takes any value
            continue
        for probe in PROBES:
            theirs = _transformers_accepts(config_class, name, probe)
            ours = expected(family.field_kind(name), probe) is None
            if theirs:
                assert ours, (name, probe)
            # a null Dew reads as transformers' default, and an integer where a float is declared (JSON writers
            # drop ".0"), are the only values Dew takes and transformers does not
            elif probe is not None and not (type(probe) is int and _transformers_accepts(config_class, name, 0.5)):
                assert not ours, (name, probe)


@pytest.mark.parametrize("model_type", TRANSFORMERS_FAMILIES)
def test_a_shape_field_left_out_is_refused_unless_transformers_derives_it(model_type):
    complete = sized(model_type, **_COMPLETING.get(model_type, {}))
    decoder_kwargs(complete)
    required = reference_sizes(FAMILIES[model_type].fields)
    heads = "num_heads" if model_type == "mamba2" else "num_attention_heads"
    assert {"vocab_size", "hidden_size", "num_hidden_layers", heads} <= set(required)
    for name in required:
        with pytest.raises(ValueError, match=rf"config.json has no '{name}', which fixes the shape of the weights: "
                                             rf"transformers' \w+ would take {required[name]}, its reference model's"):
            decoder_kwargs({key: value for key, value in complete.items() if key != name})
    # a default transformers derives is read as it derives it: head_dim, and Llama's key/value heads
    assert decoder_kwargs(sized("llama", hidden_size=64, num_attention_heads=4))["head_dim"] == 16
    assert decoder_kwargs(sized("llama", num_attention_heads=4))["num_kv_heads"] == 4


def test_mixtral_names_its_expert_count_either_way():
    complete = sized("mixtral")
    alias = {**{key: value for key, value in complete.items() if key != "num_local_experts"}, "num_experts": 4}
    assert decoder_kwargs(alias)["mixture"].experts == 4


@pytest.mark.parametrize("edit, says", [
    (lambda config: config.pop("hidden_size"),
     "has no 'hidden_size', which fixes the shape of the weights: transformers' LlamaConfig would take 4096, its "
     "reference model's, which these weights need not have; add the hidden_size this checkpoint was trained with"),
    (lambda config: config.update(hidden_size="32"),
     "field 'hidden_size' = '32' is not a positive integer, as transformers' LlamaConfig declares it: write 32 "
     "without quotes"),
    (lambda config: config.update(rms_norm_eps="1e-6"),
     "field 'rms_norm_eps' = '1e-6' is not a finite number, as transformers' LlamaConfig declares it: write 1e-6 "
     "without quotes"),
    (lambda config: config.update(num_hidden_layers=2.0),
     "field 'num_hidden_layers' = 2.0 is not a positive integer, as transformers' LlamaConfig declares it: write the "
     "value the model was trained with"),
    (lambda config: config.update(tie_word_embeddings="false"),
     "field 'tie_word_embeddings' = 'false' is not true or false, as transformers' LlamaConfig declares it: write "
     "false without quotes"),
    (lambda config: config.update(num_key_value_heads=0),
     "field 'num_key_value_heads' = 0 is not a positive integer \\(or null\\)"),
    (lambda config: config.update(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
     "field 'rope_parameters' = .* its rope_theta must be a finite number"),
], ids=["missing", "string-size", "string-eps", "float-size", "string-bool", "zero-heads", "string-theta"])
def test_a_config_json_that_lies_is_refused_naming_file_field_value_and_expectation(edit, says, llama_checkpoint,
                                                                                   tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(llama_checkpoint[0], directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^{re.escape(str(directory / 'config.json'))} .*{says}"):
        load_pretrained(directory)


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "holds a JSON array, not an object of fields"),
    ('{"model_type": "llama", ', "is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
    (b'{"model_type": "ll\xffama"}', "is not UTF-8 text (invalid start byte at byte 18)"),
], ids=["list", "truncated", "not-utf-8"])
def test_a_config_json_that_is_no_object_of_fields_is_refused_by_name(text, says, llama_checkpoint, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(llama_checkpoint[0], directory)
    for name in ("config.json", "generation_config.json"):
        original = (directory / name).read_bytes()
        (directory / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match=re.escape(f"{directory / name} {says}")):
            load_pretrained(directory)
        (directory / name).write_bytes(original)
