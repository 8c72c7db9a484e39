"""Training batches from token files, on Grain: fixed windows (`TokenWindows`) or packed
documents (`PackedTokens`).

Both read a split through a memmap, shuffle by seed (reshuffled each epoch, deterministically),
repeat without end, and return Grain iterators, whose `get_state()` / `set_state(state)` let a
resumed run read the same next batch. Token ids arrive as int32; `load` has checked every id
against meta.json's vocab_size (`token_files.read_meta`), and the objective checks them against
the model's vocabulary.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np
from absl import flags
from grain.experimental import FirstFitPackIterDataset, ThreadPrefetchIterDataset

from dew.data.dataset import Batch, Dataset, Partition
from dew.data.token_files import fingerprint, open_split, read_meta
from dew.data.tokenizers import same_tokenizer, tokenizer_name

TEXT = "text"
# Reading a split for EOS positions goes this many tokens at a time, to bound memory.
_SCAN_TOKENS = 1 << 24
# Reads in this process, in the caller's thread; Loading adds any read-ahead.
_IN_THREAD = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


@dataclasses.dataclass(frozen=True)
class Loading:
    """How train batches are read: `workers` Grain processes (0: this process), `prefetch`
    batches read ahead (per worker; with no workers, by one background thread; 0: none).

    An iterator's state belongs to its `workers` setting: restore it with the same Loading.
    """

    workers: int = 0
    prefetch: int = 2

    def __post_init__(self):
        if self.workers < 0:
            raise ValueError(f"Loading.workers is {self.workers}: use 0 (this process) or more")
        if self.prefetch < 0 or (self.workers and self.prefetch < 1):
            low = 1 if self.workers else 0
            raise ValueError(
                f"Loading.prefetch is {self.prefetch}: with workers={self.workers} it must be at "
                f"least {low}"
            )

    def apply(self, dataset: grain.IterDataset) -> grain.IterDataset:
        """`dataset` read ahead as configured."""
        if self.workers == 0:
            if self.prefetch == 0:
                return dataset
            return ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=self.prefetch)
        # Grain 0.2.18's mp_prefetch reads an absl flag and fails in programs that never parse
        # absl flags (google/grain#1355, fixed later); the flag's default is what it needs.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        options = grain.MultiprocessingOptions(num_workers=self.workers,
                                               per_worker_buffer_size=self.prefetch)
        return dataset.mp_prefetch(options)


class _Tokens:
    """One split's ids as a memmap opened on first use, so Grain can send it to worker processes."""

    def __init__(self, path: Path, split: str, meta: dict[str, Any]):
        self.path, self.split, self.meta = path, split, meta
        self.count = meta[f"{split}_tokens"]
        self._array = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = open_split(self.path, self.split, self.meta)
        return self._array

    def __getstate__(self):
        return {**self.__dict__, "_array": None}


class _ReadWindows:
    """Window numbers [B] -> {"text": int32 [rows, seq_len+1]}: this partition's rows."""

    def __init__(self, tokens: _Tokens, seq_len: int, rows: slice):
        self.tokens, self.seq_len, self.rows = tokens, seq_len, rows

    def __call__(self, windows: np.ndarray) -> Batch:
        array, width = self.tokens.array, self.seq_len + 1
        starts = np.asarray(windows)[self.rows] * self.seq_len
        return {TEXT: np.stack([array[start:start + width] for start in starts]).astype(np.int32)}


class _ReadPiece:
    """Piece number -> {"text": int32 [length]}, one document or row-sized piece of one."""

    def __init__(self, tokens: _Tokens, pieces: np.ndarray):
        self.tokens, self.pieces = tokens, pieces

    def __call__(self, piece: int) -> Batch:
        start, length = self.pieces[piece]
        return {TEXT: np.asarray(self.tokens.array[start:start + length], dtype=np.int32)}


def _rows(batch: int, partition: Partition, what: str = "batch") -> slice:
    """This partition's rows of a global batch: the contiguous block `index` of `count`."""
    if batch % partition.count:
        raise ValueError(
            f"{what} {batch} does not split evenly over {partition.count} processes: use a "
            f"multiple of {partition.count}"
        )
    rows = batch // partition.count
    return slice(partition.index * rows, (partition.index + 1) * rows)


def _open(path: str, seq_len: int, seed: int, tokenizer: str | None) -> dict[str, Any]:
    """meta.json of `path`, checked against the spec's own fields, with the files' `fingerprint`."""
    if seq_len < 1:
        raise ValueError(f"seq_len is {seq_len}: a window needs at least 1 input token")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed is {seed}: Grain's shuffle takes 0 <= seed < 2**32")
    meta = read_meta(path)
    if tokenizer is not None and not same_tokenizer(tokenizer, meta["tokenizer"]):
        raise ValueError(
            f"{path} was written with tokenizer {meta['tokenizer']!r} (meta.json), not "
            f"{tokenizer_name(tokenizer)!r}: pass tokenizer={meta['tokenizer']!r}, or rewrite the "
            f"files with `dew tokenize --tokenizer {tokenizer}`"
        )
    return {**meta, "fingerprint": fingerprint(path, meta)}


def _val_rows(batch: int, val_batch: int | None) -> int:
    if val_batch is not None and val_batch < 1:
        raise ValueError(f"val_batch is {val_batch}: use at least 1 row, or None for `batch`")
    return batch if val_batch is None else val_batch


def check_val_batch(val_batch: int | None, rows: int, what: str, fix: str) -> None:
    """Refuse a `val_batch` asked for (not the default, `batch`, which reads fewer rows as one batch)
    above the `rows` the validation split holds; `what` names those rows, `fix` how to get more."""
    if val_batch is not None and val_batch > rows:
        raise ValueError(f"val_batch {val_batch} (--trainer.val-batch) is more than the {rows} {what}, so no "
                         f"batch of it could be read: pass --trainer.val-batch {rows} or fewer, or {fix}")


def _too_small(path: str, tokens: int, units: str, have: int, need: int, fix: str) -> ValueError:
    return ValueError(
        f"the train split of {path} has {tokens} tokens, {have} {units}, and one batch needs "
        f"{need}: {fix}, or tokenize more text"
    )


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Fixed windows of a token file: {"text": int32 [rows, seq_len+1]} per batch.

    Record i is the window `[i*seq_len, i*seq_len + seq_len + 1)` of train.bin, so every target
    is used once per epoch; `records` counts them. A global batch of `batch` windows is drawn in
    a seeded order, and process `index` of `count` reads rows
    `[index*batch/count, (index+1)*batch/count)` of it: the processes' rows are disjoint, and
    stacked in process order they are the one-process batch. Validation reads val.bin once in
    file order, in non-overlapping windows. `tokenizer`, when set, must match meta.json's.
    """

    path: str = "data/tinystories"
    """The directory of train.bin, val.bin and meta.json (written by `dew tokenize`)."""
    seq_len: int = 256
    """Tokens each row trains on (a row reads one more, for the last target)."""
    loading: Loading = Loading()
    seed: int = 0
    """Seeds the order rows are read in (the model's initialization has trainer.seed)."""
    tokenizer: str | None = None
    """The tokenizer the files must have been written with (checked against meta.json); None checks nothing. In dew train, leave it unset: --tokenizer names the run's."""

    def load(self, batch: int, *, val_batch: int | None = None) -> Dataset:
        """The train stream and validation pass, `batch` rows per global train batch."""
        meta = _open(self.path, self.seq_len, self.seed, self.tokenizer)
        train = _Tokens(Path(self.path), "train", meta)
        windows = max(train.count - 1, 0) // self.seq_len
        if windows < batch:
            raise _too_small(self.path, train.count, f"windows of {self.seq_len}+1", windows, batch,
                             "use a smaller batch or seq_len")

        def train_batches(partition: Partition) -> Iterator[Batch]:
            stream = (grain.MapDataset.range(windows).shuffle(seed=self.seed).repeat()
                      .batch(batch).map(_ReadWindows(train, self.seq_len, _rows(batch, partition))))
            return iter(self.loading.apply(stream.to_iter_dataset(_IN_THREAD)))

        return Dataset(train=train_batches, val=self._val(meta, batch, val_batch),
                       records=windows, batch=batch, meta={**meta, "seq_len": self.seq_len})

    def _val(self, meta: dict[str, Any], batch: int,
             val_batch: int | None) -> Callable[[Partition], Iterator[Batch]] | None:
        val = _Tokens(Path(self.path), "val", meta)
        if val.count == 0:
            return None
        windows = (val.count - 1) // self.seq_len
        if windows < 1:
            raise ValueError(
                f"the val split of {self.path} has {val.count} tokens and one window needs "
                f"{self.seq_len + 1}: tokenize with a larger --val-fraction (or 0 for no "
                f"validation), or use a smaller seq_len"
            )
        check_val_batch(val_batch, windows,
                        f"validation windows of {self.path} ({val.count:,} val.bin tokens in windows of "
                        f"seq_len {self.seq_len} + 1)", "tokenize with a larger --val-fraction")
        val_batch = _val_rows(batch, val_batch)
        # A split smaller than one batch is read as a single batch of all its windows.
        full = windows >= val_batch
        batches = windows // val_batch if full else 1

        def val_batches(partition: Partition) -> Iterator[Batch]:
            rows = val_batch if full else windows - windows % partition.count
            if rows == 0:
                raise ValueError(
                    f"the val split of {self.path} holds {windows} windows, fewer than the "
                    f"{partition.count} processes that share it: tokenize with a larger --val-fraction"
                )
            read = _ReadWindows(val, self.seq_len, _rows(rows, partition, "val_batch"))
            for index in range(batches):
                yield read(np.arange(index * rows, (index + 1) * rows))

        return val_batches


def _pieces(tokens: np.ndarray, eos_id: int, width: int) -> np.ndarray:
    """int64 [pieces, 2] (start, length): documents, each ending after its EOS, split into pieces
    of at most `width` tokens. Tokens after the last EOS form the last document."""
    if len(tokens) == 0:
        return np.zeros((0, 2), np.int64)
    ends = [np.flatnonzero(tokens[start:start + _SCAN_TOKENS] == eos_id) + start + 1
            for start in range(0, len(tokens), _SCAN_TOKENS)]
    ends = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    counts = -(-(ends - starts) // width)  # pieces per document
    document = np.repeat(np.arange(len(starts)), counts)
    first_piece = np.repeat(np.cumsum(counts) - counts, counts)
    piece_starts = starts[document] + (np.arange(len(document)) - first_piece) * width
    return np.stack([piece_starts, np.minimum(width, ends[document] - piece_starts)], axis=1)


def _pack(pieces: grain.MapDataset, rows: int, width: int) -> grain.IterDataset:
    """Pieces packed first-fit into groups of `rows` rows of `width` tokens, one row at a time,
    with text_segment_ids (1-based, 0 = padding) and text_positions added; padding ids are 0.

    A group is emitted when a piece fits none of its rows, so every row is in use and a group is
    exactly one batch; the rows stay in packing order (nothing random happens here).
    """
    return FirstFitPackIterDataset(pieces.to_iter_dataset(_IN_THREAD),
                                   length_struct={TEXT: width}, num_packing_bins=rows,
                                   shuffle_bins=False)


@dataclasses.dataclass(frozen=True)
class PackedTokens:
    """Documents packed into rows: {"text", "text_segment_ids", "text_positions"}, each int32
    [rows, seq_len+1] per batch.

    Documents end after each `eos_id` (default: meta.json's eos_id). A document longer than a row
    is split into row-sized pieces; `records` counts documents after splitting. Pieces come in a
    seeded order and Grain packs them first-fit into `batch` rows at a time. Segment ids are
    1-based per row with 0 for padding, positions restart at 0 for each document and are 0 in
    padding, and padding ids are 0. Process `index` of `count` packs its own share of the pieces
    (every `count`-th piece), so the rows of all processes are disjoint; the stream depends on
    the process count and on `loading.workers` (each worker packs its own share). Validation
    packs val.bin in file order identically on every process, which reads its block of rows.
    """

    path: str = "data/tinystories"
    """The directory of train.bin, val.bin and meta.json (written by `dew tokenize`)."""
    seq_len: int = 256
    """Tokens each row trains on (a row reads one more, for the last target)."""
    loading: Loading = Loading()
    seed: int = 0
    """Seeds the order documents are packed in (the model's initialization has trainer.seed)."""
    eos_id: int | None = None
    """The id that ends a document; None takes meta.json's eos_id."""
    tokenizer: str | None = None
    """The tokenizer the files must have been written with (checked against meta.json); None checks nothing. In dew train, leave it unset: --tokenizer names the run's."""

    def load(self, batch: int, *, val_batch: int | None = None) -> Dataset:
        """The train stream and validation pass, `batch` packed rows per global train batch."""
        meta = _open(self.path, self.seq_len, self.seed, self.tokenizer)
        eos_id = meta["eos_id"] if self.eos_id is None else self.eos_id
        if eos_id is None:
            raise ValueError(
                f"{self.path} records no eos_id (tokenizer {meta['tokenizer']!r} has none), so "
                f"documents cannot be told apart: pass PackedTokens(eos_id=...), or tokenize with "
                f"a tokenizer that has an EOS token and --eos-between-files"
            )
        if not 0 <= eos_id < meta["vocab_size"]:
            raise ValueError(f"eos_id {eos_id} is outside the vocabulary 0..{meta['vocab_size'] - 1}")
        width = self.seq_len + 1
        train = _Tokens(Path(self.path), "train", meta)
        train_pieces = _pieces(train.array, eos_id, width)
        if len(train_pieces) < batch:
            raise _too_small(self.path, train.count, "documents (split to rows)", len(train_pieces),
                             batch, "use a smaller batch")

        def train_batches(partition: Partition) -> Iterator[Batch]:
            block = _rows(batch, partition)
            rows = block.stop - block.start
            pieces = (grain.MapDataset.range(len(train_pieces)).shuffle(seed=self.seed).repeat()
                      [partition.index::partition.count].map(_ReadPiece(train, train_pieces)))
            return iter(self.loading.apply(_pack(pieces, rows, width).batch(rows)))

        val = _Tokens(Path(self.path), "val", meta)
        val_pieces = _pieces(val.array, eos_id, width)
        val_rows = _val_rows(batch, val_batch)
        if val.count and val_batch is not None:
            # Packing stops at the first full batch, so this reads at most one batch's documents.
            pieces = grain.MapDataset.range(len(val_pieces)).map(_ReadPiece(val, val_pieces))
            packed = sum(1 for _ in itertools.islice(_pack(pieces, val_rows, width), val_rows))
            check_val_batch(val_batch, packed,
                            f"rows of seq_len {self.seq_len} + 1 the {val.count:,} val.bin tokens of "
                            f"{self.path} pack into", "tokenize with a larger --val-fraction")

        def val_batches(partition: Partition) -> Iterator[Batch]:
            pieces = grain.MapDataset.range(len(val_pieces)).map(_ReadPiece(val, val_pieces))
            pending: list[Batch] = []
            emitted = False
            for row in _pack(pieces, val_rows, width):
                pending.append(row)
                if len(pending) == val_rows:
                    yield _stack(pending, _rows(val_rows, partition, "val_batch"))
                    pending, emitted = [], True
            # A split smaller than one batch is read as a single batch of all its rows.
            if not emitted:
                usable = len(pending) - len(pending) % partition.count
                if usable == 0:
                    raise ValueError(
                        f"the val split of {self.path} packs into {len(pending)} rows, fewer than "
                        f"the {partition.count} processes that share it: tokenize with a larger "
                        f"--val-fraction"
                    )
                yield _stack(pending[:usable], _rows(usable, partition, "val_batch"))

        return Dataset(train=train_batches, val=val_batches if val.count else None,
                       records=len(train_pieces), batch=batch,
                       meta={**meta, "seq_len": self.seq_len, "eos_id": eos_id})


def _stack(rows: list[Batch], block: slice) -> Batch:
    return {key: np.stack([row[key] for row in rows[block]]) for key in rows[0]}
