"""TextStream: incremental text equals the whole decode, characters split across tokens wait, stop strings
are cut out and text that may begin one is held back. Spelling: tokens' texts and offsets index that text."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dew.data.tokenizers import ByteTokenizer
from dew.serve.engine import Scored
from dew.serve.protocol import completion_log_probs
from dew.serve.text import Spelling, TextStream

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


def _spelled(spelling, tokens):
    return [spelling.push(token) for token in tokens]


def test_spelled_tokens_index_the_text_and_a_character_goes_with_the_token_that_completes_it():
    """Each token once read "\ufffd" (a part of a character) and its offset counted tokens, not characters."""
    text = "日本語 🎉 test"
    spelled = _spelled(Spelling(BYTES.decode, BYTES.decode), BYTES.encode(text))
    tokens, offsets = zip(*spelled)
    assert "".join(tokens) == text and "\ufffd" not in "".join(tokens)
    assert tokens[:4] == ("", "", "日", "") and tokens[9:14] == (" ", "", "", "", "🎉")
    assert offsets[:4] == (0, 0, 0, 1) and offsets[9:15] == (3, 4, 4, 4, 4, 5)
    assert all(text[offset: offset + len(token)] == token for token, offset in spelled)
    continued = _spelled(Spelling(BYTES.decode, BYTES.decode, BYTES.encode(text), offset=len(text)),
                         BYTES.encode("é!"))
    assert continued == [("", len(text)), ("é", len(text)), ("!", len(text) + 1)]


def test_alternatives_read_as_the_text_they_would_add_in_the_tokens_place():
    spelling = Spelling(BYTES.decode, BYTES.decode, BYTES.encode("a"))
    assert spelling.alternative(ord("b")) == "b" and spelling.alternative(0xE6) == ""  # the first of three bytes
    _spelled(spelling, [0xE6, 0x97])
    # the last byte: each alternative completes another character, so each has a key of its own
    assert [spelling.alternative(byte) for byte in (0xA5, 0xA6, 0xA9)] == ["日", "旦", "早"]
    entries = [Scored(0xA5, -0.5, ((0xA5, -0.5), (0xA6, -1.5), (0xA9, -2.0)))]
    scores = completion_log_probs(entries, spelling)
    assert scores["tokens"] == ["日"] and scores["text_offset"] == [0]
    assert scores["top_logprobs"] == [{"日": -0.5, "旦": -1.5, "早": -2.0}]


def test_a_special_token_reads_as_itself_and_takes_no_room():
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["the quick brown fox"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    spell = lambda token: tokenizer.decode([token], skip_special_tokens=False)  # noqa: E731
    ids = tokenizer.encode("the fox").ids + [tokenizer.token_to_id("<|end|>")]
    spelled = _spelled(Spelling(decode, spell), ids)
    assert "".join(token for token, _ in spelled[:-1]) == decode(ids) == "the fox"
    assert spelled[-1] == ("<|end|>", len("the fox"))
