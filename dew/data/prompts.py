"""Prompts, the data of GRPO: a JSONL file of `{"prompt": ..., ...}` records, as TRL's GRPOTrainer reads them.

`prompt` is a string (plain text, no template) or a list of chat messages, rendered with the chat
template and the opening of the assistant's turn (`add_generation_prompt`). Every other field of the
record is kept whole and handed to the rewards with each completion (an `answer` to compare with,
say). A batch holds `prompt`, int32 `[P, seq_len + 1]` ids right-padded with 0, `prompt_length`,
int32 `[P]`, and `record`, the `[P]` records themselves (objects: the batch is read on the host and
never placed on a device); `GRPOObjective.on_policy_batch` draws the completions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dew.data.chat import check_messages, template_if_any
from dew.data.dataset import Dataset
from dew.data.records import count_rows, ordered_batches, read_records, shuffled_batches
from dew.data.tokenizers import load_tokenizer, tokenizer_name


def read_prompts(path: str | Path, tokenizer, seq_len: int, template=None,
                 fields: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The prompts of a JSONL file as rows (see the module). A prompt needs room for at least one
    completion token in a row of `seq_len + 1`; a longer one, or a record without one of `fields`
    (those its rewards read), is refused, naming its line."""
    width = seq_len + 1
    ids_rows, lengths, records = [], [], []
    for where, record in read_records(path, "prompts"):
        if "prompt" not in record:
            raise ValueError(f"{where} has no 'prompt'; a prompt record is {{\"prompt\": text or messages, ...the "
                             "fields its rewards read}")
        missing = [field for field in fields if field not in record]
        if missing:
            raise ValueError(f"{where} has no {missing[0]!r} field, which its rewards read: add it to every record, "
                             "or choose rewards that do not read it")
        prompt = record["prompt"]
        if isinstance(prompt, str):
            text = prompt
        else:
            messages = check_messages(prompt, where)
            if template is None:
                raise ValueError(f"{where} holds chat messages and no chat template was given: pass the tokenizer's "
                                 "(a tokenizer directory that has one, or a Jinja file: --data.template FILE in dew "
                                 "train), or give the prompts as plain text")
            text = template.render(messages, add_generation_prompt=True)
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError(f"{where}: the prompt is empty; a rollout continues at least one token")
        if len(ids) >= width:
            raise ValueError(f"{where}: the prompt is {len(ids)} tokens, and a row of seq_len + 1 = {width} leaves "
                             "it no room for a completion: raise seq_len (--data.seq-len), or shorten or drop it")
        row = np.zeros(width, np.int32)
        row[:len(ids)] = ids
        ids_rows.append(row)
        lengths.append(len(ids))
        records.append(record)
    kept = np.empty(len(records), object)
    kept[:] = records
    return {"prompt": np.stack(ids_rows), "prompt_length": np.asarray(lengths, np.int32), "record": kept}


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Prompts from a JSONL file for `--objective grpo`, each completed by the policy at every step
    that reads it (see the module). Each epoch reads them in a fresh seeded order."""

    path: str = "data/prompts.jsonl"
    """A JSONL file, one {"prompt": text or messages, ...} record a line (TRL's GRPO format); the other fields go to the rewards."""
    seq_len: int = 512
    """Tokens a row holds past its first: the prompt plus its completion, each row seq_len + 1 ids."""
    tokenizer: str | None = None
    """The tokenizer the prompts are tokenized with (and its chat template). In dew train, leave it unset: --tokenizer names the run's."""
    template: str | None = None
    """A Jinja chat template file for message prompts, instead of the tokenizer's own."""
    val_path: str | None = None
    """A JSONL file of validation prompts, read once in file order; None: no validation."""
    seed: int = 0
    """Seeds the order prompts are read in."""

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len is {self.seq_len}: a row needs at least 1 input token")

    def load(self, batch: int, *, val_batch: int | None = None, completions: int = 1,
             fields: Sequence[str] = ()) -> Dataset:
        """The train stream and validation pass of a run whose steps train on `batch` rows: `completions`
        rows for each prompt, so `batch / completions` prompts a batch (`val_batch` likewise). Every
        record must have `fields` (those its rewards read)."""
        if self.tokenizer is None:
            raise ValueError("Prompts tokenizes with a tokenizer: pass tokenizer= its name or directory (in dew train, "
                             "--tokenizer)")
        for name, rows in (("batch", batch), ("val_batch", val_batch or batch)):
            if rows % completions:
                raise ValueError(f"{name} {rows} is not a whole number of prompts of {completions} completions each: "
                                 f"use a multiple of {completions}")
        tokenizer = load_tokenizer(self.tokenizer)
        template = template_if_any(tokenizer, self.template)
        read = lambda path: read_prompts(path, tokenizer, self.seq_len, template, fields)
        train = read(self.path)
        val = None if self.val_path is None else read(self.val_path)
        meta = {"tokenizer": tokenizer_name(self.tokenizer), "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id, "seq_len": self.seq_len,
                "template": None if template is None else template.source, "prompts": count_rows(train),
                "longest_prompt": max(int(rows["prompt_length"].max()) for rows in (train, val) if rows is not None),
                "val_prompts": None if val is None else count_rows(val)}
        return Dataset(train=shuffled_batches(train, batch // completions, self.seed),
                       val=None if val is None else ordered_batches(val, (val_batch or batch) // completions),
                       records=count_rows(train), batch=batch, meta=meta)
