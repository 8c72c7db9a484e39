"""Tokenizers: text to token ids and back, on the host.

`ByteTokenizer` treats UTF-8 bytes as ids (vocabulary 256). `HFTokenizer` wraps a Hugging Face
`tokenizers.Tokenizer` read from a local `tokenizer.json`; it never downloads. Neither adds
special tokens, so the ids of a corpus's chunks, cut where the tokenizer ends a piece anyway,
concatenate to the ids of the whole corpus (what `tokenize_text` relies on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError

BYTE = "byte"

# Where `make gpt2-tokenizer` (tools/fetch_gpt2_tokenizer.py) writes tokenizer files: a bare name
# such as "gpt2" is found here when the working directory is a repository checkout.
LOCAL_TOKENIZERS = Path("data/tokenizers")

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


def tokenizer_name(name_or_path: str | os.PathLike) -> str:
    """The name meta.json records for a tokenizer: "byte", a hub name, or a normalised path.

    A `tokenizer.json` file and the directory holding it name the same tokenizer, so a file path
    is recorded as its directory.
    """
    name = os.path.normpath(os.fspath(name_or_path))
    if os.path.basename(name) == "tokenizer.json":
        name = os.path.dirname(name) or "."
    return name


def _missing_message(name: str) -> str:
    return (
        f"no tokenizer.json for {name!r}: it is not a tokenizer.json file, a directory holding one, "
        f"{LOCAL_TOKENIZERS / name}, or a Hugging Face cache entry (Dew never downloads it). "
        f"For GPT-2 run `make gpt2-tokenizer`, which writes {LOCAL_TOKENIZERS}/gpt2/tokenizer.json "
        f'for HFTokenizer("gpt2") or HFTokenizer("{LOCAL_TOKENIZERS}/gpt2"); for another model, '
        f"copy its tokenizer.json into a directory and pass that path"
    )


def _find_tokenizer_file(name: str) -> Path:
    """The tokenizer.json that `name` refers to, looked up offline."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise FileNotFoundError(
            f"directory {path} holds no tokenizer.json: Dew reads a Hugging Face tokenizer from its "
            f"tokenizer.json (a slow tokenizer's vocab.json/merges.txt alone is not enough)"
        )
    if (LOCAL_TOKENIZERS / name / "tokenizer.json").is_file():
        return LOCAL_TOKENIZERS / name / "tokenizer.json"
    try:
        cached = try_to_load_from_cache(repo_id=name, filename="tokenizer.json")
    except HFValidationError:  # not a hub repository id, so it cannot be in the cache
        cached = None
    if isinstance(cached, str):
        return Path(cached)
    raise FileNotFoundError(_missing_message(name))


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
    """A Hugging Face `tokenizers.Tokenizer` read from a local tokenizer.json.

    `name_or_path` is a tokenizer.json file, a directory holding one, or a hub name ("gpt2"),
    which is looked up as a local directory, then under data/tokenizers/, then in the Hugging Face
    cache with local files only. `vocab_size` counts added tokens; `eos_id` is the EOS token named by
    tokenizer_config.json or, failing that, `<|endoftext|>` / `</s>` / `<eos>` / `<|end_of_text|>`
    when the vocabulary has one, else None. `encode` adds no special tokens.
    """

    def __init__(self, name_or_path: str | os.PathLike):
        self.name = tokenizer_name(name_or_path)
        self.path = _find_tokenizer_file(os.fspath(name_or_path))
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
