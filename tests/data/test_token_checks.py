"""Token files are checked whole when they are opened: sizes, and every id against the vocabulary."""

import numpy as np
import pytest

from dew.data import PackedTokens, TokenWindows
from dew.data import token_files
from dew.data.token_files import dtype_for_vocab, make_meta, read_meta, write_meta


def write_files(path, train, val, vocab_size, eos_id=None):
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    np.asarray(train, dtype).tofile(path / "train.bin")
    np.asarray(val, dtype).tofile(path / "val.bin")
    write_meta(path, make_meta("byte", vocab_size, len(train), len(val), eos_id))
    return path


def test_an_out_of_vocabulary_id_is_named_with_its_offset(tmp_path, monkeypatch):
    train = np.arange(40) % 300
    train[23], train[31] = 300, 65535  # the first of two bad ids is the one named
    write_files(tmp_path, train, [1, 2], vocab_size=300)
    # Blocks of 8 tokens: the bad id sits in the third block, so its offset adds the block start.
    monkeypatch.setattr(token_files, "_CHECK_TOKENS", 8)
    with pytest.raises(ValueError, match=(
            rf"{tmp_path / 'train.bin'} holds token id 300 at token 23 \(byte offset 46\), outside "
            r"vocab_size 300 from meta.json: .* rewrite it with `dew tokenize --input TEXT")):
        read_meta(tmp_path)


def test_the_val_split_is_checked_too(tmp_path):
    write_files(tmp_path, np.arange(10), [5, 299, 4000], vocab_size=300)
    with pytest.raises(ValueError, match=r"val.bin holds token id 4000 at token 2 "):
        read_meta(tmp_path)


@pytest.mark.parametrize("spec", [TokenWindows, PackedTokens])
def test_load_refuses_before_any_batch(tmp_path, spec):
    # 50257 ids in uint16 (GPT-2's case): the id 60000 deep in the file fails the load itself.
    train = np.zeros(5000, np.int64)
    train[4321] = 60000
    path = write_files(tmp_path, train, [], vocab_size=50257, eos_id=0)
    with pytest.raises(ValueError, match="holds token id 60000 at token 4,321"):
        spec(str(path), 4).load(2)


def test_a_dtype_with_no_room_outside_the_vocabulary_loads(tmp_path):
    write_files(tmp_path, np.arange(256), [255], vocab_size=256)
    assert read_meta(tmp_path)["train_tokens"] == 256


def test_a_size_that_is_not_whole_tokens_gives_both_numbers(tmp_path):
    write_files(tmp_path, np.arange(12), [1], vocab_size=300)
    with open(tmp_path / "train.bin", "ab") as stream:
        stream.write(b"\x01")  # 25 bytes of uint16
    with pytest.raises(ValueError, match=(
            r"train.bin holds 25 bytes, not a whole number of uint16 tokens \(2 bytes each\), and "
            r"meta.json says train_tokens = 12 \(24 bytes\)")):
        read_meta(tmp_path)
