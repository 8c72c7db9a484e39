import json
import pathlib

import huggingface_hub
import pytest

from dew.data import ByteTokenizer, HFTokenizer, load_tokenizer
from dew.data.tokenizers import tokenizer_name

GPT2 = pathlib.Path(__file__).parents[2] / "data" / "tokenizers" / "gpt2"
needs_gpt2 = pytest.mark.skipif(
    not (GPT2 / "tokenizer.json").is_file(),
    reason="data/tokenizers/gpt2/tokenizer.json is absent: `make gpt2-tokenizer` writes it",
)


@pytest.mark.parametrize("text", ["", "hello\n", "naïve café — 東京 🙂\r\n\t"])
def test_byte_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, "x"]) == [ids, [120]]


def test_byte_decode_replaces_a_cut_character():
    assert ByteTokenizer().decode("é".encode()[:1]) == "\ufffd"


def test_byte_attributes():
    tokenizer = load_tokenizer("byte")
    assert isinstance(tokenizer, ByteTokenizer)
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id) == ("byte", 256, None)


def test_hf_tokenizer_from_directory_and_file(bpe_dir, corpus):
    from_dir = HFTokenizer(bpe_dir)
    from_file = HFTokenizer(pathlib.Path(bpe_dir) / "tokenizer.json")
    assert from_dir.name == from_file.name == tokenizer_name(bpe_dir)
    assert from_dir.vocab_size == 400
    assert from_dir.eos_id == from_dir.tokenizer.token_to_id("<|endoftext|>")
    ids = from_dir.encode(corpus)
    assert ids == from_file.encode(corpus)
    assert from_dir.decode(ids) == corpus
    assert from_dir.encode_batch(["the cat", "sat"]) == [from_dir.encode("the cat"), from_dir.encode("sat")]


def test_hf_tokenizer_reads_eos_from_tokenizer_config(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((pathlib.Path(bpe_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ċ"}}))
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.eos_id == tokenizer.tokenizer.token_to_id("Ċ")


def test_load_tokenizer_returns_hf_for_a_path(bpe_dir):
    assert isinstance(load_tokenizer(bpe_dir), HFTokenizer)


def test_hub_name_is_read_from_the_local_cache(bpe_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes((pathlib.Path(bpe_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    tokenizer = HFTokenizer("org/tiny")
    assert (tokenizer.name, tokenizer.vocab_size) == ("org/tiny", 400)


def test_missing_tokenizer_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # A store with no gpt2 in it: the checkout's data/tokenizers is found from any directory.
    monkeypatch.setenv("DEW_TOKENIZERS", str(tmp_path / "store"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the download: test_tokenizer_files
    with pytest.raises(FileNotFoundError, match="make gpt2-tokenizer") as error:
        HFTokenizer("gpt2")
    assert "data/tokenizers/gpt2" in str(error.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        HFTokenizer("empty")


@needs_gpt2
def test_gpt2_ids(monkeypatch):
    monkeypatch.chdir(GPT2.parents[2])  # the bare name is found under data/tokenizers/
    tokenizer = HFTokenizer("gpt2")
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id) == ("gpt2", 50257, 50256)
    assert tokenizer.encode("Hello world") == [15496, 995]
    text = "Once upon a time<|endoftext|>  naïve 東京\n\n\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|endoftext|>") == [50256]
