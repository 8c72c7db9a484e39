"""A GGUF file's quantized blocks kept as stored (dew.interop.gguf_blocks, `load_pretrained(..., quantize="gguf")`),
against the float32 model the same file dequantizes to: exactly (up to the order of float32 roundings) under
the kernel policy `exact`, and with x rounded to 8-bit blocks (the integer path) under the default `auto`."""

from __future__ import annotations

import dataclasses
import lzma
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.kernels import policy
from dew.nn.linear import BLOCKS_LAYER, EMBED_BLOCKS, KERNEL_BLOCKS, QUANT_COLLECTION, STACKED_BLOCKS
from dew.runs import pipeline
from dew.sampling import Sampling, generate
from tests.compiled import compiled
from tests.interop.conftest import torch_model
from tests.interop.test_gguf import SMOLLM2, _gguf_name, permuted, smollm2_directory, write_gguf
from tests.tolerances import decoder_ulps, ulp_bound

gguf = pytest.importorskip("gguf")
Q4_0, Q4_1, Q8_0 = (gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0"))
# Each projection in another kind, and layer 1's down projection left float32: a stacked or lone leaf
# keeps blocks only where every one of its tensors is stored in them.
KINDS = {"attn_q": Q4_0, "attn_k": Q4_1, "attn_v": Q8_0, "attn_output": Q4_1, "ffn_gate": Q4_0, "ffn_up": Q4_1,
         "blk.0.ffn_down": Q8_0, "token_embd": Q8_0, "output.weight": Q4_1}


def mixed_tensors(model):
    """The model's tensors under llama.cpp's names, each quantized as `KINDS` says (float32 otherwise)."""
    for name, tensor in model.state_dict().items():
        array = permuted(name, tensor.detach().numpy().astype(np.float32), model.config, "llama")
        named = _gguf_name(name)
        kind = next((kind for key, kind in KINDS.items() if key in named), None)
        yield (named, array, None) if kind is None else (named, gguf.quants.quantize(array, kind), kind)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    model = torch_model("llama", intermediate_size=64)  # every input width a whole number of 32-value blocks
    return write_gguf(model, tmp_path_factory.mktemp("blocks") / "tiny.gguf", tensors=list(mixed_tensors(model)))


@pytest.fixture(scope="module")
def both(tiny_file):
    """(the file dequantized to float32, the file's blocks kept)."""
    return (load_pretrained(tiny_file.parent, gguf_file=tiny_file.name),
            load_pretrained(tiny_file.parent, gguf_file=tiny_file.name, quantize="gguf"))


def exact(model):
    """`model` under the kernel policy `exact`: the blocks kernel keeps x in float32."""
    return model.clone(config=dataclasses.replace(model.config, kernels="exact"))


def test_the_files_blocks_replace_the_float_kernels(both):
    floats, kept = both
    params, quant = kept.variables["params"], kept.variables[QUANT_COLLECTION]
    for layer in ("layers_0", "layers_1"):
        for module in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
                       "mlp/gate_proj", "mlp/up_proj"):
            scope, name = module.split("/")
            blocks = quant[layer][scope][name][KERNEL_BLOCKS]
            assert blocks.dtype == jnp.uint8 and "kernel" not in params[layer].get(scope, {}).get(name, {})
    assert quant["layers_0"]["mlp"]["down_proj"][KERNEL_BLOCKS].shape == (32, 2, 34)  # Q8_0: [out, in / 32, 34]
    assert "down_proj" not in quant["layers_1"]["mlp"]  # float32 in the file, float32 here
    np.testing.assert_array_equal(params["layers_1"]["mlp"]["down_proj"]["kernel"],
                                  floats.variables["params"]["layers_1"]["mlp"]["down_proj"]["kernel"])
    assert quant[EMBED_BLOCKS].shape == (97, 1, 34) and "embed_tokens" not in params
    assert quant["lm_head"][KERNEL_BLOCKS].shape == (97, 1, 20) and "lm_head" not in params  # Q4_1


def test_blocks_compute_what_the_dequantized_float32_model_computes(both):
    floats, kept = both
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 10)), jnp.int32)
    reference = np.asarray(compiled(floats.model.apply, floats.variables, tokens))
    with policy.recording() as choices:
        ours = np.asarray(exact(kept.model).apply(kept.variables, tokens))
    assert choices and all(not key.startswith("blocks-q8") for key in choices)
    # The same weights (the blocks' values are exactly what gguf dequantizes), each product summed in
    # another order: one decoder in two orders. Observed: 7.9e-6 on logits of 6.7.
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=10, libraries=1)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=ulp_bound(ulps, np.abs(reference).max()))


def test_by_default_decoding_products_round_x_to_two_8_bit_layers(both):
    floats, kept = both
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 10)), jnp.int32)
    reference = np.asarray(compiled(floats.model.apply, floats.variables, tokens))
    with policy.recording() as choices:
        ours = np.asarray(kept.model.apply(kept.variables, tokens))
    rounded = sorted({key.split("/")[1] for key in choices if key.startswith("blocks-q8/")})
    assert rounded == ["Q4_0", "Q4_1", "Q8_0"]  # 20 rows, under KERNEL_MAX_ROWS: every kind the integer path takes
    # Each product's x is off by at most d / 508 = 1/64,516 of its block's largest |x| a value
    # (tests/kernels/test_blocks.py checks the products themselves to float32's roundings); 15 such products
    # deep, through norms and softmaxes that amplify differences of a random model, a bound of 0.2% of the
    # logits' scale, 130 times that. Observed: 1.3e-3 on logits of 6.7 (0.019%).
    np.testing.assert_allclose(ours, reference, rtol=0, atol=0.002 * np.abs(reference).max())


def test_a_scanned_run_reads_its_layers_blocks_in_place(tiny_file, both):
    _, kept = both
    scanned = load_pretrained(tiny_file.parent, gguf_file=tiny_file.name, quantize="gguf", scan_layers=1)
    whole, quant = scanned.variables[STACKED_BLOCKS]["layers_0to1"], scanned.variables[QUANT_COLLECTION]["layers_0to1"]
    assert whole["self_attn"]["q_proj"][KERNEL_BLOCKS].shape == (2, 32, 1, 18)
    np.testing.assert_array_equal(quant["self_attn"]["q_proj"][BLOCKS_LAYER], [0, 1])
    assert "down_proj" not in whole["mlp"]  # float32 in layer 1, so float32 in the run
    per_layer = scanned.model.unstack_variables(scanned.variables)
    assert STACKED_BLOCKS not in per_layer
    np.testing.assert_array_equal(per_layer[QUANT_COLLECTION]["layers_1"]["mlp"]["up_proj"][KERNEL_BLOCKS],
                                  kept.variables[QUANT_COLLECTION]["layers_1"]["mlp"]["up_proj"][KERNEL_BLOCKS])
    unrolled = scanned.model.clone(config=dataclasses.replace(scanned.model.config, scan_layers=0))
    ids = np.random.default_rng(1).integers(0, 97, (1, 40))
    for length, path in ((6, "blocks-q8/"), (40, "blocks/")):  # 40 rows, over KERNEL_MAX_ROWS: XLA's product
        tokens = jnp.asarray(ids[:, :length], jnp.int32)
        with policy.recording() as choices:
            ours = np.asarray(scanned.model.apply(scanned.variables, tokens))
        assert any(key.startswith(path) for key in choices)
        reference = np.asarray(compiled(unrolled.apply, per_layer, tokens))
        # The same products of the same blocks and x; only XLA's other operations may round in another
        # order inside the scan's body. Observed: 0 at both lengths (logits of 5.9).
        ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=length, libraries=1)
        np.testing.assert_allclose(ours, reference, rtol=0, atol=ulp_bound(ulps, np.abs(reference).max()))


def test_a_stack_whose_layers_differ_in_kind_is_read_as_floats(tmp_path, monkeypatch):
    """A scanned run stacks a projection's layers: stored in two kinds (as llama.cpp's mixed files do, Q8_0 in
    one layer and Q4_0 in the next), their blocks are of two sizes, so that leaf is read as floats, the rest kept."""
    model = torch_model("llama", intermediate_size=64)
    monkeypatch.setitem(KINDS, "blk.1.ffn_down", Q4_0)
    path = write_gguf(model, tmp_path / "two-kinds.gguf", tensors=list(mixed_tensors(model)))
    scanned = load_pretrained(tmp_path, gguf_file=path.name, quantize="gguf", scan_layers=1)
    floats = load_pretrained(tmp_path, gguf_file=path.name, scan_layers=1)
    whole = scanned.variables[STACKED_BLOCKS]["layers_0to1"]
    assert "down_proj" not in whole["mlp"] and whole["mlp"]["up_proj"][KERNEL_BLOCKS].shape == (2, 64, 1, 20)
    np.testing.assert_array_equal(scanned.variables["params"]["layers_0to1"]["mlp"]["down_proj"]["kernel"],
                                  floats.variables["params"]["layers_0to1"]["mlp"]["down_proj"]["kernel"])


def test_the_pipeline_keeps_blocks_and_bad_requests_are_refused(tiny_file, tmp_path):
    task = pipeline(tiny_file, quantize="gguf")
    assert KERNEL_BLOCKS in task.params[QUANT_COLLECTION]["layers_0"]["self_attn"]["q_proj"]
    with pytest.raises(ValueError, match="quantize='gguf' keeps a GGUF file's quantized blocks, and no gguf_file"):
        load_pretrained(tmp_path, quantize="gguf")
    model = torch_model("llama", intermediate_size=64)
    floats_only = write_gguf(model, tmp_path / "floats.gguf",
                             tensors=[(name, array, None) for name, array, _ in mixed_tensors(model) if _ is None]
                             + [(name, gguf.quants.dequantize(array, kind), None)
                                for name, array, kind in mixed_tensors(model) if kind is not None])
    with pytest.raises(ValueError, match="floats.gguf stores none of its linears in blocks Dew's kernel multiplies"):
        load_pretrained(tmp_path, gguf_file=floats_only.name, quantize="gguf")


CORPUS = Path(__file__).resolve().parents[2] / "data" / "kjv.txt.xz"


def chunked_perplexity(model, variables, ids, chunk: int = 32) -> float:
    """Perplexity of `ids` `[1, T + 1]` fed through the cache `chunk` tokens at a time: every product then
    has at most `chunk` rows, as in decoding, so the blocks take the kernel's integer path."""
    tokens = ids.shape[1] - 1

    @jax.jit
    def scored(variables, cache, chunk_ids):  # the weights an argument, not constants of the program
        output, cache = model.apply(variables, chunk_ids[:, :-1], attention_mask=jnp.ones((1, chunk), bool),
                                    cache=cache, head=False)
        log_probs = jax.nn.log_softmax(output.head.logits(output.hidden[0]).astype(jnp.float32), axis=-1)
        return jnp.sum(jnp.take_along_axis(log_probs, chunk_ids[0, 1:, None], axis=-1)), cache

    cache, total = model.init_cache(1, tokens), 0.0
    for start in range(0, tokens, chunk):
        part, cache = scored(variables, cache, ids[:, start:start + chunk + 1])
        total += float(part)
    return float(np.exp(-total / tokens))


@pytest.mark.slow
def test_smollm2_in_its_own_q4_1_blocks_says_what_float32_says():
    directory = smollm2_directory()
    floats = load_pretrained(directory, gguf_file=SMOLLM2)
    kept = load_pretrained(directory, gguf_file=SMOLLM2, quantize="gguf")  # the integer path: policy auto
    greedy = Sampling(temperature=0.0)
    prompt = [floats.tokenizer.encode("The capital of France is")]
    runs = [generate(bundle.model, bundle.variables, prompt, 32, key=jax.random.key(0), sampling=greedy)
            for bundle in (floats, kept)]
    same = sum(a == b for a, b in zip(runs[0].continuations()[0], runs[1].continuations()[0]))
    # The goal; observed: all 32 (" Paris.\n\nThe answer is: 2018-01-22 ..."; x rounded to one 8-bit layer
    # alone, as llama.cpp rounds it, agreed on 6: " Paris.\n\nThe United States has a population ...").
    assert same >= 30
    with lzma.open(CORPUS, "rt", encoding="utf-8") as stream:
        ids = jnp.asarray([floats.tokenizer.encode(stream.read()[-20_000:])[:513]], jnp.int32)
    ratio = chunked_perplexity(kept.model, kept.variables, ids) / chunked_perplexity(floats.model, floats.variables, ids)
    assert abs(ratio - 1) < 0.01  # the goal; observed: +2.2e-5 (11.72855 against 11.72829)


def test_the_kept_tensors_are_never_read_as_floats(tiny_file, monkeypatch):
    """The leaves kept as blocks are found from the model's shapes first, so the load dequantizes only the
    float leaves: it reads the file's bytes once, and never holds the float32 copy of a kept weight."""
    from dew.interop.gguf_files import GGUFCheckpoint

    read = []
    dequantize = GGUFCheckpoint.read
    monkeypatch.setattr(GGUFCheckpoint, "read", lambda self, name, *index: read.append(name) or dequantize(self, name, *index))
    load_pretrained(tiny_file.parent, gguf_file=tiny_file.name, quantize="gguf")
    kept = {f"blk.{layer}.{name}.weight" for layer in (0, 1) for name in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                            "ffn_gate", "ffn_up")}
    assert not kept & set(read) and not {"token_embd.weight", "output.weight", "blk.0.ffn_down.weight"} & set(read)
    assert {"blk.1.ffn_down.weight", "blk.0.attn_norm.weight", "output_norm.weight"} <= set(read)


def test_blocks_with_a_nan_scale_are_refused_as_the_float_load_refuses_them(tmp_path):
    model = torch_model("llama", intermediate_size=64)
    tensors = []
    for name, array, kind in mixed_tensors(model):
        if name == "blk.1.attn_q.weight":  # Q4_0, a block a row: its float16 d first; row 2's made NaN
            array = array.copy()
            array[2, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
        tensors.append((name, array, kind))
    damaged = write_gguf(model, tmp_path / "damaged.gguf", tensors=tensors)
    with pytest.raises(ValueError, match=r"'blk.1.attn_q.weight' in damaged.gguf holds 1 block\(s\) of its 32 whose "
                                         r"scale is NaN or infinite \(the first, block 0 of row 2\)"):
        load_pretrained(tmp_path, gguf_file=damaged.name, quantize="gguf")
    with pytest.raises(ValueError, match="'blk.1.attn_q.weight' in damaged.gguf holds 32 NaN or infinite value"):
        load_pretrained(tmp_path, gguf_file=damaged.name)
