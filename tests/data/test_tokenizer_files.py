"""Finding and reading tokenizer files: damaged files named, and names resolved the same from anywhere."""

import os
import pathlib
import shutil

import huggingface_hub
import pytest
from huggingface_hub.utils import httpx

import dew
from dew.data import HFTokenizer
from dew.data import tokenizers as tokenizers_module
from dew.data.tokenizers import same_tokenizer, tokenizer_file, tokenizer_name, tokenizer_store

GPT2 = pathlib.Path(dew.__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": ', b'{"version": "1.0"}', b"\xff\xfe", b""])
def test_a_damaged_tokenizer_json_is_named(tmp_path, content):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=(
            rf"^{tmp_path / 'tokenizer.json'} is not a valid tokenizer.json \(.+\): the file is damaged.*"
            r"delete it and recreate it \(for GPT-2, `make gpt2-tokenizer`\)")) as error:
        HFTokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_damaged_tokenizer_config_is_named(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((pathlib.Path(bpe_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'tokenizer_config.json'} is not a valid tokenizer_config.json"):
        HFTokenizer(tmp_path)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A store of one tokenizer ("tiny", a copy of the BPE) in $DEW_TOKENIZERS, no Hugging Face
    cache, and a working directory that holds neither."""
    monkeypatch.setenv("DEW_TOKENIZERS", str(tmp_path / "store"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def _store(root, name, bpe_dir):
    (root / "store" / name).mkdir(parents=True)
    shutil.copy(pathlib.Path(bpe_dir) / "tokenizer.json", root / "store" / name / "tokenizer.json")
    return root / "store" / name / "tokenizer.json"


def test_the_store_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("DEW_TOKENIZERS", raising=False)
    checkout = pathlib.Path(dew.__file__).resolve().parents[1]
    assert tokenizer_store() == checkout / "data" / "tokenizers"  # the tests run from a checkout
    monkeypatch.setattr(tokenizers_module, "_CHECKOUT", tmp_path / "site-packages")  # a wheel install
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert tokenizer_store() == tmp_path / "cache" / "dew" / "tokenizers"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEW_TOKENIZERS", "mine")  # made absolute from where it is read
    assert tokenizer_store() == tmp_path / "mine"


def test_a_name_resolves_in_the_store_from_any_directory(elsewhere, bpe_dir):
    stored = _store(elsewhere, "tiny", bpe_dir)
    tokenizer = HFTokenizer("tiny")
    assert (tokenizer.name, tokenizer.path, tokenizer.vocab_size) == ("tiny", stored, 400)
    assert tokenizer_file("tiny") == stored and tokenizer_file("byte") is None
    assert tokenizer_name("tiny") == "tiny"
    # "tiny" and its store directory name one tokenizer; the BPE it was copied from has its bytes.
    assert same_tokenizer("tiny", stored.parent) and same_tokenizer(bpe_dir, "tiny")
    assert not same_tokenizer("tiny", "byte") and not same_tokenizer("tiny", "absent")


def test_a_relative_path_is_recorded_absolute(elsewhere, bpe_dir):
    shutil.copytree(bpe_dir, elsewhere / "elsewhere" / "tok")
    absolute = str(elsewhere / "elsewhere" / "tok")
    names = {tokenizer_name(spelling) for spelling in ("tok", "./tok/", "tok/tokenizer.json", absolute)}
    assert names == {absolute}
    assert HFTokenizer("./tok/").name == absolute and tokenizer_file("tok") == pathlib.Path(absolute, "tokenizer.json")
    os.chdir(elsewhere)  # the recorded name still means the same files from another directory
    assert HFTokenizer(absolute).path == pathlib.Path(absolute, "tokenizer.json")
    # A path that does not exist normalises the same way however it is spelled.
    assert tokenizer_name("./tok_byte/") == tokenizer_name("tok_byte") == "tok_byte"


def test_a_missing_tokenizer_says_where_dew_looked(elsewhere, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError) as error:
        HFTokenizer("gpt2")
    message = str(error.value)
    for part in (f"working directory {elsewhere / 'elsewhere'}", str(elsewhere / "store" / "gpt2" / "tokenizer.json"),
                 "$DEW_TOKENIZERS, else the checkout's data/tokenizers, else ~/.cache/dew/tokenizers",
                 "(3) the Hugging Face cache, (4) the Hub: not asked, since HF_HUB_OFFLINE is set", "make gpt2-tokenizer"):
        assert part in message
    with pytest.raises(FileNotFoundError, match=rf"tokenizer path ./tok does not exist .* it is {elsewhere / 'elsewhere' / 'tok'}"):
        tokenizer_file("./tok")
    with pytest.raises(ValueError, match="ByteTokenizer"):
        HFTokenizer("byte")


@pytest.mark.skipif(not (GPT2 / "tokenizer.json").is_file(), reason="`make gpt2-tokenizer` writes GPT-2's tokenizer")
def test_gpt2_is_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("DEW_TOKENIZERS", raising=False)
    monkeypatch.chdir(tmp_path)
    tokenizer = HFTokenizer("gpt2")
    assert (tokenizer.name, tokenizer.path) == ("gpt2", GPT2 / "tokenizer.json")
    assert same_tokenizer("gpt2", GPT2)


def _answer(status: int):
    """The Hub's HTTP answer an error of huggingface_hub carries."""
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/org/tiny"))


def test_a_hub_name_downloads_its_tokenizer(elsewhere, bpe_dir, monkeypatch):
    """A name found nowhere locally is fetched from the Hub into huggingface_hub's cache, with its
    tokenizer_config.json (the EOS token's name); the Hub is mocked by a download that serves the BPE."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    commit = "c" * 40
    snapshot = elsewhere / "hub-cache" / "models--org--tiny" / "snapshots" / commit
    calls = []

    def download(repo_id, filename, *, revision=None, **options):
        calls.append((repo_id, filename, revision))
        source = pathlib.Path(bpe_dir) / filename
        if filename == "tokenizer_config.json":
            source = elsewhere / "config.json"
            source.write_text('{"eos_token": "e"}')  # not one of the names Dew tries without it
        if not source.is_file():
            raise huggingface_hub.errors.RemoteEntryNotFoundError(f"{repo_id} has no {filename}", response=_answer(404))
        snapshot.mkdir(parents=True, exist_ok=True)
        return str(shutil.copy(source, snapshot / filename))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    tokenizer = HFTokenizer("org/tiny@v1")
    assert calls == [("org/tiny", "tokenizer.json", "v1"), ("org/tiny", "tokenizer_config.json", commit),
                     ("org/tiny", "chat_template.jinja", commit)]
    assert (tokenizer.name, tokenizer.path, tokenizer.vocab_size) == ("org/tiny@v1", snapshot / "tokenizer.json", 400)
    assert tokenizer.eos_id == tokenizer.tokenizer.token_to_id("e") is not None
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    # What the Hub lacks, or a Hub that does not answer, is named; HF_HUB_OFFLINE asks nothing.
    def missing(repo_id, filename, **options):
        raise huggingface_hub.errors.RepositoryNotFoundError(f"no {repo_id}", response=_answer(401))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    with pytest.raises(FileNotFoundError, match=r"\(4\) the Hub: it has no repository org/absent \(or it is private\)"):
        HFTokenizer("org/absent")

    def unreachable(repo_id, filename, **options):
        raise huggingface_hub.errors.LocalEntryNotFoundError("connection refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(ConnectionError, match=r"could not be reached for org/other's tokenizer.json \(connection "
                                              r"refused\), and it is not in the cache"):
        HFTokenizer("org/other")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not asked, since HF_HUB_OFFLINE is set"):
        HFTokenizer("org/other")
