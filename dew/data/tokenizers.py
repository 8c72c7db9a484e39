"""Tokenizers: text to token ids and back, on the host.

`ByteTokenizer` treats UTF-8 bytes as ids (vocabulary 256). `HFTokenizer` wraps a Hugging Face
`tokenizers.Tokenizer` read from a `tokenizer.json`: a local one, or a Hub repository's, which
huggingface_hub downloads into its cache once. Neither adds special tokens, so the ids of a corpus's
chunks, cut where the tokenizer ends a piece anyway, concatenate to the ids of the whole corpus (what
`tokenize_text` relies on). `tokenizer_file` finds the tokenizer.json a name or path means, the same
from any working directory.
"""

from __future__ import annotations

import filecmp
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# huggingface_hub and its utils import their names at first use: a local tokenizer.json reads none of its client,
# which imports httpx, so its names below are read as a Hub name is looked up.
import huggingface_hub
import tokenizers
from huggingface_hub import constants
from huggingface_hub import utils as hub_utils

BYTE = "byte"
TOKENIZER_JSON = "tokenizer.json"
# Files a Hub tokenizer brings beside its tokenizer.json when the repository has them: the EOS token's
# name, and the chat template transformers writes apart.
_HUB_COMPANIONS = ("tokenizer_config.json", "chat_template.jinja")

# The Dew checkout this package runs from when it is installed editable (its pyproject.toml is
# there); `make gpt2-tokenizer` writes its data/tokenizers/gpt2/.
_CHECKOUT = Path(__file__).resolve().parents[2]

# Tokens that end a document in common vocabularies, tried in this order when no
# tokenizer_config.json names the EOS token.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


class Tokenizer(Protocol):
    """What the data tools need from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: `vocab_size` 256, no EOS token."""

    name = BYTE
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # A window can start or end inside a multi-byte character; replace rather than fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def tokenizer_store() -> Path:
    """The Dew tokenizer store, where a name such as "gpt2" is <store>/gpt2/tokenizer.json.

    `$DEW_TOKENIZERS` when set; else data/tokenizers of the Dew checkout this package is installed
    from (editable), where `make gpt2-tokenizer` writes; else `$XDG_CACHE_HOME/dew/tokenizers`
    (~/.cache/dew/tokenizers). None depends on the working directory, and it need not exist yet.
    """
    if os.environ.get("DEW_TOKENIZERS"):
        return Path(os.path.abspath(os.path.expanduser(os.environ["DEW_TOKENIZERS"])))
    if (_CHECKOUT / "pyproject.toml").is_file():
        return _CHECKOUT / "data" / "tokenizers"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dew" / "tokenizers"


def _looks_like_path(text: str) -> bool:
    """Whether `text` can only be a path: absolute, from ~ or ., or ending in / or .json."""
    return (os.path.isabs(text) or text.startswith(("~", "./", "../")) or text in (".", "..")
            or text.endswith(("/", os.sep, ".json")))


def tokenizer_name(name_or_path: str | os.PathLike) -> str:
    """The name meta.json and run.json record for a tokenizer, the same from any directory.

    "byte"; for an existing file or directory, its absolute path (a `tokenizer.json` file is
    recorded as its directory), so "./tok/", "tok" and "tok/tokenizer.json" record one name that
    still means the same files from elsewhere; otherwise the name as given, normalised ("gpt2",
    "org/model"), which `tokenizer_file` looks up in the store and the Hugging Face cache.
    """
    text = os.fspath(name_or_path)
    if text == BYTE:
        return BYTE
    path = os.path.expanduser(text)
    name = os.path.abspath(path) if os.path.exists(path) else os.path.normpath(text)
    if os.path.basename(name) == "tokenizer.json":
        name = os.path.dirname(name) or "."
    return name


def _missing_message(name: str, hub: str) -> str:
    store = tokenizer_store()
    return (
        f"no tokenizer.json for {name!r}: Dew looked for (1) a file or directory {name!r} in the "
        f"working directory {os.getcwd()}, (2) {store / name / 'tokenizer.json'} in the Dew "
        f"tokenizer store ($DEW_TOKENIZERS, else the checkout's data/tokenizers, else "
        f"~/.cache/dew/tokenizers), (3) the Hugging Face cache, (4) the Hub: {hub}. "
        f"Pass the path of a directory holding the tokenizer.json, or copy it into {store / 'NAME'}/; "
        f"for GPT-2 offline, `make gpt2-tokenizer` in the Dew checkout writes data/tokenizers/gpt2/tokenizer.json"
    )


def _hub_repository(text: str) -> tuple[str, str | None] | None:
    """`(repo, revision)` of a name that reads as a Hub repository id (`name`, `owner/name`, either with
    `@revision`); None for anything else."""
    repo, _, revision = text.partition("@")
    try:
        hub_utils.validate_repo_id(repo)
    except hub_utils.HFValidationError:
        return None
    return repo, revision or None


def _download(name: str, repo: str, revision: str | None) -> Path:
    """The Hub repository's tokenizer.json (and its companions, when it has them) through huggingface_hub's
    cache; refused with where Dew looked when the Hub is off (HF_HUB_OFFLINE), lacks it, or is unreachable."""
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(_missing_message(name, "not asked, since HF_HUB_OFFLINE is set (unset it to "
                                                       "download the tokenizer once)"))
    named = f"{repo}{'@' + revision if revision else ''}"
    try:
        path = Path(huggingface_hub.hf_hub_download(repo, TOKENIZER_JSON, revision=revision))
    except hub_utils.GatedRepoError:
        raise FileNotFoundError(_missing_message(name, f"{named} is gated: accept its terms on the Hub and log in "
                                                       "(hf auth login)")) from None
    except hub_utils.RepositoryNotFoundError:
        raise FileNotFoundError(_missing_message(name, f"it has no repository {repo} (or it is private)")) from None
    except hub_utils.RevisionNotFoundError:
        raise FileNotFoundError(_missing_message(name, f"{repo} has no revision {revision}")) from None
    except hub_utils.LocalEntryNotFoundError as error:  # the Hub did not answer, and the cache lacks the file
        raise ConnectionError(f"the Hugging Face Hub ({constants.ENDPOINT}) could not be reached for {named}'s "
                              f"{TOKENIZER_JSON} ({error}), and it is not in the cache {constants.HF_HUB_CACHE}: check "
                              "the network (or HF_ENDPOINT), or pass a local tokenizer directory") from None
    except hub_utils.EntryNotFoundError:
        raise FileNotFoundError(_missing_message(name, f"{named} holds no {TOKENIZER_JSON} (a slow tokenizer's "
                                                       "vocab.json/merges.txt alone is not enough)")) from None
    commit = path.parent.name  # the cache keeps each file under snapshots/<commit>/: the companions match it
    for companion in _HUB_COMPANIONS:
        try:
            huggingface_hub.hf_hub_download(repo, companion, revision=commit)
        except hub_utils.EntryNotFoundError:
            pass
    return Path(os.path.abspath(path))


def tokenizer_file(name_or_path: str | os.PathLike) -> Path | None:
    """The absolute path of the tokenizer.json `name_or_path` means; None for "byte".

    Looked up in this order: an existing tokenizer.json file or a directory holding one (a
    relative path is made absolute at once, from the working directory); then
    <tokenizer_store()>/<name>/tokenizer.json; then the Hugging Face cache; then, for a Hub
    repository id (`name`, `owner/name`, either with `@revision`), the Hub, through huggingface_hub
    (with `HF_HUB_OFFLINE` set, never). A name found nowhere, or a path that does not exist, is a
    FileNotFoundError saying where Dew looked and how to get the file; a Hub that does not answer,
    a ConnectionError.
    """
    text = os.fspath(name_or_path)
    if text == BYTE:
        return None
    path = Path(os.path.abspath(os.path.expanduser(text)))
    if path.is_file():
        return path
    if path.is_dir():
        if (path / TOKENIZER_JSON).is_file():
            return path / TOKENIZER_JSON
        raise FileNotFoundError(
            f"directory {path} holds no tokenizer.json: Dew reads a Hugging Face tokenizer from its "
            f"tokenizer.json (a slow tokenizer's vocab.json/merges.txt alone is not enough)"
        )
    if _looks_like_path(text):
        raise FileNotFoundError(
            f"tokenizer path {text} does not exist (from the working directory {os.getcwd()}, it "
            f"is {path}): pass the tokenizer.json, or the directory holding it"
        )
    stored = tokenizer_store() / text / TOKENIZER_JSON
    if stored.is_file():
        return stored
    hub = _hub_repository(text)
    if hub is None:
        raise FileNotFoundError(_missing_message(text, "not asked, since the name is not a Hub repository id"))
    repo, revision = hub
    cached = huggingface_hub.try_to_load_from_cache(repo_id=repo, filename=TOKENIZER_JSON, revision=revision)
    if isinstance(cached, str):
        return Path(os.path.abspath(cached))
    return _download(text, repo, revision)


def same_tokenizer(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Whether two tokenizer names or paths mean one tokenizer: the same recorded name, or two
    tokenizer.json files with the same bytes (as "gpt2" and the path of its store directory)."""
    if tokenizer_name(first) == tokenizer_name(second):
        return True
    try:
        files = tokenizer_file(first), tokenizer_file(second)
    except OSError:  # not found anywhere, or the Hub did not answer
        return False
    return None not in files and filecmp.cmp(*files, shallow=False)


def _damaged(path: Path, reason: object) -> ValueError:
    reason = str(reason).strip().splitlines()[0] if str(reason).strip() else type(reason).__name__
    return ValueError(
        f"{path} is not a valid {path.name} ({reason}): the file is damaged or is not a Hugging "
        f"Face tokenizer file; delete it and recreate it (for GPT-2, `make gpt2-tokenizer`), or "
        f"copy the model's {path.name} again"
    )


def _read_tokenizer_file(path: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception that names no file
        raise _damaged(path, error) from None


def _eos_id(tokenizer: tokenizers.Tokenizer, directory: Path) -> int | None:
    """The id of the end-of-document token: tokenizer_config.json's eos_token, else a known name."""
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            settings = json.loads(config.read_text(encoding="utf-8"))
        except ValueError as error:  # not JSON, or not UTF-8
            raise _damaged(config, error) from None
        eos = settings.get("eos_token") if isinstance(settings, dict) else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return tokenizer.token_to_id(eos)
    for token in _EOS_NAMES:
        if (token_id := tokenizer.token_to_id(token)) is not None:
            return token_id
    return None


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from a tokenizer.json.

    `name_or_path` is a tokenizer.json file, a directory holding one, or a name ("gpt2",
    "org/model", "org/model@revision"), found the same from any working directory
    (`tokenizer_file`): first as an existing path, then as <store>/<name>/tokenizer.json in the Dew
    tokenizer store (`$DEW_TOKENIZERS`, else the checkout's data/tokenizers, else
    ~/.cache/dew/tokenizers), then in the Hugging Face cache, then downloaded from the Hub into that
    cache (not with `HF_HUB_OFFLINE` set). `name` is what meta.json records
    (`tokenizer_name`) and `path` the absolute tokenizer.json read. `vocab_size` counts added
    tokens; `eos_id` is the EOS token named by tokenizer_config.json or, failing that,
    `<|endoftext|>` / `</s>` / `<eos>` / `<|end_of_text|>` when the vocabulary has one, else None.
    `encode` adds no special tokens.
    """

    def __init__(self, name_or_path: str | os.PathLike):
        self.name = tokenizer_name(name_or_path)
        path = tokenizer_file(name_or_path)
        if path is None:
            raise ValueError(f"{BYTE!r} is ByteTokenizer(), not a Hugging Face tokenizer: use "
                             f"load_tokenizer({BYTE!r}) or ByteTokenizer()")
        self.path = path
        self.tokenizer = _read_tokenizer_file(self.path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = _eos_id(self.tokenizer, self.path.parent)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    """`ByteTokenizer()` for "byte", else `HFTokenizer(name)`."""
    return ByteTokenizer() if name == BYTE else HFTokenizer(name)
