"""Mamba2 as llama.cpp's `mamba2` GGUF: a tiny transformers Mamba2 written by Dew and read back by Dew and by the gguf
package's reader, and a file written here the way llama.cpp's converter writes one (with the gguf package alone,
from transformers' state dict, independently of Dew's writer) read by Dew against transformers.

The facts the llama.cpp-style file follows are llama.cpp's: conversion/mamba.py's Mamba2Model (once in
convert_hf_to_gguf.py) for names, transforms and metadata, src/models/mamba2.cpp for the shapes its loader needs,
and convert_hf_to_gguf.py's rule for the tensors kept in float32."""

from __future__ import annotations

import copy
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from tests.compiled import compiled
from tests.interop.conftest import save_checkpoint, torch
from tests.interop.test_mamba2 import bound, torch_mamba2
from tests.tolerances import assert_within, ulp_bound

gguf = pytest.importorskip("gguf")
Q8_0, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32

# Printable ASCII in GPT-2's byte alphabet, one merge and two control tokens, padded to a multiple of 16 as
# llama.cpp's converter pads a Mamba2's vocabulary list (`[PADn]`, unused); the embedding has as many rows.
TOKENS = [chr(b) for b in range(33, 127)] + ["Hi", "<s>", "</s>"]
VOCAB = 112
PADDED = TOKENS + [f"[PAD{i}]" for i in range(len(TOKENS), VOCAB)]
TOKEN_TYPES = [1] * 95 + [3, 3] + [5] * (VOCAB - len(TOKENS))
IDS = np.random.default_rng(7).integers(3, 97, (2, 13))
# One chunk for the whole sequence on both sides: a GGUF file names no chunk size, and Dew reads transformers' 256.
CHUNK = 256


def tiny(**overrides):
    return torch_mamba2(vocab_size=VOCAB, chunk_size=CHUNK, **overrides)


def write_bpe_tokenizer(directory) -> None:
    """A byte-level BPE tokenizer.json over the first 97 `TOKENS`, `<s>` and `</s>` special."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(models.BPE({token: i for i, token in enumerate(TOKENS[:95])}, [("H", "i")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def llama_cpp_gguf(model, path, quantized: bool = False):
    """`model` as llama.cpp's converter writes a Mamba2: A_log as A = -exp(A_log) (in torch, in the checkpoint's
    float32) and D as [H, 1], both named without ".weight"; dt_bias as ssm_dt.bias; the convolution squeezed to
    [C, K]; the gated norm's scale as [n_groups, I / n_groups]; no output.weight for a tied head. With `quantized`,
    the matrices llama.cpp quantizes (".weight", 2-D, neither a norm nor the convolution) are Q8_0."""
    config = model.config
    inner, groups, layers = config.num_heads * config.head_dim, config.n_groups, config.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), "mamba2")
    writer.add_context_length(2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(layers)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(config.state_size)
    writer.add_ssm_time_step_rank(inner // config.head_dim)
    writer.add_ssm_group_count(groups)
    writer.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    writer.add_file_type(7 if quantized else 0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(PADDED)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(["H i"])
    writer.add_bos_token_id(95)
    writer.add_eos_token_id(96)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    written = {"token_embd.weight": state["backbone.embeddings.weight"],
               "output_norm.weight": state["backbone.norm_f.weight"]}
    if not config.tie_word_embeddings:
        written["output.weight"] = state["lm_head.weight"]
    for i in range(layers):
        mixer = lambda name: state[f"backbone.layers.{i}.mixer.{name}"]  # noqa: B023 (used at once)
        written.update({
            f"blk.{i}.attn_norm.weight": state[f"backbone.layers.{i}.norm.weight"],
            f"blk.{i}.ssm_in.weight": mixer("in_proj.weight"), f"blk.{i}.ssm_out.weight": mixer("out_proj.weight"),
            f"blk.{i}.ssm_conv1d.weight": mixer("conv1d.weight").squeeze(),
            f"blk.{i}.ssm_conv1d.bias": mixer("conv1d.bias"), f"blk.{i}.ssm_dt.bias": mixer("dt_bias"),
            f"blk.{i}.ssm_a": (-torch.exp(mixer("A_log"))).reshape(-1, 1), f"blk.{i}.ssm_d": mixer("D").reshape(-1, 1),
            f"blk.{i}.ssm_norm.weight": mixer("norm.weight").reshape(groups, inner // groups),
        })
    for name, tensor in written.items():
        array = tensor.float().numpy()
        if quantized and array.ndim == 2 and name.endswith(".weight") and "norm" not in name and "conv1d" not in name:
            writer.add_tensor(name, gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized(model):
    """`model` with the weights `llama_cpp_gguf(quantized=True)` stores as Q8_0 put through Q8_0 and back."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("in_proj.weight", "out_proj.weight", "embeddings.weight", "lm_head.weight")):
                values = gguf.quants.quantize(parameter.numpy(), Q8_0)
                parameter.copy_(torch.from_numpy(gguf.quants.dequantize(values, Q8_0).reshape(parameter.shape)))
    return model


def logits(bundle, ids=IDS) -> np.ndarray:
    return np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(ids, jnp.int32)))


def fields(path) -> dict:
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


def tensors_of(path) -> dict:
    """Each tensor's (ggml shape, type, values as float32 in numpy's order)."""
    return {t.name: (tuple(int(n) for n in t.shape), t.tensor_type,
                     np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
            for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(transformers model, Dew's load of its safetensors checkpoint with a BPE tokenizer)."""
    model = tiny()
    directory = save_checkpoint(model, tmp_path_factory.mktemp("mamba2"))
    write_bpe_tokenizer(directory)
    return model, load_pretrained(directory)


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """Dew's f32 export of the model and Dew's load of it."""
    path = source[1].save(tmp_path_factory.mktemp("out") / "tiny.f32.gguf", format="gguf", outtype="f32")
    return path, load_pretrained(path.parent, gguf_file=path.name)


def test_f32_export_reads_back_as_the_model(source, exported):
    """Every weight comes back bit for bit but A_log, which the file holds as A = -exp(A_log): float32 A_log -> A ->
    A_log is exact for |A_log| >= 1 and within 2^-24 + half an ulp of A_log below (the family's comment says why).
    With those A_log values the two loads compute the same logits bit for bit; against the source's own, each decay
    exponent's terms move by at most 2 ulps more, counted on top of the fp32 parity bound (observed: 0.0 of logits
    up to 6.0 here)."""
    model, bundle = source
    _, back = exported
    assert back.model.config.recurrent == bundle.model.config.recurrent
    ours, theirs = back.variables["params"], bundle.variables["params"]
    for scope in ours:
        if not scope.startswith("layers"):
            continue
        a_log, source_a_log = (np.asarray(tree[scope]["self_attn"]["A_log"]) for tree in (ours, theirs))
        spacing = np.spacing(np.abs(source_a_log))
        assert_within(a_log, source_a_log, 2.0**-24 + spacing / 2, "A_log")
        exact = np.abs(source_a_log) >= 1
        np.testing.assert_array_equal(a_log[exact], source_a_log[exact])
    # the source with the file's A_log: every other weight and the program are the same
    with_file_a = copy.deepcopy(bundle.variables)
    for scope in ours:
        if scope.startswith("layers"):
            with_file_a["params"][scope]["self_attn"]["A_log"] = ours[scope]["self_attn"]["A_log"]
    np.testing.assert_array_equal(logits(back), np.asarray(compiled(bundle.model.apply, with_file_a,
                                                                          jnp.asarray(IDS, jnp.int32))))
    reference = logits(bundle)
    magnitude = float(np.abs(reference).max())
    assert_within(logits(back), reference, bound(model.config, IDS.shape[1], magnitude)
                  + ulp_bound(2 * IDS.shape[1] * model.config.num_hidden_layers, magnitude), "logits")
    assert back.tokenizer.encode("Hi!<s>") == [94, 0, 95]


def test_dew_writes_what_llama_cpps_converter_writes(source, exported, tmp_path):
    """The gguf package's reader finds in Dew's file the names, ggml shapes, types and metadata llama.cpp's converter
    writes and its loader needs (src/models/mamba2.cpp), and the values of the file written here independently:
    equal but A, which torch's float32 exp and Dew's float64 one rounded once may put an ulp apart."""
    model, _ = source
    path, _ = exported
    c = model.config
    E, I, H, G, N, K = c.hidden_size, c.num_heads * c.head_dim, c.num_heads, c.n_groups, c.state_size, c.conv_kernel
    written = fields(path)
    assert written["general.architecture"] == "mamba2" and written["general.file_type"] == 0
    assert {key: value for key, value in written.items() if key.startswith("mamba2.")} == pytest.approx({
        "mamba2.context_length": 2**20, "mamba2.embedding_length": E, "mamba2.feed_forward_length": 0,
        "mamba2.attention.head_count": 0, "mamba2.block_count": 2, "mamba2.ssm.conv_kernel": K,
        "mamba2.ssm.inner_size": I, "mamba2.ssm.state_size": N, "mamba2.ssm.time_step_rank": H,
        "mamba2.ssm.group_count": G, "mamba2.attention.layer_norm_rms_epsilon": c.layer_norm_epsilon})
    assert written["tokenizer.ggml.tokens"] == PADDED and written["tokenizer.ggml.token_type"] == TOKEN_TYPES
    ours = tensors_of(path)
    ggml_shapes = {"token_embd.weight": (E, VOCAB), "output.weight": (E, VOCAB), "output_norm.weight": (E,),
                   **{f"blk.{i}.{name}": shape for i in range(2) for name, shape in {
                       "attn_norm.weight": (E,), "ssm_in.weight": (E, 2 * I + 2 * G * N + H),
                       "ssm_conv1d.weight": (K, I + 2 * G * N), "ssm_conv1d.bias": (I + 2 * G * N,),
                       "ssm_dt.bias": (H,), "ssm_a": (1, H), "ssm_d": (1, H), "ssm_norm.weight": (I // G, G),
                       "ssm_out.weight": (I, E)}.items()}}
    assert {name: shape for name, (shape, _, _) in ours.items()} == ggml_shapes
    theirs = tensors_of(llama_cpp_gguf(model, tmp_path / "llama_cpp.gguf"))
    assert list(ours) == sorted(theirs, key=list(ours).index)
    for name, (shape, kind, values) in theirs.items():
        assert ours[name][:2] == (shape, kind) == (shape, F32), name
        if name.endswith("ssm_a"):
            assert_within(ours[name][2], values, np.spacing(np.abs(values)), name)
        else:
            np.testing.assert_array_equal(ours[name][2], values, err_msg=name)


def test_f16_export_keeps_llama_cpps_float32_tensors_and_is_within_half_precision(source, tmp_path):
    _, bundle = source
    path = bundle.save(tmp_path / "tiny.f16.gguf", format="gguf", outtype="f16")
    halves = {name for name, (_, kind, _) in tensors_of(path).items() if kind == F16}
    assert halves == {"token_embd.weight", "output.weight", *(f"blk.{i}.ssm_{part}.weight" for i in range(2)
                                                              for part in ("in", "out"))}
    back, reference = logits(load_pretrained(tmp_path, gguf_file=path.name)), logits(bundle)
    # Rounding to float16 moves each weight by at most 2^-11 of itself. To first order a logit moves by at most that
    # share of the sum of its terms' magnitudes in every product on its path: per layer in_proj's x, B, C, gate and
    # time step, the time step again through the decays, and out_proj; 2 layers, the embedding and the head, 16 in
    # all, so by 16 * 2^-11 of the logits' scale; twice that for the norms between them. Observed: 1.6e-3 * max|logit|.
    np.testing.assert_allclose(back, reference, rtol=0, atol=2 * 16 * 2.0**-11 * np.abs(reference).max())


@pytest.mark.parametrize("quantized, tied", [(False, False), (True, True)], ids=["f32", "q8_0-tied"])
def test_a_file_written_as_llama_cpp_writes_it_reads_as_transformers(quantized, tied, tmp_path):
    """Dew's load of the independent file against transformers' model of the same weights (Q8_0's dequantized ones
    where the file quantizes), fp32, at 13 tokens: the parity bound, plus A's extra rounding as above (bound 1.9e-4
    of logits up to 6.0; observed 4.4e-6 in both cases)."""
    model = tiny(tie_word_embeddings=tied)
    path = llama_cpp_gguf(model, tmp_path / "tiny.gguf", quantized)
    bundle = load_pretrained(tmp_path, gguf_file=path.name)
    assert bundle.model.config.tie_embeddings == tied and bundle.model.config.recurrent.n_groups == 2
    oracle = dequantized(model) if quantized else model
    with torch.no_grad():
        theirs = oracle(torch.from_numpy(IDS)).logits.numpy()
    magnitude = float(np.abs(theirs).max())
    assert magnitude > 2.0
    assert_within(logits(bundle), theirs, bound(model.config, IDS.shape[1], magnitude)
                  + ulp_bound(2 * IDS.shape[1] * model.config.num_hidden_layers, magnitude), "logits")
    assert bundle.tokenizer.encode("Hi!<s>") == [94, 0, 95]


def test_a_model_llama_cpp_does_not_compute_is_refused(source, tmp_path):
    _, bundle = source
    config = bundle.model.config
    biased = dataclasses.replace(config, recurrent=dataclasses.replace(config.recurrent, use_bias=True))
    variables = copy.deepcopy(bundle.variables)
    for scope, layer in variables["params"].items():
        for projection in ("in_proj", "out_proj") if scope.startswith("layers") else ():
            kernel = layer["self_attn"][projection]["kernel"]
            layer["self_attn"][projection]["bias"] = jnp.zeros((*kernel.shape[:-2], kernel.shape[-1]))
    with pytest.raises(ValueError, match=r"biases on in_proj and out_proj \(use_bias\), which llama.cpp's mamba2"):
        dataclasses.replace(bundle, model=type(bundle.model)(biased), variables=variables).save(
            tmp_path / "b.gguf", format="gguf")
    clamped = dataclasses.replace(config, recurrent=dataclasses.replace(config.recurrent, time_step_limit=(0.0, 5.0)))
    with pytest.raises(ValueError, match=r"would compute another one: layer 0 shape.time_step_limit \(0.0, 5.0\) "
                                         r"\(it computes \(0.0, None\)\) \(read back"):
        dataclasses.replace(bundle, model=type(bundle.model)(clamped)).save(tmp_path / "c.gguf", format="gguf")
    assert not list(tmp_path.iterdir())


def test_a_chunked_model_at_a_shorter_context_exports(tmp_path):
    """Neither the chunk size nor a context Dew was asked to stop at is in the file: both leave the model as it is."""
    directory = save_checkpoint(torch_mamba2(vocab_size=VOCAB), tmp_path / "source")  # chunk 8
    write_bpe_tokenizer(directory)
    bundle = load_pretrained(directory, max_seq_len=64)
    path = bundle.save(tmp_path / "out" / "tiny.gguf", format="gguf", outtype="f32")
    back = load_pretrained(path.parent, gguf_file=path.name)
    assert back.model.config.recurrent.chunk_size == CHUNK and bundle.model.config.recurrent.chunk_size == 8


def test_a_stored_a_that_is_not_negative_is_refused(tmp_path):
    model = tiny()
    with torch.no_grad():
        model.backbone.layers[1].mixer.A_log[3] = float("-inf")  # A = -exp(-inf) = -0.0, which no A_log gives
    path = llama_cpp_gguf(model, tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match=r"tensor 'blk.1.ssm_a' holds -0.0 at position 3 \(1 of its 8 values are not "
                                         r"negative\): it stores A = -exp\(A_log\)"):
        load_pretrained(tmp_path, gguf_file=path.name)
