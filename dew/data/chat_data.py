"""`ChatData`: conversations from a JSON Lines file, a Parquet file or a `datasets` directory as training rows
with a role per token.

Each record is one conversation, `{"messages": [{"role": "user", "content": "..."}, ...]}` (a line of a JSON
Lines file; a `messages` column of lists of structs in Parquet or `datasets`).
Every conversation is rendered with the checkpoint's chat template and tokenized once, at `load`
(`dew.data.chat.encode_chat`), then laid into rows of `seq_len + 1` tokens: first-fit in file order
when `pack` is set, several conversations to a row, else one to a row. Grain reads the rows in a
seeded order, reshuffled each epoch, and its iterator state lets a resumed run read the same next
batch.

A conversation longer than a row is refused by default (`overlong="refuse"`, naming its line);
`overlong="truncate"` keeps its first `seq_len + 1` tokens and drops the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import grain
import numpy as np

from dew.data.chat import Role, encode_chat, template_of
from dew.data.dataset import Batch, Dataset, Partition
from dew.data.records import read_records
from dew.data.tokenizers import load_tokenizer, tokenizer_name
from dew.data.windows import _IN_THREAD, _rows, _val_rows, check_val_batch

TEXT = "text"
SEGMENTS, POSITIONS, ROLES = f"{TEXT}_segment_ids", f"{TEXT}_positions", f"{TEXT}_roles"


def read_conversations(path: str | Path) -> list[tuple[str, list]]:
    """(where, messages) of each record of a JSON Lines file, a Parquet file or a `datasets` directory, refused
    by record when one is not an object with a "messages" list (`where` names the file and the line or row)."""
    conversations = []
    for where, record in read_records(path, "chat"):
        if not isinstance(record.get("messages"), list):
            raise ValueError(f"{where}: each record is an object with a \"messages\" list, "
                             '{"messages": [{"role": ..., "content": ...}, ...]}')
        conversations.append((where, record["messages"]))
    return conversations


def chat_rows(encoded: list[tuple[np.ndarray, np.ndarray]], width: int, pack: bool) -> dict[str, np.ndarray]:
    """Conversations' (ids, roles), each at most `width` long, laid into int32 rows `[rows, width]`:
    text, text_segment_ids (1-based per row, 0 for padding), text_positions (restarting at 0 for each
    conversation) and text_roles (`Role.NONE` for padding). Padding ids are 0. With `pack`, each
    conversation goes into the first row with room for it (file order), else each takes its own row."""
    placed: list[list[int]] = []  # each row's conversations
    free = np.zeros(0, np.int64)
    for index, (ids, _) in enumerate(encoded):
        fits = np.flatnonzero(free >= len(ids)) if pack else ()
        if len(fits):
            placed[fits[0]].append(index)
            free[fits[0]] -= len(ids)
        else:
            placed.append([index])
            free = np.append(free, width - len(ids))
    rows = {key: np.zeros((len(placed), width), np.int32) for key in (TEXT, SEGMENTS, POSITIONS, ROLES)}
    for row, members in enumerate(placed):
        cursor = 0
        for segment, index in enumerate(members, start=1):
            ids, roles = encoded[index]
            span = slice(cursor, cursor + len(ids))
            rows[TEXT][row, span], rows[ROLES][row, span] = ids, roles
            rows[SEGMENTS][row, span] = segment
            rows[POSITIONS][row, span] = np.arange(len(ids))
            cursor += len(ids)
    return rows


class _ReadRows:
    """Row numbers [B] -> this partition's block of those rows, every key alike."""

    def __init__(self, rows: dict[str, np.ndarray], block: slice):
        self.rows, self.block = rows, block

    def __call__(self, numbers: np.ndarray) -> Batch:
        numbers = np.asarray(numbers)[self.block]
        return {key: values[numbers] for key, values in self.rows.items()}


@dataclasses.dataclass(frozen=True)
class ChatData:
    """Chat conversations as rows: {"text", "text_segment_ids", "text_positions", "text_roles"}, int32
    [rows, seq_len + 1] per batch, rendered with the tokenizer's chat template (see the module)."""

    path: str = "data/chat.jsonl"
    """A JSON Lines file, one {"messages": [{"role", "content"}, ...]} conversation a line; or a Parquet file or
    datasets directory with a messages column."""
    seq_len: int = 256
    """Tokens each row trains on (a row holds one more, for the last target)."""
    tokenizer: str | None = None
    """The checkpoint's tokenizer directory (tokenizer.json, and the chat template beside it). In dew train, leave it unset: --tokenizer names the run's."""
    template: str | None = None
    """A Jinja chat template file to render with instead of the tokenizer's own."""
    val_path: str | None = None
    """A file of validation conversations (as `path`), read once in file order; None: no validation."""
    pack: bool = True
    """Pack several conversations into a row (first-fit, in file order); --data.no-pack puts one in each row."""
    overlong: Literal["refuse", "truncate"] = "refuse"
    """A conversation longer than seq_len + 1 tokens is refused, or truncated to its first seq_len + 1."""
    seed: int = 0
    """Seeds the order rows are read in."""

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len is {self.seq_len}: a row needs at least 1 input token")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed is {self.seed}: Grain's shuffle takes 0 <= seed < 2**32")
        if self.overlong not in ("refuse", "truncate"):
            raise ValueError(f"overlong is {self.overlong!r}; use 'refuse' or 'truncate'")

    def encode(self, path: str | Path, tokenizer, template) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each conversation of `path` as (ids, roles), held to one row by the `overlong` rule."""
        width = self.seq_len + 1
        encoded = []
        for where, messages in read_conversations(path):
            ids, roles = encode_chat(messages, tokenizer, template, where)
            if len(ids) > width and self.overlong == "refuse":
                raise ValueError(
                    f"{where}: the conversation is {len(ids)} tokens, longer than a row of seq_len + 1 = {width}: use "
                    f"a larger seq_len (--data.seq-len), shorten or drop it, or pass overlong='truncate' "
                    f"(--data.overlong truncate) to keep the first {width} tokens of every such conversation")
            encoded.append((ids[:width], roles[:width]))
        return encoded

    def load(self, batch: int, *, val_batch: int | None = None) -> Dataset:
        """The train stream and validation pass, `batch` rows per global train batch."""
        if self.tokenizer is None:
            raise ValueError("ChatData renders conversations with a checkpoint's tokenizer and chat template: pass "
                             "tokenizer= its directory (in dew train, --tokenizer)")
        tokenizer = load_tokenizer(self.tokenizer)
        template = template_of(tokenizer, self.template)
        width = self.seq_len + 1
        train = chat_rows(self.encode(self.path, tokenizer, template), width, self.pack)
        count = len(train[TEXT])
        if count < batch:
            raise ValueError(f"{self.path} fills {count} rows of seq_len + 1 = {width} tokens, and one batch needs "
                             f"{batch}: use a smaller batch, or add conversations")
        learned = int(np.sum(train[ROLES] == Role.ASSISTANT))

        def train_batches(partition: Partition) -> Iterator[Batch]:
            stream = (grain.MapDataset.range(count).shuffle(seed=self.seed).repeat()
                      .batch(batch).map(_ReadRows(train, _rows(batch, partition))))
            return iter(stream.to_iter_dataset(_IN_THREAD))

        val, val_rows = None, None
        if self.val_path is not None:
            val_rows = chat_rows(self.encode(self.val_path, tokenizer, template), width, self.pack)
            check_val_batch(val_batch, len(val_rows[TEXT]), f"rows of seq_len {self.seq_len} + 1 the validation "
                            f"conversations of {self.val_path} fill", "add validation conversations")
            val = _val_batches(val_rows, _val_rows(batch, val_batch))
        meta = {"tokenizer": tokenizer_name(self.tokenizer), "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id, "seq_len": self.seq_len, "template": template.source,
                "rows": count, "assistant_tokens": learned, "fingerprint": rows_fingerprint(train, val_rows)}
        return Dataset(train=train_batches, val=val, records=count, batch=batch, meta=meta)


def rows_fingerprint(train: dict[str, np.ndarray], val: dict[str, np.ndarray] | None) -> str:
    """A hash of the rows a run trains and validates on (every key, shape and id): 32 hex digits.

    The rows are in memory once `load` has read the conversations, so it hashes them whole: any change
    to a conversation, the chat template or the tokenizer that changes a row is caught; one that
    leaves every row as it was (JSON spacing, the order of a message's keys) is the same data.
    """
    digest = hashlib.blake2b(digest_size=16)
    for split, rows in (("train", train), ("val", val or {})):
        for key in sorted(rows):
            values = np.ascontiguousarray(rows[key], np.int32)
            digest.update(f"{split} {key} {values.shape}\n".encode())
            digest.update(values.tobytes())
    return digest.hexdigest()


def _val_batches(rows: dict[str, np.ndarray], val_batch: int) -> Callable[[Partition], Iterator[Batch]]:
    """One pass over the rows in order, `val_batch` rows at a time; fewer rows than that are one batch."""
    count = len(rows[TEXT])
    full = count >= val_batch
    batches = count // val_batch if full else 1

    def val_batches(partition: Partition) -> Iterator[Batch]:
        size = val_batch if full else count - count % partition.count
        if size == 0:
            raise ValueError(f"the validation conversations fill {count} rows, fewer than the {partition.count} "
                             "processes that share them: add validation conversations")
        read = _ReadRows(rows, _rows(size, partition, "val_batch"))
        for index in range(batches):
            yield read(np.arange(index * size, (index + 1) * size))

    return val_batches

