"""The token file format: `train.bin`, `val.bin` and `meta.json` in one directory.

The .bin files hold flat token ids, native byte order, in the narrowest unsigned dtype that holds
the vocabulary: uint8 up to 256 ids, uint16 up to 65,536, else uint32. meta.json records
`{tokenizer, vocab_size, dtype, train_tokens, val_tokens, eos_id}`. `dew tokenize` writes them
(through `staging_directory` and `commit_staged`, so a directory is never left holding a mix of
two writes); readers open a split as a read-only `np.memmap`, never reading it whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dew.files import read_json, write_atomically

SPLITS = ("train", "val")
META = "meta.json"
DTYPES = ("uint8", "uint16", "uint32")
# meta.json's fields, each with what it must hold.
_META_FIELDS = {
    "tokenizer": (lambda value: isinstance(value, str), "a tokenizer name"),
    "vocab_size": (lambda value: _whole(value) and value >= 1, "a positive integer"),
    "dtype": (lambda value: isinstance(value, str) and value in DTYPES, f"one of {', '.join(DTYPES)}"),
    "train_tokens": (lambda value: _whole(value) and value >= 0, "a token count, 0 or more"),
    "val_tokens": (lambda value: _whole(value) and value >= 0, "a token count, 0 or more"),
    "eos_id": (lambda value: value is None or (_whole(value) and value >= 0), "a token id or null"),
}
_WRITER = "`dew tokenize` (tools/tokenize_text.py)"
# The id check reads a split this many tokens at a time, so its memory stays bounded.
_CHECK_TOKENS = 1 << 24
# A writer's files live in `<out>/.staging-XXXXXXXX/` until `commit_staged` moves them into `out`.
STAGING_PREFIX = ".staging-"
# A fingerprint reads this many blocks of this many bytes of each .bin file (1 MiB), or the whole file.
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 256, 4096


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids 0..vocab_size-1."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size is {vocab_size}: a vocabulary needs at least one id")
    for name in DTYPES:
        if vocab_size <= np.iinfo(name).max + 1:
            return np.dtype(name)
    raise ValueError(f"vocab_size {vocab_size} is above {2**32}, the most a uint32 token file holds")


def split_path(path: str | os.PathLike, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    return Path(path) / f"{split}.bin"


def make_meta(tokenizer: str, vocab_size: int, train_tokens: int, val_tokens: int,
              eos_id: int | None) -> dict[str, Any]:
    """The meta.json record for a pair of token files."""
    return {
        "tokenizer": tokenizer,
        "vocab_size": int(vocab_size),
        "dtype": dtype_for_vocab(vocab_size).name,
        "train_tokens": int(train_tokens),
        "val_tokens": int(val_tokens),
        "eos_id": None if eos_id is None else int(eos_id),
    }


def write_meta(path: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Write meta.json atomically (a partial file is never visible under the final name)."""
    return write_atomically(Path(path) / META, json.dumps(meta, indent=2) + "\n")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check meta.json against itself and the .bin files beside it.

    Raises FileNotFoundError when meta.json is missing and ValueError when it is not JSON (cut
    short), a field is missing or of the wrong kind, the dtype is unknown or does not fit the
    vocabulary, a .bin file's size disagrees with its token count, or a .bin file holds an id
    outside the vocabulary (`check_ids`).
    """
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path} does not exist: token files are a directory holding train.bin, val.bin "
            f"and meta.json, written by `dew tokenize --input TEXT --out {path} --tokenizer NAME` "
            f"(or tools/tokenize_text.py)"
        )
    meta, problem = read_json(meta_path, object_only=True)
    if problem is not None:
        raise ValueError(f"{meta_path} {problem}: it was cut short or damaged; rewrite the token files with {_WRITER}")
    missing = [field for field in _META_FIELDS if field not in meta]
    if missing:
        raise ValueError(f"{meta_path} lacks {missing}: rewrite the token files with {_WRITER}")
    for field, (accepts, words) in _META_FIELDS.items():
        if not accepts(meta[field]):
            raise ValueError(f"{meta_path} gives {field} {meta[field]!r}, which is not {words}: the file was edited or "
                             f"damaged; rewrite the token files with {_WRITER}")
    expected = dtype_for_vocab(meta["vocab_size"]).name
    if meta["dtype"] != expected:
        raise ValueError(
            f"{meta_path} gives dtype {meta['dtype']} for vocab_size {meta['vocab_size']}, which "
            f"needs {expected}: rewrite the token files with {_WRITER}"
        )
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        bin_path = split_path(path, split)
        tokens = meta[f"{split}_tokens"]
        size = bin_path.stat().st_size if bin_path.is_file() else None
        if size is not None and size % itemsize:
            raise ValueError(
                f"{bin_path} holds {size} bytes, not a whole number of {meta['dtype']} tokens "
                f"({itemsize} bytes each), and meta.json says {split}_tokens = {tokens} "
                f"({tokens * itemsize} bytes): a write was cut short or the file is damaged; "
                f"rewrite it with {_WRITER}"
            )
        if size != tokens * itemsize:
            found = "does not exist" if size is None else (
                f"holds {size} bytes = {size / itemsize:g} {meta['dtype']} tokens")
            raise ValueError(
                f"{bin_path} {found}, but meta.json says {split}_tokens = {tokens} "
                f"({tokens * itemsize} bytes): the files are from different runs or a write was "
                f"cut short; rewrite them with {_WRITER}"
            )
    for split in SPLITS:
        check_ids(path, split, meta)
    return meta


def check_ids(path: str | os.PathLike, split: str, meta: dict[str, Any]) -> None:
    """Refuse a split holding an id at or above meta.json's vocab_size, naming the first one.

    One vectorised pass over the memmap, `_CHECK_TOKENS` tokens at a time, at about memory
    bandwidth; the ids are unsigned, so none is below 0. A dtype that holds no id outside the
    vocabulary (vocab_size 256 in uint8, 65,536 in uint16) needs no pass.
    """
    vocab_size = meta["vocab_size"]
    tokens = open_split(path, split, meta)
    if vocab_size > np.iinfo(tokens.dtype).max:
        return
    for start in range(0, tokens.size, _CHECK_TOKENS):
        block = tokens[start:start + _CHECK_TOKENS]
        if block.max() >= vocab_size:
            index = start + int(np.argmax(block >= vocab_size))
            raise ValueError(
                f"{split_path(path, split)} holds token id {tokens[index]} at token {index:,} (byte "
                f"offset {index * tokens.itemsize:,}), outside vocab_size {vocab_size} from "
                f"meta.json: the file is damaged or was not written with tokenizer "
                f"{meta['tokenizer']!r}; rewrite it with `dew tokenize --input TEXT --out {path} "
                f"--tokenizer {meta['tokenizer']}`"
            )


def fingerprint(path: str | os.PathLike, meta: dict[str, Any]) -> str:
    """A hash that tells these token files from others, cheap for files of any size: 32 hex digits.

    It hashes meta.json's record (`meta`), each .bin file's size, and 256 blocks of 4 KiB of each
    .bin file at evenly spaced offsets from its first byte to its last (the whole file when it is
    1 MiB or less), so it reads at most 2 MiB. It catches other meta.json counts or tokenizer, other
    sizes, any change to a file of up to 1 MiB, and a replacement by other data of the same size
    (other text, or the same text tokenized or split another way, differs in nearly every block).
    It cannot catch a change confined to the bytes between the blocks of a larger file, such as a
    few documents edited in place.
    """
    digest = hashlib.blake2b(json.dumps(meta, sort_keys=True).encode(), digest_size=16)
    for split in SPLITS:
        with open(split_path(path, split), "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(f"{split}.bin {size}\n".encode())
            if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
                offsets = range(0, size, FINGERPRINT_BLOCK)
            else:
                last = size - FINGERPRINT_BLOCK
                offsets = (last * index // (FINGERPRINT_BLOCKS - 1) for index in range(FINGERPRINT_BLOCKS))
            for offset in offsets:
                digest.update(os.pread(handle.fileno(), FINGERPRINT_BLOCK, offset))
    return digest.hexdigest()


def open_split(path: str | os.PathLike, split: str, meta: dict[str, Any] | None = None) -> np.ndarray:
    """One split's token ids as a read-only memmap, shape [tokens], meta.json's dtype.

    `meta` is read (and checked) from `path` when not given. An empty split is an empty array,
    since a zero-length file cannot be mapped.
    """
    meta = read_meta(path) if meta is None else meta
    tokens = meta[f"{split}_tokens"]
    if tokens == 0:
        return np.empty(0, dtype=meta["dtype"])
    return np.memmap(split_path(path, split), dtype=meta["dtype"], mode="r", shape=(tokens,))


def _flock(path: Path, flags: int) -> int | None:
    """An open descriptor of `path` holding `flock(flags)`, or None when another process holds it.

    The kernel drops the lock when its process dies, however it dies, which is what tells a
    live writer's staging directory from one a killed writer abandoned.
    """
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, flags)
    except BlockingIOError:
        os.close(descriptor)
        return None
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def remove_abandoned_staging(out: Path) -> list[Path]:
    """Delete the staging directories in `out` that killed writers left; returns them.

    A live writer holds a lock on its own staging directory, so one still writing is left alone.
    """
    removed = []
    for staging in sorted(out.glob(STAGING_PREFIX + "*")):
        try:
            descriptor = _flock(staging, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile by another process, or not one of ours
        if descriptor is not None:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                removed.append(staging)
            finally:
                os.close(descriptor)
    return removed


@contextlib.contextmanager
def staging_directory(out: str | os.PathLike) -> Iterator[Path]:
    """A fresh, locked directory inside `out` to write a new set of token files in.

    Inside `out` rather than beside it, so it is on the same filesystem even when `out` is a
    mount point, and `commit_staged` can rename its files into place. Leaving the block removes
    it with whatever it still holds; one whose process was killed is removed by the next call
    (`remove_abandoned_staging`).
    """
    out = Path(out)
    remove_abandoned_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    descriptor = _flock(staging, fcntl.LOCK_EX)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(descriptor)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def commit_staged(staging: Path, out: Path) -> None:
    """Move the complete train.bin, val.bin and meta.json in `staging` into `out`, replacing its own.

    The files reach the disk before they are renamed, so a power cut never leaves a renamed but
    empty file. The old meta.json goes first and the new one comes last: in between, for the few
    renames this takes, a reader finds no meta.json and refuses the directory rather than reading
    new .bin files beside the old counts. SIGINT and SIGTERM wait until the renames are done, and
    two writers to one `out` commit one at a time.
    """
    names = [split_path(staging, split).name for split in SPLITS]
    for name in (*names, META):
        _fsync(staging / name)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    out_lock = _flock(out, fcntl.LOCK_EX)
    try:
        (out / META).unlink(missing_ok=True)
        for name in names:
            os.replace(staging / name, out / name)
        os.replace(staging / META, out / META)
        _fsync(out)
    finally:
        os.close(out_lock)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
