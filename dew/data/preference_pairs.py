"""Preference pairs, the data of DPO: a JSONL file of `{"prompt", "chosen", "rejected"}` records, as TRL's
DPOTrainer reads them, tokenized into rows.

Each field is a string (plain text, no template) or a list of chat messages rendered with the chat
template (`dew.data.chat_template`); without `prompt`, chosen and rejected are whole conversations
whose messages before the last one are the prompt. Plain text responses end with the tokenizer's
EOS token when it has one. A batch holds `[B, seq_len + 1]` rows under `chosen` and `rejected`,
right-padded, and under `chosen_response` / `rejected_response` 1 on each response token (0 on the
prompt and the padding). `PreferencePairs` is the data source a run names (`data:preference-pairs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dew.data.chat import template_if_any
from dew.data.dataset import Dataset
from dew.data.records import count_rows, ordered_batches, read_records, shuffled_batches
from dew.data.tokenizers import load_tokenizer, tokenizer_name

SIDES = ("chosen", "rejected")


def _messages(value, where: str) -> list[dict] | None:
    """A record's field as chat messages (None for plain text), refused unless each has a role and content."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list) or not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                              for m in value):
        raise ValueError(f"{where} is {str(value)[:80]!r}: give a string, or a list of messages "
                         '[{"role": ..., "content": ...}]')
    return [dict(m) for m in value]


def _split_record(record: Mapping, where: str):
    """(prompt, chosen response, rejected response), as text (all strings) or messages (all lists)."""
    missing = [side for side in SIDES if side not in record]
    if missing:
        raise ValueError(f"{where} has no {missing[0]!r}; a preference record has 'chosen' and 'rejected' (and "
                         "'prompt', unless chosen and rejected are whole conversations)")
    sides = {side: _messages(record[side], f"{where} {side}") for side in SIDES}
    if "prompt" in record:
        prompt = _messages(record["prompt"], f"{where} prompt")
        if (prompt is None) != all(sides[side] is None for side in SIDES) or \
                any((sides[side] is None) != (sides["chosen"] is None) for side in SIDES):
            raise ValueError(f"{where} mixes plain text and chat messages among prompt, chosen and rejected; give "
                             "all three as strings or all as message lists")
        if prompt is None:
            return record["prompt"], record["chosen"], record["rejected"]
        responses = {}
        for side in SIDES:
            messages = sides[side]
            # A side that repeats the prompt (a whole conversation) must repeat it exactly.
            if len(messages) > len(prompt) and messages[:len(prompt)] == prompt:
                messages = messages[len(prompt):]
            elif messages[0].get("role") != "assistant":
                raise ValueError(f"the prompt of {where} differs between the prompt and {side}: {side} starts "
                                 f"with a {messages[0].get('role')!r} message that is not the prompt's; give "
                                 "chosen and rejected as the responses, or as conversations that begin with the "
                                 "prompt")
            responses[side] = messages
        return prompt, responses["chosen"], responses["rejected"]
    if any(sides[side] is None for side in SIDES):
        raise ValueError(f"{where} has no 'prompt', so chosen and rejected must be whole conversations (message "
                         "lists) whose last message is the response")
    chosen, rejected = sides["chosen"], sides["rejected"]
    if chosen[:-1] != rejected[:-1]:
        first = next((i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b),
                     min(len(chosen), len(rejected)) - 1)
        raise ValueError(f"the prompt of {where} differs between chosen and rejected (message {first} is "
                         f"{str(chosen[first])[:60]!r} in one and {str(rejected[first])[:60]!r} in the other): a "
                         "preference pair answers one prompt; fix the record, or give the prompt as 'prompt'")
    return chosen[:-1], chosen[-1:], rejected[-1:]


def _row(prompt, response, tokenizer, template, where: str) -> tuple[list[int], int]:
    """(the pair side's ids, how many of them are the prompt)."""
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt)
        # Plain text ends where the model should stop: with its EOS token, when it has one.
        response_ids = tokenizer.encode(response) + ([] if tokenizer.eos_id is None else [tokenizer.eos_id])
        return prompt_ids + response_ids, len(prompt_ids)
    if template is None:
        raise ValueError(f"{where} holds chat messages and no chat template was given: pass the tokenizer's (a "
                         "tokenizer directory that has one, or a Jinja file: --data.template FILE in dew train), or "
                         "give the pairs as plain text")
    prompt_text = template.render(prompt, add_generation_prompt=True)
    whole = template.render(prompt + response, add_generation_prompt=False)
    if not whole.startswith(prompt_text):
        raise ValueError(f"{where}: the chat template renders the conversation without its prompt's text as a "
                         "prefix (it rewrites earlier turns), so the response tokens cannot be told apart; use a "
                         "template that appends turns")
    prompt_ids = tokenizer.encode(prompt_text)
    return prompt_ids + tokenizer.encode(whole[len(prompt_text):]), len(prompt_ids)


def read_pairs(path: str | Path, tokenizer, seq_len: int, template=None, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The preference pairs of a JSONL file as batch rows (see the module): int32 `[N, seq_len + 1]`
    under `chosen`, `rejected`, `chosen_response`, `rejected_response`. A side longer than
    `seq_len + 1` tokens is refused, naming the line (nothing is truncated): raise `seq_len`, or drop
    or shorten the record."""
    width = seq_len + 1
    rows: dict[str, list] = {key: [] for key in (*SIDES, *(f"{side}_response" for side in SIDES))}
    for where, record in read_records(path, "preference"):
        prompt, chosen, rejected = _split_record(record, where)
        for side, response in zip(SIDES, (chosen, rejected)):
            ids, prompt_length = _row(prompt, response, tokenizer, template, f"{where} {side}")
            if len(ids) > width:
                raise ValueError(f"{where}: {side} is {len(ids)} tokens, beyond seq_len + 1 = {width}; raise "
                                 "seq_len, or shorten or drop the record (pairs are never truncated)")
            if len(ids) == prompt_length:
                raise ValueError(f"{where}: {side} has no response token; every side needs a response to score")
            padded = np.full(width, pad_id, np.int32)
            padded[:len(ids)] = ids
            response_mask = np.zeros(width, np.int32)
            response_mask[prompt_length:len(ids)] = 1
            rows[side].append(padded)
            rows[f"{side}_response"].append(response_mask)
    return {key: np.stack(value) for key, value in rows.items()}


def pair_dataset(train: Mapping[str, np.ndarray], batch: int, val: Mapping[str, np.ndarray] | None = None,
                 seed: int = 0, val_batch: int | None = None, meta: dict | None = None) -> Dataset:
    """A `Dataset` over `read_pairs` rows: each epoch a fresh shuffle (from `seed` and the epoch), cut
    into batches of `batch` pairs (the last partial batch of an epoch dropped); `val` in order, whole
    batches of `val_batch` (default `batch`). A plain iterator: a resumed run replays it to the same
    next batch."""
    return Dataset(train=shuffled_batches(train, batch, seed),
                   val=None if val is None else ordered_batches(val, val_batch or batch),
                   records=count_rows(train), batch=batch, meta=meta or {})


@dataclasses.dataclass(frozen=True)
class PreferencePairs:
    """Preference pairs from a JSONL file as batches of `read_pairs` rows, for `--objective dpo` (see the
    module). A batch holds `batch` pairs; each epoch reads them in a fresh seeded order."""

    path: str = "data/pairs.jsonl"
    """A JSONL file, one {"prompt", "chosen", "rejected"} record a line (TRL's DPO format)."""
    seq_len: int = 256
    """Tokens each side of a pair is scored on (a row holds one more); a longer side is refused, naming its line."""
    tokenizer: str | None = None
    """The tokenizer the pairs are tokenized with (and its chat template). In dew train, leave it unset: --tokenizer names the run's."""
    template: str | None = None
    """A Jinja chat template file for message records, instead of the tokenizer's own."""
    val_path: str | None = None
    """A JSONL file of validation pairs, read once in file order; None: no validation."""
    seed: int = 0
    """Seeds the order pairs are read in."""

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len is {self.seq_len}: a row needs at least 1 input token")

    def load(self, batch: int, *, val_batch: int | None = None) -> Dataset:
        """The train stream and validation pass, `batch` pairs per global train batch."""
        if self.tokenizer is None:
            raise ValueError("PreferencePairs tokenizes with a tokenizer: pass tokenizer= its name or directory (in "
                             "dew train, --tokenizer)")
        tokenizer = load_tokenizer(self.tokenizer)
        template = template_if_any(tokenizer, self.template)
        read = lambda path: read_pairs(path, tokenizer, self.seq_len, template)
        train = read(self.path)
        val = None if self.val_path is None else read(self.val_path)
        meta = {"tokenizer": tokenizer_name(self.tokenizer), "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id, "seq_len": self.seq_len,
                "template": None if template is None else template.source, "pairs": count_rows(train),
                "val_pairs": None if val is None else count_rows(val)}
        return pair_dataset(train, batch, val, self.seed, val_batch, meta)
