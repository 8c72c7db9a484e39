import gzip
import io
import json
import lzma
import shutil

import numpy as np
import pytest

from dew.data import ByteTokenizer, HFTokenizer
from dew.data.token_files import (FINGERPRINT_BLOCK, FINGERPRINT_BLOCKS, dtype_for_vocab, fingerprint, make_meta,
                                  open_split, read_meta, write_meta)
from dew.data.tokenize import text_chunks, tokenize_text

from .conftest import make_corpus
from .test_tokenizers import GPT2, needs_gpt2


@pytest.mark.parametrize("vocab_size, dtype", [
    (1, "uint8"), (256, "uint8"), (257, "uint16"), (65536, "uint16"), (65537, "uint32"),
    (2**32, "uint32"),
])
def test_dtype_for_vocab(vocab_size, dtype):
    assert dtype_for_vocab(vocab_size) == np.dtype(dtype)


def test_dtype_for_vocab_refuses_sizes_no_dtype_holds():
    with pytest.raises(ValueError, match="above 4294967296"):
        dtype_for_vocab(2**32 + 1)
    with pytest.raises(ValueError, match="vocab_size is 0"):
        dtype_for_vocab(0)


def write_files(path, train, val, vocab_size=300):
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    np.asarray(train, dtype).tofile(path / "train.bin")
    np.asarray(val, dtype).tofile(path / "val.bin")
    write_meta(path, make_meta("byte", vocab_size, len(train), len(val), None))


def test_meta_and_memmap(tmp_path):
    write_files(tmp_path, np.arange(10), [299, 7])
    meta = read_meta(tmp_path)
    assert meta == {"tokenizer": "byte", "vocab_size": 300, "dtype": "uint16", "train_tokens": 10,
                    "val_tokens": 2, "eos_id": None}
    train = open_split(tmp_path, "train")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    np.testing.assert_array_equal(train, np.arange(10))
    np.testing.assert_array_equal(open_split(tmp_path, "val", meta), [299, 7])


def test_the_fingerprint_tells_same_size_data_apart_but_not_an_edit_between_its_blocks(tmp_path):
    ids = np.random.default_rng(0).integers(0, 300, 600_000)  # 1.2 MB of uint16: sampled, not read whole
    write_files(tmp_path / "tokens", ids, [1, 2, 3])
    meta = read_meta(tmp_path / "tokens")
    first = fingerprint(tmp_path / "tokens", meta)
    assert len(first) == 32
    shutil.copytree(tmp_path / "tokens", tmp_path / "copy")
    assert fingerprint(tmp_path / "copy", meta) == first  # the contents, wherever they are
    write_files(tmp_path / "shuffled", np.random.default_rng(1).permutation(ids), [1, 2, 3])
    assert read_meta(tmp_path / "shuffled") == meta and fingerprint(tmp_path / "shuffled", meta) != first
    write_files(tmp_path / "val", ids, [1, 2, 4])  # a file of up to 1 MiB is read whole: one id shows
    assert fingerprint(tmp_path / "val", meta) != first
    # What it cannot see: an id in the gap between the first two sampled blocks of train.bin.
    size = (tmp_path / "tokens" / "train.bin").stat().st_size
    gap = (FINGERPRINT_BLOCK + (size - FINGERPRINT_BLOCK) // (FINGERPRINT_BLOCKS - 1)) // 2  # a byte offset
    edited = ids.copy()
    edited[gap // 2] = (edited[gap // 2] + 1) % 300
    write_files(tmp_path / "edited", edited, [1, 2, 3])
    assert fingerprint(tmp_path / "edited", meta) == first


def test_empty_split_is_an_empty_array(tmp_path):
    write_files(tmp_path, [1, 2], [])
    assert open_split(tmp_path, "val").shape == (0,)


def test_missing_meta_names_the_tool(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json does not exist.*tools/tokenize_text.py"):
        read_meta(tmp_path)


def test_size_mismatch_gives_both_counts(tmp_path):
    write_files(tmp_path, np.arange(10), [1, 2])
    np.arange(12, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"holds 24 bytes = 12 uint16 tokens.*train_tokens = 10"):
        read_meta(tmp_path)
    (tmp_path / "val.bin").unlink()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match="val.bin does not exist"):
        read_meta(tmp_path)


def test_unknown_or_wrong_dtype(tmp_path):
    write_files(tmp_path, [1], [2])
    meta = json.loads((tmp_path / "meta.json").read_text())
    write_meta(tmp_path, {**meta, "dtype": "int64"})
    with pytest.raises(ValueError, match=r"dtype 'int64'.*uint8"):
        read_meta(tmp_path)
    write_meta(tmp_path, {**meta, "dtype": "uint8"})
    with pytest.raises(ValueError, match="dtype uint8 for vocab_size 300, which needs uint16"):
        read_meta(tmp_path)


@pytest.mark.parametrize("meta, says", [
    (lambda text: text[: len(text) // 2], r"is not valid JSON \(.* at line \d+, column \d+\): it was cut short"),
    (lambda text: "[1, 2]", r"holds a JSON array, not an object of fields"),
    (lambda text: text.replace('"vocab_size": 300', '"vocab_size": "300"'),
     r"gives vocab_size '300', which is not a positive integer"),
    (lambda text: text.replace('"train_tokens": 1', '"train_tokens": -1'),
     r"gives train_tokens -1, which is not a token count, 0 or more"),
    (lambda text: text.replace('"eos_id": null', '"eos_id": "eos"'), r"gives eos_id 'eos', which is not a token id"),
    (lambda text: text.replace('"dtype": "uint16"', '"dtype": ["uint16"]'),
     r"gives dtype \['uint16'\], which is not one of uint8, uint16, uint32"),
], ids=["truncated", "list", "string-vocab", "negative-count", "string-eos", "list-dtype"])
def test_a_meta_json_that_lies_is_refused_naming_the_file_and_field(meta, says, tmp_path):
    write_files(tmp_path, [1], [2])
    text = (tmp_path / "meta.json").read_text()
    (tmp_path / "meta.json").write_text(meta(text))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'meta.json'} {says}.*rewrite the token files with"):
        read_meta(tmp_path)


def ids_of(path):
    return np.concatenate([open_split(path, "val"), open_split(path, "train")])


def test_bpe_round_trip_through_token_files(bpe_dir, corpus, tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus, encoding="utf-8")
    meta = tokenize_text(tmp_path / "corpus.txt", tmp_path / "out", bpe_dir, val_fraction=0.1,
                         workers=1)
    tokenizer = HFTokenizer(bpe_dir)
    assert meta == read_meta(tmp_path / "out")
    assert meta["tokenizer"] == tokenizer.name and meta["dtype"] == "uint16"
    assert meta["eos_id"] == tokenizer.eos_id
    total = meta["train_tokens"] + meta["val_tokens"]
    assert meta["val_tokens"] == int(total * 0.1)
    assert tokenizer.decode(ids_of(tmp_path / "out")) == corpus
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_chunks_end_at_line_ends(corpus):
    chunks = list(text_chunks(io.BytesIO(corpus.encode()), chunk_bytes=50))
    assert len(chunks) > 50 and "".join(chunks) == corpus
    for chunk, following in zip(chunks, chunks[1:]):
        assert chunk.endswith("\n") and not chunk[-2].isspace() and not following[0].isspace()


def test_text_without_strict_cuts_is_cut_at_line_ends():
    text = "".join(f"line {i}\r\n" for i in range(200))  # every newline follows a "\r"
    chunks = list(text_chunks(io.BytesIO(text.encode()), chunk_bytes=10))
    assert len(chunks) > 5 and "".join(chunks) == text
    assert all(chunk.endswith("\r\n") for chunk in chunks)


def test_small_chunks_give_the_ids_of_one_chunk(bpe_dir, corpus, tmp_path):
    tokenizer = HFTokenizer(bpe_dir)
    middle = corpus.index(" ", len(corpus) // 2)
    # The tokenizer notices a cut inside a line, so the equality below tests where cuts fall.
    assert tokenizer.encode(corpus[:middle]) + tokenizer.encode(corpus[middle:]) != tokenizer.encode(corpus)
    (tmp_path / "corpus.txt").write_text(corpus, encoding="utf-8")
    for chunk_bytes, out in [(1 << 30, "one"), (40, "many")]:
        tokenize_text(tmp_path / "corpus.txt", tmp_path / out, tokenizer, 0.0, 1, chunk_bytes=chunk_bytes)
    np.testing.assert_array_equal(ids_of(tmp_path / "many"), ids_of(tmp_path / "one"))
    np.testing.assert_array_equal(ids_of(tmp_path / "one"), tokenizer.encode(corpus))


@needs_gpt2
def test_gpt2_chunks_give_the_ids_of_the_whole_text(corpus, tmp_path):
    # GPT-2 joins a newline with the spaces after it ("\n  " is one piece): cuts must avoid them.
    tokenizer = HFTokenizer(GPT2)
    text = corpus.replace("\t", "    ") + "<|endoftext|>\n\n\n   end\n"
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    tokenize_text(tmp_path / "corpus.txt", tmp_path / "out", tokenizer, 0.0, 1, chunk_bytes=30)
    np.testing.assert_array_equal(ids_of(tmp_path / "out"), tokenizer.encode(text))


@pytest.mark.slow  # spawns two processes
def test_worker_processes_keep_the_order(bpe_dir, corpus, tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus, encoding="utf-8")
    tokenize_text(tmp_path / "corpus.txt", tmp_path / "pool", bpe_dir, 0.05, 2, chunk_bytes=200)
    tokenize_text(tmp_path / "corpus.txt", tmp_path / "here", bpe_dir, 0.05, 1, chunk_bytes=200)
    for split in ("train", "val"):
        assert (tmp_path / "pool" / f"{split}.bin").read_bytes() == (tmp_path / "here" / f"{split}.bin").read_bytes()


def test_directory_of_compressed_files_with_eos_between(bpe_dir, tmp_path):
    texts = [make_corpus(20, seed) for seed in range(3)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(texts[0], encoding="utf-8")
    with lzma.open(tmp_path / "in" / "b.txt.xz", "wt", encoding="utf-8") as stream:
        stream.write(texts[1])
    with gzip.open(tmp_path / "in" / "c.txt.gz", "wt", encoding="utf-8") as stream:
        stream.write(texts[2])
    (tmp_path / "in" / "notes.md").write_text("not read")
    tokenizer = HFTokenizer(bpe_dir)
    tokenize_text(tmp_path / "in", tmp_path / "plain", tokenizer, 0.0, 1)
    assert tokenizer.decode(ids_of(tmp_path / "plain")) == "".join(texts)
    tokenize_text(tmp_path / "in", tmp_path / "eos", tokenizer, 0.0, 1, eos_between_files=True)
    expected = [*tokenizer.encode(texts[0]), tokenizer.eos_id, *tokenizer.encode(texts[1]),
                tokenizer.eos_id, *tokenizer.encode(texts[2])]
    np.testing.assert_array_equal(ids_of(tmp_path / "eos"), expected)


def test_tokenize_errors(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        tokenize_text(tmp_path / "a.txt", tmp_path / "out", "byte", 0.0, 1)
    assert list((tmp_path / "out").iterdir()) == []  # no partial files left behind
    with pytest.raises(ValueError, match="val_fraction is 1"):
        tokenize_text(tmp_path / "a.txt", tmp_path / "out", "byte", 1, 1)
    with pytest.raises(ValueError, match="has none: drop --eos-between-files"):
        tokenize_text(tmp_path / "a.txt", tmp_path / "out", ByteTokenizer(), 0.1, 1, eos_between_files=True)
    with pytest.raises(FileNotFoundError, match="holds no .txt"):
        tokenize_text(tmp_path / "out", tmp_path / "out2", "byte", 0.1, 1)
