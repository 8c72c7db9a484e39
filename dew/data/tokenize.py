"""Text to token files: the logic behind `dew tokenize` and tools/tokenize_text.py.

The input is text files, read in ~1 MiB chunks cut at line ends, or record files (JSON Lines, Parquet,
`datasets` directories: `dew.data.record_files`), read ~1 MiB of documents at a time, each document one
string field of a record, EOS between documents; a longer document is cut at line ends as a text file is. A
pool of worker processes tokenizes the chunks in order, and the ids are appended to a file as they come, so
memory stays bounded whatever the corpus and document sizes: text with no line end to cut at for more than
`MAX_UNCUT_CHARS` characters is refused, since a tokenizer holds some 150 bytes per character it is given. The
first `val_fraction` of the tokens becomes val.bin and the rest train.bin. Everything is written in
a staging directory and swapped into `--out` only when complete (see `token_files.commit_staged`),
so a run that fails or is stopped leaves the token files already there as they were.
"""

from __future__ import annotations

import collections
import codecs
import contextlib
import errno
import itertools
import json
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from dew.data.record_files import (DECOMPRESSION_ERRORS, RECORD_SUFFIXES, Position, is_datasets_directory,
                                   is_record_file, open_binary, stored_size, texts)
from dew.data.token_files import (META, SPLITS, commit_staged, dtype_for_vocab, make_meta, split_path,
                                  staging_directory, write_meta)
from dew.data.tokenizers import Tokenizer, load_tokenizer

CHUNK_BYTES = 1 << 20
TEXT_SUFFIXES = (".txt", ".txt.xz", ".txt.gz")
_COPY_BYTES = 64 << 20
# Text this many chunks long with no strict cut is cut at a loose one (see `cut_at_line_ends`).
_LOOSE_AFTER = 16
# The longest text given to a tokenizer whole, without a line end it can be cut at (see `cut_at_line_ends`).
MAX_UNCUT_CHARS = 8 << 20
DEFAULT_FIELD = "text"


def input_files(input: str | os.PathLike) -> list[Path]:
    """The sources to read: `input` itself (a file or a `datasets` directory), or every text file (*.txt,
    .txt.xz, .txt.gz) and record file (*.jsonl, .jsonl.gz, .jsonl.xz, *.parquet) under it, sorted."""
    if os.fspath(input) == "":
        raise ValueError("input is an empty path, which would read every text file under the current directory: "
                         "name the text file or directory to tokenize (--input)")
    path = Path(input)
    if path.is_file() or is_datasets_directory(path):
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"input {path} is neither a file nor a directory")
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not files:
        raise FileNotFoundError(f"directory {path} holds no {' / '.join(suffixes)} files, nor is it a datasets "
                                "directory (Dataset.save_to_disk's, with state.json)")
    return files


class _InputRead:
    """How much of the input has been read, in bytes as stored (compressed for .xz/.gz)."""

    def __init__(self, files: list[Path]):
        self.total = sum(stored_size(path) for path in files)
        self.finished = 0  # bytes of the files read to the end
        self.current: IO[bytes] | None = None

    @property
    def bytes(self) -> int:
        current = self.current
        return self.finished + (current.tell() if current is not None and not current.closed else 0)


def _last_cut(text: str, start: int = 0, strict: bool = True) -> int:
    """The position after the last newline in `text[start:]` that can end a chunk, or -1.

    A strict cut is a newline between two non-space characters ("...end.\\nNext"). Every common
    pre-tokenizer ends a piece there whether or not the text goes on: byte-level BPE with the
    GPT-2, cl100k, Llama 3 or Qwen patterns, and tokenizers that split at newlines. Elsewhere they
    may not: at the end of a chunk GPT-2 makes "\\n\\n" one piece, followed by text it makes two.
    A loose cut only needs a non-space character after the newline.
    """
    end = len(text) - 1  # the newline needs a character after it to be judged
    while (newline := text.rfind("\n", start, end)) >= 0:
        if not text[newline + 1].isspace() and (
                not strict or (newline > 0 and not text[newline - 1].isspace())):
            return newline + 1
        end = newline
    return -1


def _read(stream: IO[bytes], size: int, name: str, offset: int) -> bytes:
    """Up to `size` bytes of `stream`; a damaged compressed stream is a ValueError naming `name`."""
    try:
        return stream.read(size)
    except DECOMPRESSION_ERRORS as error:
        after = f" after {offset:,} bytes of text" if offset else ""
        raise ValueError(
            f"{name} is truncated or corrupt: decompressing it failed{after} ({error}); copy or "
            f"download it again, or check it with `xz -t` / `gzip -t`"
        ) from None


def cut_at_line_ends(blocks: Iterator[str], chunk_bytes: int, name: str) -> Iterator[str]:
    """The text of `blocks`, joined and cut again into pieces of about `chunk_bytes` characters, each cut at
    a line end.

    Pieces end at strict cuts (see `_last_cut`), so tokenizing them one by one gives the ids of the whole
    text. Text with no strict cut for `_LOOSE_AFTER` chunks or `MAX_UNCUT_CHARS` characters (a file with CRLF
    line ends, where every newline follows a "\\r") is cut at a loose one instead, to keep memory bounded; a
    tokenizer may then split the whitespace at that cut differently. Past `MAX_UNCUT_CHARS` characters without
    even a loose cut, the text is refused naming `name`. The pieces concatenate to the whole text.
    """
    pending = ""
    searched = 0  # pending[:searched] holds no strict cut
    done = 0  # characters yielded so far
    for block in blocks:
        pending += block
        # Only the new text and a newline just before it can hold a new strict cut.
        cut = _last_cut(pending, max(0, searched - 1))
        if cut < 0 and len(pending) > min(_LOOSE_AFTER * chunk_bytes, MAX_UNCUT_CHARS):
            cut = _last_cut(pending, strict=False)
            if cut < 0 and len(pending) > MAX_UNCUT_CHARS:
                raise ValueError(
                    f"{name} holds {len(pending):,} characters, from character {done:,} on, without a line end "
                    f"(a newline followed by a non-space character), and Dew gives a tokenizer at most "
                    f"{MAX_UNCUT_CHARS:,} at once (it holds some 150 bytes per character): break the text into "
                    "lines, or into several documents, where a tokenizer's pieces end anyway"
                )
        if cut > 0:
            yield pending[:cut]
            pending = pending[cut:]
            done += cut
        searched = len(pending)
    if pending:
        yield pending


def text_chunks(stream: IO[bytes], chunk_bytes: int = CHUNK_BYTES,
                name: str = "input") -> Iterator[str]:
    """UTF-8 text from `stream` in pieces of about `chunk_bytes`, each cut at a line end
    (`cut_at_line_ends`). Text that is not UTF-8, and a truncated or damaged compressed stream, are
    ValueErrors naming `name` and the byte offset (in the decompressed text).
    """

    def blocks() -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        offset = 0  # bytes of text read so far
        while True:
            block = _read(stream, chunk_bytes, name, offset)
            # The decoder may hold the first bytes of a character cut at the previous block's end.
            held = len(decoder.getstate()[0])
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                start = offset - held + error.start
                decompressed = " of its decompressed text" if name.endswith((".xz", ".gz")) else ""
                raise ValueError(
                    f"{name} is not UTF-8 text: the byte at offset {start:,}{decompressed} "
                    f"(0x{error.object[error.start]:02x}) does not decode ({error.reason}); convert the "
                    f"file first (e.g. `iconv -f latin1 -t utf-8`)"
                ) from None
            offset += len(block)
            if not block:
                return
            yield text

    return cut_at_line_ends(blocks(), chunk_bytes, name)


# The tokenizer of a worker process, set once by `_start_worker` so chunks travel without it.
_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode(text: str | list[str], tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Token ids of one chunk of text, or of a list of documents with EOS between them, in the token files'
    dtype, checked against the vocabulary."""
    tokenizer = _worker_tokenizer if tokenizer is None else tokenizer
    if isinstance(text, str):
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    else:
        documents = tokenizer.encode_batch(text)
        joined = itertools.chain.from_iterable(
            itertools.chain.from_iterable(((tokenizer.eos_id,), document) for document in documents))
        ids = np.fromiter(joined, np.int64, count=sum(map(len, documents)) + len(documents))[1:]
    if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
        raise ValueError(
            f"tokenizer {tokenizer.name} produced id {ids.max()} (or {ids.min()}) outside its own "
            f"vocab_size {tokenizer.vocab_size}: its tokenizer.json is inconsistent"
        )
    return ids.astype(dtype_for_vocab(tokenizer.vocab_size))


def document_chunks(batches: Iterator[list[tuple[str, str]]], chunk_bytes: int,
                    eos: np.ndarray) -> Iterator[list[str] | str | np.ndarray]:
    """The documents of `batches` ((where, text) pairs, `where` naming the record in errors) in lists of about
    `chunk_bytes` characters, with `eos` between consecutive lists; a document longer than `chunk_bytes` comes
    alone as strings cut at its line ends (`cut_at_line_ends`), so that a tokenizer is never given all of a long
    one. The ids of the lists (joined as `_encode` joins a list's), the strings and `eos` are the corpus's."""
    chunk: list[str] = []
    size, first = 0, True
    for batch in batches:
        for where, document in batch:
            if len(document) > chunk_bytes:
                if chunk:
                    yield from ([] if first else [eos])
                    yield chunk
                    chunk, size, first = [], 0, False
                yield from ([] if first else [eos])
                blocks = (document[start:start + chunk_bytes] for start in range(0, len(document), chunk_bytes))
                yield from cut_at_line_ends(blocks, chunk_bytes, where)
                first = False
                continue
            chunk.append(document)
            size += len(document)
            if size >= chunk_bytes:
                yield from ([] if first else [eos])
                yield chunk
                chunk, size, first = [], 0, False
    if chunk:
        yield from ([] if first else [eos])
        yield chunk


def _encoded_chunks(files: list[Path], tokenizer: Tokenizer, workers: int, chunk_bytes: int,
                    eos_between_files: bool, read: _InputRead, field: str = DEFAULT_FIELD) -> Iterator[np.ndarray]:
    """The ids of every chunk of every file, in order: EOS between the documents of record files, and
    between files when asked or when either is a record file. `read` follows the reading (a few chunks ahead
    of the ids yielded)."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    eos = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id], dtype=dtype)

    def pieces() -> Iterator[str | list[str] | np.ndarray]:
        for index, path in enumerate(files):
            records = is_record_file(path)
            if index and (eos_between_files or records or is_record_file(files[index - 1])):
                yield eos
            if records:
                position = Position(stored_size(path))
                read.current = position
                yield from document_chunks(texts(path, field, position), chunk_bytes, eos)
                read.finished, read.current = read.finished + position.size, None
                continue
            with open(path, "rb") as raw, open_binary(path, raw) as stream:
                read.current = raw
                yield from text_chunks(stream, chunk_bytes, name=str(path))
                read.finished, read.current = read.finished + raw.tell(), None

    if workers == 1:
        for piece in pieces():
            yield piece if isinstance(piece, np.ndarray) else _encode(piece, tokenizer)
        return
    # Text chunks go to the pool; a list of documents is encoded here, by `encode_batch`, which a Hugging Face
    # tokenizer spreads over every core itself (worker processes made it slower: docs/performance.md).
    # spawn, not fork: the caller may hold threads (JAX, Grain) that a forked child would inherit
    # mid-operation. The window of 2 * workers chunks in flight keeps memory bounded, which
    # Pool.imap does not (it reads its whole input ahead). The pool starts with the first text chunk.
    context = multiprocessing.get_context("spawn")
    with contextlib.ExitStack() as stack:
        pool = None
        in_flight: collections.deque = collections.deque()
        for piece in pieces():
            if isinstance(piece, str):
                if pool is None:
                    pool = stack.enter_context(context.Pool(workers, initializer=_start_worker,
                                                            initargs=(tokenizer,)))
                piece = pool.apply_async(_encode, (piece,))
            elif isinstance(piece, list):
                piece = _encode(piece, tokenizer)
            in_flight.append(piece)
            if len(in_flight) >= 2 * workers:
                head = in_flight.popleft()
                yield head if isinstance(head, np.ndarray) else head.get()
        while in_flight:
            head = in_flight.popleft()
            yield head if isinstance(head, np.ndarray) else head.get()


def _check_apart(input: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuse an `out` that is `input`, or lies inside the directory `input`: the text files there (a stray
    notes.txt, the token files' neighbours) would be read as the corpus and replace the token files."""
    if os.fspath(input) == "":  # `input_files` refuses it by name
        return
    source, target = Path(os.path.realpath(input)), Path(os.path.realpath(out))
    if target == source or (source.is_dir() and target.is_relative_to(source)):
        where = "is" if target == source else "is inside"
        raise ValueError(f"--out {out} {where} --input {input}: tokenizing would read every text and record file in "
                         f"{input} (whatever else lies beside the token files) as the corpus; write the token files "
                         "to a directory outside the input")


def existing_token_files(out: str | os.PathLike) -> str | None:
    """What `out` already holds of a set of token files, in words (meta.json's counts and tokenizer when
    it reads), or None when it holds none of train.bin, val.bin and meta.json."""
    out = Path(out)
    held = [name for name in (*(split_path(out, split).name for split in SPLITS), META) if (out / name).exists()]
    if not held:
        return None
    try:
        meta = json.loads((out / META).read_text(encoding="utf-8"))
        return (f"token files of {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens, tokenizer "
                f"{meta['tokenizer']!r}")
    except (OSError, ValueError, KeyError, TypeError):  # no meta.json, or not one a writer left whole
        return ", ".join(held)


def _cores() -> int:
    """The cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):  # Linux
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _copy_range(source: IO[bytes], target_path: Path, start: int, length: int) -> None:
    source.seek(start)
    with open(target_path, "wb") as target:
        while length > 0:
            block = source.read(min(_COPY_BYTES, length))
            target.write(block)
            length -= len(block)


class _Terminated(BaseException):
    """SIGTERM arrived: unwinds like KeyboardInterrupt so `finally` blocks remove staging files."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Within, SIGTERM raises `_Terminated` instead of ending the process on the spot; once the
    block has cleaned up, the process ends by SIGTERM as it would have (exit status 143).

    Only where SIGTERM has its default action and in the main thread (where handlers live): a
    handler the caller installed is left to do its own work.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def unwind(number, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise  # not reached: the default action ends the process
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """Turns a failed write (a full disk, a file size limit) into an OSError that says the token
    files already in `out` are unchanged."""
    try:
        yield
    except OSError as error:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        raise OSError(
            f"writing new token files in {out} failed ({error.strerror or error}); the token "
            f"files already there are unchanged: "
            f"{'free space on its disk' if full else 'fix that'} and run again"
        ) from error


@contextlib.contextmanager
def _progress(shown: bool | None, read: _InputRead) -> Iterator[Callable[[int], None]]:
    """A function of the tokens written so far that updates a progress display on stderr (bytes
    read of the total, tokens written); `shown` None shows it when stderr is a terminal."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    console = Console(stderr=True)
    if not (console.is_terminal if shown is None else shown):
        yield lambda tokens: None
        return
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(),
               TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("tokenizing", total=read.total, tokens=0)
        yield lambda tokens: progress.update(task, completed=read.bytes, tokens=tokens)


def _write_tokens(chunks: Iterator[np.ndarray], staging: Path, out: Path, itemsize: int,
                  val_fraction: float, report: Callable[[int], None]) -> tuple[int, int]:
    """Write the ids of `chunks` into `staging` as val.bin (the first `val_fraction`, rounded
    down) and train.bin, calling `report(tokens so far)` after each chunk; returns
    (train_tokens, val_tokens)."""
    all_tokens = staging / "tokens"
    total = 0
    with _writing(out):
        sink = open(all_tokens, "wb")
    # Only the writes are wrapped: an input that cannot be read is an error of its own.
    with contextlib.closing(sink):
        for ids in chunks:
            with _writing(out):
                sink.write(ids)  # not ndarray.tofile, whose failures carry no errno
            total += ids.size
            report(total)
        with _writing(out):
            sink.flush()
    val_tokens = int(total * val_fraction)
    with _writing(out), open(all_tokens, "rb") as source:
        _copy_range(source, split_path(staging, "val"), 0, val_tokens * itemsize)
        _copy_range(source, split_path(staging, "train"), val_tokens * itemsize,
                    (total - val_tokens) * itemsize)
    all_tokens.unlink()
    return total - val_tokens, val_tokens


def tokenize_text(input: str | os.PathLike, out: str | os.PathLike, tokenizer: str | Tokenizer,
                  val_fraction: float = 0.01, workers: int | None = None, *,
                  eos_between_files: bool = False, field: str = DEFAULT_FIELD, chunk_bytes: int = CHUNK_BYTES,
                  progress: bool | None = None, force: bool = False) -> dict[str, Any]:
    """Tokenize text or record files (a file, a `datasets` directory, or a directory of them; see
    `input_files`) into `out`/train.bin, val.bin and meta.json.

    `tokenizer` is "byte", a Hugging Face tokenizer name or path, or a tokenizer object.
    The first `val_fraction` of the tokens (rounded down) is the validation split. `workers`
    processes tokenize text (default: every core; 1 tokenizes in this process). Each record of a record
    file is a document, its string `field`, and documents are tokenized here in batches of about
    `chunk_bytes` by the tokenizer's `encode_batch` (a Hugging Face tokenizer's uses every core); the
    tokenizer's EOS id separates documents, and with `eos_between_files` consecutive text files too.
    Returns meta.json's
    record. Workers are spawned processes, so a script that calls this with `workers` above 1
    does so under `if __name__ == "__main__":`. A progress display on stderr (input bytes read of
    the total, tokens written) is shown with `progress=True`, or by default when stderr is a
    terminal.

    Token files already in `out` are refused, naming them (`existing_token_files`), unless `force`
    asks to replace them; an empty `out` is refused rather than read as the current directory, and so is an
    `out` that is `input` or lies inside it (the input's other files would be read as the corpus). The
    new files replace the old ones only once all three are written: an input that is not UTF-8,
    truncated or holds no text (ValueError), a failed write (OSError), Ctrl-C or SIGTERM leave
    `out` as it was and remove this call's staging files. A SIGKILLed call's staging
    directory is removed by the next call that writes to `out`.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction is {val_fraction}: it must be at least 0 and below 1")
    workers = _cores() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers is {workers}: tokenizing needs at least 1 process")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes is {chunk_bytes}: chunks need at least 1 byte")
    if os.fspath(out) == "":
        raise ValueError("out is an empty path, which would write the token files into the current directory: name "
                         "the directory for train.bin, val.bin and meta.json (--out)")
    _check_apart(input, out)
    held = existing_token_files(out)
    if held is not None and not force:
        raise FileExistsError(f"{out} already holds {held}: pass --force (force=True) to replace them, or choose "
                              "another --out")
    tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if eos_between_files and tokenizer.eos_id is None:
        raise ValueError(
            f"eos_between_files needs an EOS token, and tokenizer {tokenizer.name} has none: "
            f"drop --eos-between-files or use a tokenizer with an EOS token"
        )
    files = input_files(input)
    records = [path for path in files if is_record_file(path)]
    if records and tokenizer.eos_id is None:
        raise ValueError(f"{records[0]} holds records, each a document, and documents are joined by the tokenizer's "
                         f"EOS token, which tokenizer {tokenizer.name} has none of: use a tokenizer with an EOS token")
    out = Path(out)
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)
    itemsize = dtype_for_vocab(tokenizer.vocab_size).itemsize
    read = _InputRead(files)
    with _sigterm_unwinds(), staging_directory(out) as staging, _progress(progress, read) as report:
        chunks = _encoded_chunks(files, tokenizer, workers, chunk_bytes, eos_between_files, read, field)
        train_tokens, val_tokens = _write_tokens(chunks, staging, out, itemsize, val_fraction,
                                                 report)
        if train_tokens + val_tokens == 0:
            raise ValueError(
                f"{input} holds no text: tokenizing it gave 0 tokens, and a run needs some; pass "
                f"a file or directory with text in it (the files in {out} are unchanged)"
            )
        meta = make_meta(tokenizer.name, tokenizer.vocab_size, train_tokens, val_tokens,
                         tokenizer.eos_id)
        with _writing(out):
            write_meta(staging, meta)
            commit_staged(staging, out)
    return meta
