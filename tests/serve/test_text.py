"""TextStream: incremental text equals the whole decode, characters split across tokens wait, stop strings
are cut out and text that may begin one is held back."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dew.data.tokenizers import ByteTokenizer
from dew.serve.text import TextStream

BYTES = ByteTokenizer()


def _stream(decode, prompt, tokens, stop=()):
    stream = TextStream(decode, prompt, stop)
    pieces = []
    for token in tokens:
        if stream.stopped:
            break
        pieces.append(stream.push(token))
    pieces.append(stream.close())
    return pieces, stream


def test_pieces_join_to_the_whole_text_and_wait_inside_a_character():
    pieces, stream = _stream(BYTES.decode, BYTES.encode("ab"), BYTES.encode("héllo wörld"))
    assert "".join(pieces) == stream.text == "héllo wörld"
    assert pieces[1] == "" and pieces[2] == "é"  # the first byte of é shows nothing


@pytest.mark.parametrize("text, stop, shown", [
    ("hello STOP world", ["STOP"], "hello "),
    ("hello SSTOP x", ["STOP", "x"], "hello S"),
    ("hello STO", ["STOP"], "hello STO"),  # a partial stop string at the end is text after all
    ("one\n\ntwo", ["\n\n", "two"], "one"),
    ("no stop here", ["zzz"], "no stop here"),
])
def test_stop_strings_are_cut_out(text, stop, shown):
    pieces, stream = _stream(BYTES.decode, [], BYTES.encode(text), stop)
    assert "".join(pieces) == stream.text == shown
    assert stream.stopped == any(s in text for s in stop)


def test_held_back_text_is_shown_once_it_cannot_begin_a_stop_string():
    stream = TextStream(BYTES.decode, [], ["STOP"])
    assert [stream.push(t) for t in BYTES.encode("ST")] == ["", ""]
    assert stream.push(ord("x")) == "STx"


def test_a_bpe_continuation_streams_to_its_whole_decode():
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog, café déjà vu"] * 20,
                                  trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    decode = lambda ids: tokenizer.decode(list(ids))  # noqa: E731
    prompt = tokenizer.encode("the quick").ids
    continuation = tokenizer.encode(" brown fox, café déjà vu").ids
    pieces, stream = _stream(decode, prompt, continuation)
    assert "".join(pieces) == decode(continuation) == " brown fox, café déjà vu"
