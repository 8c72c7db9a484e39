import itertools

import numpy as np
import pytest

from dew.data import Loading, PackedTokens, Partition, TokenWindows
from dew.data.token_files import dtype_for_vocab, fingerprint, make_meta, read_meta, write_meta
from dew.data.windows import _pieces

SEQ = 4


def write_files(path, train, val, vocab_size=65536, eos_id=None, tokenizer="byte"):
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    np.asarray(train, dtype).tofile(path / "train.bin")
    np.asarray(val, dtype).tofile(path / "val.bin")
    write_meta(path, make_meta(tokenizer, vocab_size, len(train), len(val), eos_id))
    return str(path)


@pytest.fixture
def counting(tmp_path):
    """Token i is i, so a window names itself: 80 train windows of 4+1, 7 val windows."""
    return write_files(tmp_path / "counting", np.arange(80 * SEQ + 1), 1000 + np.arange(7 * SEQ + 2))


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def window_numbers(batch):
    return list(batch["text"][:, 0] // SEQ)


@pytest.mark.parametrize("loading", [Loading(prefetch=0), Loading()])
def test_windows_shapes_epochs_and_state(counting, loading):
    data = TokenWindows(counting, SEQ, loading=loading).load(8)
    assert (data.records, data.batch, data.meta["seq_len"]) == (80, 8, SEQ)
    batches = take(data.train(Partition()), 30)  # three epochs of 10 batches
    for batch in batches:
        assert batch["text"].shape == (8, SEQ + 1) and batch["text"].dtype == np.int32
        np.testing.assert_array_equal(batch["text"], batch["text"][:, :1] + np.arange(SEQ + 1))
    epochs = [sum(map(window_numbers, batches[i:i + 10]), []) for i in (0, 10, 20)]
    assert all(sorted(epoch) == list(range(80)) for epoch in epochs)  # each window once an epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(80))

    iterator = data.train(Partition())
    take(iterator, 13)
    state = iterator.get_state()
    expected = take(iterator, 4)
    resumed = data.train(Partition())
    resumed.set_state(state)
    for got, want in zip(take(resumed, 4), expected):
        np.testing.assert_array_equal(got["text"], want["text"])


def test_windows_seed(counting):
    def first(seed):
        return [b["text"] for b in take(TokenWindows(counting, SEQ, seed=seed).load(8).train(Partition()), 3)]

    assert all((a == b).all() for a, b in zip(first(0), first(0)))
    assert not all((a == b).all() for a, b in zip(first(0), first(1)))


def test_partitions_are_disjoint_blocks_of_the_global_batch(counting):
    data = TokenWindows(counting, SEQ).load(8)
    whole = take(data.train(Partition()), 5)
    shares = [take(data.train(Partition(index, 4)), 5) for index in range(4)]
    for step, batch in enumerate(whole):
        parts = [share[step]["text"] for share in shares]
        assert all(part.shape == (2, SEQ + 1) for part in parts)
        np.testing.assert_array_equal(np.concatenate(parts), batch["text"])
    with pytest.raises(ValueError, match="batch 8 does not split evenly over 3 processes"):
        data.train(Partition(0, 3))


def test_val_is_one_pass_in_file_order(counting):
    data = TokenWindows(counting, SEQ).load(8, val_batch=3)
    for _ in range(2):  # every call starts a fresh pass
        batches = list(data.val(Partition()))
        assert [b["text"][:, 0].tolist() for b in batches] == [[1000, 1004, 1008], [1012, 1016, 1020]]
    np.testing.assert_array_equal(batches[0]["text"][1], 1004 + np.arange(SEQ + 1))
    assert list(data.val(Partition(1, 3)))[1]["text"][:, 0].tolist() == [1016]


def test_val_smaller_than_one_batch_is_one_batch(counting):
    (batch,) = TokenWindows(counting, SEQ).load(8).val(Partition())
    assert batch["text"].shape == (7, SEQ + 1)
    (share,) = TokenWindows(counting, SEQ).load(8).val(Partition(1, 2))
    assert share["text"][:, 0].tolist() == [1012, 1016, 1020]  # 6 of the 7 windows, split in two


def test_a_val_batch_above_the_validation_windows_is_refused_naming_both(counting):
    with pytest.raises(ValueError, match=r"val_batch 8 \(--trainer.val-batch\) is more than the 7 validation windows "
                                         r"of .*counting \(30 val.bin tokens in windows of seq_len 4 \+ 1\), so no "
                                         r"batch of it could be read: pass --trainer.val-batch 7 or fewer"):
        TokenWindows(counting, SEQ).load(2, val_batch=8)
    assert len(list(TokenWindows(counting, SEQ).load(2, val_batch=7).val(Partition()))) == 1


def test_val_absent_or_too_short(tmp_path):
    assert TokenWindows(write_files(tmp_path / "none", np.arange(99), []), SEQ).load(2).val is None
    short = write_files(tmp_path / "short", np.arange(99), [1, 2, 3])
    with pytest.raises(ValueError, match="val split .* has 3 tokens and one window needs 5"):
        TokenWindows(short, SEQ).load(2)


def test_corpus_too_small(tmp_path):
    path = write_files(tmp_path, np.arange(3 * SEQ + 1), [])
    with pytest.raises(ValueError, match=r"has 13 tokens, 3 windows of 4\+1, and one batch needs 4: "
                                         r"use a smaller batch or seq_len"):
        TokenWindows(path, SEQ).load(4)


def test_spec_errors(counting):
    with pytest.raises(ValueError, match="seq_len is 0"):
        TokenWindows(counting, 0).load(2)
    with pytest.raises(ValueError, match="written with tokenizer 'byte'.*not 'gpt2'.*tokenizer='byte'"):
        TokenWindows(counting, SEQ, tokenizer="gpt2").load(2)
    TokenWindows(counting, SEQ, tokenizer="byte").load(2)
    with pytest.raises(ValueError, match="val_batch is 0"):
        TokenWindows(counting, SEQ).load(2, val_batch=0)
    with pytest.raises(ValueError, match="seed is -1"):
        TokenWindows(counting, SEQ, seed=-1).load(2)
    with pytest.raises(ValueError, match="Loading.workers is -1"):
        Loading(workers=-1)
    with pytest.raises(ValueError, match="prefetch is 0: with workers=2 it must be at least 1"):
        Loading(workers=2, prefetch=0)


@pytest.mark.slow  # spawns a Grain worker process
def test_worker_processes_give_the_same_batches(counting):
    expected = take(TokenWindows(counting, SEQ).load(8).train(Partition()), 6)
    data = TokenWindows(counting, SEQ, loading=Loading(workers=1)).load(8)
    iterator = data.train(Partition())
    got = take(iterator, 4)
    state = iterator.get_state()
    iterator.close()
    resumed = data.train(Partition())
    resumed.set_state(state)
    got += take(resumed, 2)
    resumed.close()
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a["text"], b["text"])


EOS = 1
# Documents end after each EOS; the third is longer than a row of 4+1 tokens.
DOCUMENTS = [[5, 6, EOS], [7, EOS], [8, 9, 10, 11, 12, 13, 14, EOS], [2, 3, EOS]]


def test_pieces_split_documents_at_eos_and_row_width():
    tokens = np.array(sum(DOCUMENTS, []) + [4, 4])
    assert _pieces(tokens, EOS, SEQ + 1).tolist() == [[0, 3], [3, 2], [5, 5], [10, 3], [13, 3], [16, 2]]
    assert _pieces(np.array([], np.uint8), EOS, 5).shape == (0, 2)


def test_packed_val_rows_by_hand(tmp_path):
    path = write_files(tmp_path, sum(DOCUMENTS * 4, []), sum(DOCUMENTS, []), vocab_size=16, eos_id=EOS)
    data = PackedTokens(path, SEQ).load(2)
    first, second = data.val(Partition())
    # First fit in file order: [5 6 1][7 1] | [8..12], then [13 14 1] | [2 3 1] with padding.
    assert first["text"].tolist() == [[5, 6, 1, 7, 1], [8, 9, 10, 11, 12]]
    assert first["text_segment_ids"].tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 1, 1]]
    assert first["text_positions"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert second["text"].tolist() == [[13, 14, 1, 0, 0], [2, 3, 1, 0, 0]]
    assert second["text_segment_ids"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert second["text_positions"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 0, 0]]
    assert [b["text"].tolist() for b in data.val(Partition(1, 2))] == [[[8, 9, 10, 11, 12]], [[2, 3, 1, 0, 0]]]


def test_a_packed_val_batch_above_the_rows_the_documents_pack_into_is_refused(tmp_path):
    path = write_files(tmp_path, sum(DOCUMENTS * 4, []), sum(DOCUMENTS, []), vocab_size=16, eos_id=EOS)
    with pytest.raises(ValueError, match=r"val_batch 5 \(--trainer.val-batch\) is more than the 4 rows of seq_len 4 "
                                         r"\+ 1 the 16 val.bin tokens of .* pack into, so no batch"):
        PackedTokens(path, SEQ).load(2, val_batch=5)
    (batch,) = PackedTokens(path, SEQ).load(2, val_batch=4).val(Partition())  # one batch of the four rows
    assert batch["text"].shape == (4, SEQ + 1)


def test_both_readers_carry_the_token_files_fingerprint(tmp_path):
    path = write_files(tmp_path / "a", sum(DOCUMENTS * 4, []), sum(DOCUMENTS, []), vocab_size=16, eos_id=EOS)
    found = {reader(path, SEQ).load(2).meta["fingerprint"] for reader in (TokenWindows, PackedTokens)}
    assert found == {fingerprint(path, read_meta(path))}
    other = write_files(tmp_path / "b", sum(DOCUMENTS[::-1] * 4, []), sum(DOCUMENTS, []), vocab_size=16, eos_id=EOS)
    assert PackedTokens(other, SEQ).load(2).meta["fingerprint"] not in found  # the same documents, reordered


def test_packed_train_rows_state_and_seed(tmp_path):
    path = write_files(tmp_path, sum(DOCUMENTS * 4, []), [], vocab_size=16, eos_id=EOS)
    data = PackedTokens(path, SEQ).load(2)
    assert data.records == 20 and data.val is None
    pieces = {(5, 6, 1), (7, 1), (8, 9, 10, 11, 12), (13, 14, 1), (2, 3, 1)}
    iterator = data.train(Partition())
    batches = take(iterator, 12)
    for batch in batches:
        assert {key: (value.shape, value.dtype) for key, value in batch.items()} == {
            key: ((2, SEQ + 1), np.int32) for key in ("text", "text_segment_ids", "text_positions")}
        for text, segments, positions in zip(batch["text"], batch["text_segment_ids"], batch["text_positions"]):
            assert (text[segments == 0] == 0).all() and (positions[segments == 0] == 0).all()
            for segment in range(1, segments.max() + 1):
                assert tuple(text[segments == segment]) in pieces
                assert positions[segments == segment].tolist() == list(range((segments == segment).sum()))
    state = iterator.get_state()
    expected = take(iterator, 3)
    resumed = data.train(Partition())
    resumed.set_state(state)
    for got, want in zip(take(resumed, 3), expected):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    other = take(PackedTokens(path, SEQ, seed=1).load(2).train(Partition()), 12)
    assert any((a["text"] != b["text"]).any() for a, b in zip(batches, other))
    shares = [take(data.train(Partition(index, 2)), 2) for index in range(2)]
    assert all(batch["text"].shape == (1, SEQ + 1) for batch in itertools.chain(*shares))


def test_packed_errors(tmp_path):
    no_eos = write_files(tmp_path / "no_eos", sum(DOCUMENTS, []), [], vocab_size=16)
    with pytest.raises(ValueError, match=r"records no eos_id .* pass PackedTokens\(eos_id=...\)"):
        PackedTokens(no_eos, SEQ).load(2)
    assert PackedTokens(no_eos, SEQ, eos_id=EOS).load(2).records == 5
    with pytest.raises(ValueError, match="eos_id 16 is outside the vocabulary 0..15"):
        PackedTokens(no_eos, SEQ, eos_id=16).load(2)
    with pytest.raises(ValueError, match=r"5 documents \(split to rows\), and one batch needs 6"):
        PackedTokens(no_eos, SEQ, eos_id=EOS).load(6)
