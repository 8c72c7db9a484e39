"""Record files, the forms corpora and chat sets come in: JSON Lines (.jsonl, .jsonl.gz, .jsonl.xz), Parquet
(.parquet, through pyarrow) and Hugging Face `datasets` directories (what `Dataset.save_to_disk` writes, read
through `datasets.load_from_disk`).

Each is read a batch of records at a time, so memory holds one batch however large the file: JSON Lines line by
line, Parquet one record batch of its row groups at a time, a `datasets` directory through its memory-mapped
Arrow files. `texts` gives one string field of every record (what `dew tokenize` reads), `records` whole records
as dicts (what the chat, preference and prompt data read). A record is named in errors by its line (JSON Lines,
counting from 1) or its row (Parquet and `datasets`, counting from 0, as `dataset[i]` does); so is a JSON Lines
record longer than `MAX_RECORD_BYTES`, or holding a lone surrogate escape (`"\\ud800"`, which decodes to no
character), and a damaged file is named with what in it failed to read.
"""

from __future__ import annotations

import gzip
import json
import lzma
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz")
PARQUET_SUFFIXES = (".parquet",)
RECORD_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
# What a cut-short or damaged .xz / .gz stream raises while it is read.
DECOMPRESSION_ERRORS = (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error)
BATCH_RECORDS = 1024
# The longest JSON Lines record read: one line is held whole (its bytes, then its text), so this bounds the memory
# one record takes; a longer line is refused naming its size.
MAX_RECORD_BYTES = 256 << 20
_EXTRA = "pip install 'dew-ml[data]'"
# A JSON escape of a UTF-16 surrogate (the raw line holds "\ud83d"): only then can a decoded string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def open_binary(path: Path, raw: IO[bytes] | None = None) -> IO[bytes]:
    """Open a stored file for reading bytes, decompressing .xz and .gz.

    With `raw` (`path` already opened "rb"), the bytes come from it, and its position tells how
    much of the stored file has been read; the caller closes it.
    """
    source = path if raw is None else raw
    if path.name.endswith(".xz"):
        return lzma.open(source, "rb")
    if path.name.endswith(".gz"):
        return gzip.open(source, "rb")
    return open(path, "rb") if raw is None else raw


def is_datasets_directory(path: Path) -> bool:
    """Whether `path` is a directory `datasets`' `save_to_disk` wrote (one dataset, or a dict of splits)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def is_record_file(path: Path) -> bool:
    return path.name.endswith(RECORD_SUFFIXES) or is_datasets_directory(path)


class Position:
    """How far a reader has come through its source: `fraction` of its records (Parquet, `datasets`), or the
    bytes read of a stored file (`stream`, JSON Lines); `tell()` is in the source's stored bytes."""

    def __init__(self, size: int):
        self.size, self.fraction, self.stream, self.closed = size, 0.0, None, False

    def tell(self) -> int:
        if self.stream is not None and not self.stream.closed:
            return self.stream.tell()
        return int(self.size * self.fraction)


def stored_size(path: Path) -> int:
    """Bytes a record source takes on disk (every file of a `datasets` directory)."""
    if path.is_dir():
        return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
    return path.stat().st_size


def texts(path: Path, field: str, position: Position | None = None,
          batch: int = BATCH_RECORDS) -> Iterator[list[tuple[str, str]]]:
    """(where, text) of each record of `path`, `batch` records at a time, in order: `text` its string `field`,
    `where` the file and the line or row; a record lacking it, or holding something else there, is refused naming
    the file, the record and the fix."""
    if path.name.endswith(JSONL_SUFFIXES):
        chosen: list[tuple[str, str]] = []
        for where, record in _jsonl_records(path, "records", position):
            chosen.append((where, _text_of(record, field, where)))
            if len(chosen) == batch:
                yield chosen
                chosen = []
        if chosen:
            yield chosen
        return
    start = 0
    for table in _arrow_batches(path, field, position, batch):
        column = table.column(0)
        if column.null_count:
            row = start + column.to_pylist().index(None)
            raise ValueError(f"{path}, row {row} (counting from 0) has no {field!r} (it is null): drop the records "
                             f"without text, or pass --field naming the column that holds it in every record")
        yield [(f"{path}, row {start + offset}", text) for offset, text in enumerate(column.to_pylist())]
        start += table.num_rows


def records(path: Path, what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) of each record of `path`, a file of `what` (named in errors): `where` names the file and
    the line or row. A JSON Lines line that is not a JSON object is refused by line."""
    if path.name.endswith(JSONL_SUFFIXES):
        yield from _jsonl_records(path, what)
        return
    start = 0
    for table in _arrow_batches(path, None, None, BATCH_RECORDS):
        for offset, record in enumerate(table.to_pylist()):
            yield f"{path}, row {start + offset}", record
        start += table.num_rows


def _text_of(record: dict, field: str, where: str) -> str:
    if field not in record:
        held = ", ".join(map(repr, list(record)[:8])) or "no fields"
        raise ValueError(f"{where} has no field {field!r} (it has {held}): pass --field naming the field that holds "
                         "the text (every record needs it)")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} holds {type(text).__name__} {_short(text)}, not a string: pass "
                         "--field naming the field that holds the text, or fix the record")
    return text


def _short(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _jsonl_records(path: Path, what: str, position: Position | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) of each non-blank line of a JSON Lines file (decompressing .gz and .xz)."""
    with open(path, "rb") as raw, open_binary(path, raw) as stream:
        if position is not None:
            position.stream = raw
        number = 0
        while True:
            line = _read_line(stream, path, number, MAX_RECORD_BYTES + 1)
            if not line:
                break
            number += 1
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
                size = len(line) + _rest_of_line(stream, path, number)
                raise ValueError(f"{where} is a record of {size:,} bytes, longer than the {MAX_RECORD_BYTES:,} bytes "
                                 f"Dew reads of one record (each is held whole while read): split it into several "
                                 "records, one document each")
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{where} is not JSON ({error}); a {what} file holds one JSON object a line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where} is {type(record).__name__}; a {what} file holds one JSON object a line")
            if _SURROGATE_ESCAPE.search(line):
                _refuse_lone_surrogates(record, where)
            yield where, record
    if position is not None:
        position.stream = None


def _read_line(stream: IO[bytes], path: Path, number: int, size: int) -> bytes:
    """The next line of `stream`, at most `size` bytes of it; a damaged compressed stream is refused by line."""
    try:
        return stream.readline(size)
    except DECOMPRESSION_ERRORS as error:
        raise ValueError(f"{path} is truncated or corrupt: decompressing it failed after line {number} "
                         f"({error}); copy or download it again") from None


def _rest_of_line(stream: IO[bytes], path: Path, number: int) -> int:
    """Bytes up to the end of the line `stream` is inside, read a block at a time and dropped."""
    skipped = 0
    while (block := _read_line(stream, path, number, 1 << 20)) and not block.endswith(b"\n"):
        skipped += len(block)
    return skipped + len(block)


def _refuse_lone_surrogates(value, where: str, field: str = "") -> None:
    """Refuse a string of a decoded JSON record (a field, a nested one, a key) that holds a lone UTF-16 surrogate:
    JSON's escapes can spell one ("\\ud800" without its pair), and it is no character, so no text encodes it."""
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{field}.{key}" if field else key
            _refuse_lone_surrogates(key, where, f"{inner} (the key)")
            _refuse_lone_surrogates(item, where, inner)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_lone_surrogates(item, where, f"{field}[{index}]")
    elif isinstance(value, str) and (found := _SURROGATE.search(value)):
        raise ValueError(f"{where}: field {field!r} holds a lone surrogate \\u{ord(found.group()):04x} at character "
                         f"{found.start():,}, half of a UTF-16 pair without its other half, which is no character and "
                         "encodes as no text: write the whole pair (\\ud83d\\ude00 is one character) or the character "
                         "itself, or remove the escape")


def _arrow_batches(path: Path, field: str | None, position: Position | None, batch: int):
    """A Parquet file's or a `datasets` directory's records as pyarrow tables of at most `batch` rows: only the
    column `field` (checked to hold strings) when one is named, else every column."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: {_EXTRA}") from None
    if path.is_dir():
        rows, schema, tables = _datasets_tables(path, field, batch)
    else:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{path} is not a readable Parquet file ({_one_line(error)}): copy or download it "
                             "again") from None
        rows, schema = parquet.metadata.num_rows, parquet.schema_arrow
        columns = None if field is None else [field]
        tables = (pa.Table.from_batches([part]) for part in parquet.iter_batches(batch_size=batch, columns=columns))
    tables = iter(tables)
    if field is not None:
        _check_column(path, schema, field, pa)
    done = 0
    while True:
        try:
            table = next(tables, None)
        except (pa.ArrowException, OSError) as error:  # a damaged page, a cut-short Arrow file
            raise ValueError(f"{path} is damaged: reading its rows from row {done} (counting from 0) on failed "
                             f"({_one_line(error)}): copy or download it again, or write it again") from None
        if table is None:
            break
        done += table.num_rows
        if position is not None:
            position.fraction = done / max(rows, 1)
        yield table


def _datasets_tables(path: Path, field: str | None, batch: int):
    """(rows, schema, tables) of the dataset saved in `path`; a dict of splits is refused, naming them."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading the datasets directory {path} needs the datasets package: {_EXTRA}") from None
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        raise ValueError(f"{path} holds a DatasetDict of splits {splits}: give one split's directory, e.g. "
                         f"{path / (splits[0] if splits else 'train')}")
    try:
        dataset = datasets.load_from_disk(str(path))
    except (ValueError, OSError, ImportError) as error:  # pyarrow's errors are ValueErrors and OSErrors
        raise _damaged_dataset(path, error) from None
    if field is not None and field in dataset.column_names:
        dataset = dataset.select_columns([field])
    schema = dataset.data.schema
    return dataset.num_rows, schema, dataset.with_format("arrow").iter(batch_size=batch)


def _damaged_dataset(path: Path, error: Exception) -> ValueError:
    """The refusal of a `datasets` directory that `load_from_disk` cannot read, naming the file at fault: a JSON
    file that is not JSON, or an Arrow file that is cut short or damaged."""
    import pyarrow as pa

    fix = "save the dataset again with Dataset.save_to_disk, or copy the directory again"
    for name in ("state.json", "dataset_info.json"):
        try:
            json.loads((path / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (ValueError, OSError) as problem:
            return ValueError(f"{path / name} is not JSON ({_one_line(problem)}): the datasets directory is damaged; "
                              f"{fix}")
    for arrow in sorted(path.glob("*.arrow")):
        try:
            with pa.memory_map(str(arrow)) as source:
                pa.ipc.open_stream(source).read_all()
        except (pa.ArrowException, OSError) as problem:
            return ValueError(f"{arrow} is cut short or damaged ({_one_line(problem)}): the datasets directory is "
                              f"damaged; {fix}")
    return ValueError(f"the datasets directory {path} cannot be read ({type(error).__name__}: {_one_line(error)}); {fix}")


def _one_line(error: BaseException) -> str:
    """An error's text on one line (pyarrow's span several)."""
    return " ".join(str(error).split())


def _check_column(path: Path, schema, field: str, pa) -> None:
    if field not in schema.names:
        held = ", ".join(map(repr, schema.names[:8])) or "none"
        raise ValueError(f"{path}, row 0 (counting from 0) has no field {field!r} (its columns are {held}): pass "
                         "--field naming the column that holds the text")
    kind = schema.field(field).type
    # A dictionary of strings (pandas' categoricals) reads as the strings it holds.
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(values) or pa.types.is_large_string(values) or pa.types.is_string_view(values)):
        raise ValueError(f"{path}, row 0 (counting from 0): column {field!r} holds {kind}, not strings: pass --field "
                         "naming the column that holds the text")
