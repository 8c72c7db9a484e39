"""The tokenizer of a GGUF file: SentencePiece ("llama") vocabularies against transformers' own GGUF tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers

from dew.interop import load_pretrained
from dew.interop.gguf_files import GGUFCheckpoint, write_tokenizer
from tests.interop.conftest import torch_model, transformers
from tests.interop.test_gguf import write_gguf

gguf = pytest.importorskip("gguf")

# A SentencePiece-style vocabulary as llama.cpp writes Llama 2's: <unk>, <s>, </s>, the 256 byte
# tokens, then pieces best-first (prefixes of "▁word" and two- and three-letter pieces, their
# scores shuffled so merges are not simply left to right), then single characters at the lowest
# scores. "é" and "日本" are not in it, so they fall back to bytes; "ü" is.
WORDS = "the and Hello world line one two tab spaces multiple here leading über".split()
PIECES = list(dict.fromkeys([f"\u2581{word[:end]}" for word in WORDS for end in range(1, len(word) + 1)]
                            + [word[i:i + n] for word in WORDS for n in (2, 3) for i in range(len(word) - n + 1)]
                            + ["\u2581\u2581", "\u2581\u2581\u2581\u2581"]))
PIECES = [PIECES[i] for i in np.random.default_rng(0).permutation(len(PIECES))]
# Pieces whose merges tie on score, best of all: "12345678" shows the order transformers breaks ties in
# (the longer left part first, then file order): ▁ 1 23 456 78.
TIED = {"45": 1.0, "78": 1.0, "678": 0.5, "456": 0.5, "23": 0.25, "12": 0.25}
CHARACTERS = sorted(set("".join(WORDS)) | set("0123456789.,!?'-") | {"\u2581"})
EXTRA = {"<tool>": 4, "<|end|>": 3, "<unused0>": 5}  # user-defined, control, unused
TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + PIECES + list(TIED)
          + CHARACTERS + list(EXTRA))
TOKEN_TYPES = [2, 3, 3] + [6] * 256 + [1] * (len(PIECES) + len(TIED) + len(CHARACTERS)) + list(EXTRA.values())
SCORES = ([0.0] * 259 + [-float(i) for i in range(len(PIECES))] + list(TIED.values())
          + [-1e3 - i for i in range(len(CHARACTERS))] + [0.0] * len(EXTRA))
# Explicit merges in another order than the scores give (last piece first), so the file's own are used.
FILE_MERGES = [f"{piece[:cut]} {piece[cut:]}" for piece in reversed(PIECES + list(TIED))
               for cut in range(1, len(piece)) if piece[:cut] in TOKENS and piece[cut:] in TOKENS]
CHAT_TEMPLATE = "{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}"
TEXTS = ["Hello world", " Hello world", "  two leading spaces", "multiple   spaces  here ", "line one\nline two\n\n",
         "\ttab", "é", "日本 and über", "", "the<s>the</s> and <tool> here<|end|>", "Hello, world! 42",
         "12345678"]

# What each variant adds to the tokenizer metadata.
VARIANTS = {
    "merges-from-scores": {},
    "file-merges-eos-no-bos": {"merges": FILE_MERGES, "add_bos_token": False, "add_eos_token": True},
}


def _write_vocabulary(writer, kind="llama", merges=None, add_bos_token=None, add_eos_token=None,
                      add_space_prefix=None, scores=True):
    """Replace the byte-level vocabulary `write_gguf` writes with this file's SentencePiece one."""
    writer.kv_data[0] = {key: value for key, value in writer.kv_data[0].items() if not key.startswith("tokenizer.")}
    writer.add_tokenizer_model(kind)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    if scores:
        writer.add_token_scores(SCORES)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for flag, value in [(writer.add_add_bos_token, add_bos_token), (writer.add_add_eos_token, add_eos_token),
                        (writer.add_add_space_prefix, add_space_prefix)]:
        if value is not None:
            flag(value)
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tiny_llama():
    """A llama model whose vocabulary is TOKENS, for `write_gguf`."""
    return torch_model("llama", vocab_size=len(TOKENS), max_position_embeddings=32)


def _gguf(model, directory, **vocabulary):
    return write_gguf(model, directory / "tiny.Q8_0.gguf", extra=lambda writer: _write_vocabulary(writer, **vocabulary))


def _ours(path, directory) -> tokenizers.Tokenizer:
    with GGUFCheckpoint(path) as checkpoint:
        assert write_tokenizer(checkpoint, directory)
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))


def _vocabulary_only(path, **vocabulary):
    """A GGUF file holding a llama model's vocabulary and no tensors: enough for `write_tokenizer`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_vocabulary(writer, **vocabulary)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def sentencepiece_gguf(request, tiny_llama, tmp_path_factory):
    """The GGUF file of one variant and the variant's metadata."""
    vocabulary = VARIANTS[request.param]
    return _gguf(tiny_llama, tmp_path_factory.mktemp(request.param), **vocabulary), vocabulary


def test_sentencepiece_tokenizer_matches_transformers_gguf_tokenizer(sentencepiece_gguf, tmp_path):
    sentencepiece_gguf, vocabulary = sentencepiece_gguf
    ours = _ours(sentencepiece_gguf, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    assert ours.get_vocab_size() == len(TOKENS)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    # The texts exercise what they are meant to: byte fallback, merges, and the BOS/EOS template.
    assert [ours.id_to_token(i) for i in ours.encode("é", add_special_tokens=False).ids] == [
        "\u2581", "<0xC3>", "<0xA9>"]
    assert ours.encode("Hello world", add_special_tokens=False).tokens == ["\u2581Hello", "\u2581world"]
    if "merges" not in vocabulary:
        assert ours.encode("12345678", add_special_tokens=False).tokens == ["\u2581", "1", "23", "456", "78"]
    # llama.cpp's defaults when the file does not say: BOS, no EOS
    bos, eos = vocabulary.get("add_bos_token", True), vocabulary.get("add_eos_token", False)
    assert ours.encode("").ids == [1] * bos + [2] * eos


def test_written_directory_loads_in_transformers(sentencepiece_gguf, tmp_path):
    sentencepiece_gguf, _ = sentencepiece_gguf
    _ours(sentencepiece_gguf, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["unk_token"] == "<unk>"
    theirs = transformers.AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert reloaded.encode(text) == theirs.encode(text), text


def test_load_pretrained_gives_the_gguf_tokenizer(sentencepiece_gguf):
    sentencepiece_gguf, _ = sentencepiece_gguf
    bundle = load_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    theirs = transformers.AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    assert bundle.tokenizer is not None and bundle.tokenizer.eos_id == 2
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert bundle.tokenizer.encode(text) == ids, text
        assert bundle.tokenizer.decode(ids) == theirs.decode(ids), text


def test_add_space_prefix_false_puts_no_space_before_the_text(tiny_llama, tmp_path):
    # transformers reads the flag for Gemma and Phi-3 only and prepends the space here regardless;
    # llama.cpp honours it, and so does Dew. Without the prefix, " text" tokenizes as "text" does with it.
    ours = _ours(_gguf(tiny_llama, tmp_path, add_space_prefix=False), tmp_path / "converted")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.Q8_0.gguf")
    for text in [text for text in TEXTS if text and not text[0].isspace()]:
        assert ours.encode(" " + text).ids == theirs.encode(text), text
        unmarked = ours.encode(" " + text, add_special_tokens=False).ids
        assert ours.decode(unmarked, skip_special_tokens=False) == " " + text, text
    assert ours.encode("Hello world", add_special_tokens=False).tokens[-1] == "\u2581world"
    assert not ours.encode("Hello world", add_special_tokens=False).tokens[0].startswith("\u2581")


@pytest.mark.parametrize("kind", ["t5", "bert", "rwkv"])
def test_other_tokenizer_kinds_are_not_built(kind, tmp_path):
    with GGUFCheckpoint(_vocabulary_only(tmp_path / "vocabulary.gguf", kind=kind)) as checkpoint:
        assert write_tokenizer(checkpoint, tmp_path / "converted") is False
    assert not (tmp_path / "converted").exists()


def test_sentencepiece_vocabulary_without_scores_or_merges_is_refused(tmp_path):
    path = _vocabulary_only(tmp_path / "vocabulary.gguf", scores=False)
    with GGUFCheckpoint(path) as checkpoint, pytest.raises(ValueError, match=r"neither tokenizer.ggml.merges nor"):
        write_tokenizer(checkpoint, tmp_path / "converted")


def test_a_built_tokenizer_is_reused_until_the_builder_changes(tmp_path, monkeypatch):
    """The tokenizer a GGUF file's vocabulary builds is kept beside its conversion and read back by the next
    load, unless this module's builder (its source, the tokenizers package) differs from the one that wrote it."""
    from dew.interop import gguf_files

    directory = tmp_path / "converted"
    assert not gguf_files.tokenizer_written(directory)
    with GGUFCheckpoint(_vocabulary_only(tmp_path / "vocabulary.gguf")) as checkpoint:
        assert write_tokenizer(checkpoint, directory)
    assert gguf_files.tokenizer_written(directory)
    monkeypatch.setattr(gguf_files, "_builder_stamp", lambda: "module another\ntokenizers 0.0\n")
    assert not gguf_files.tokenizer_written(directory)
