"""The rewards that ship with Dew for GRPO, chosen by name (`dew train --objective grpo --grpo.rewards ...`).

A reward scores one completion as text: `reward(completion, answer_field) -> float`, where the
`Completion` holds the decoded text (without its ending EOS token), whether the policy ended it with
an EOS token before the budget ran out, and the prompt's record (`dew.data.prompts`). `TextRewards`
sums the chosen ones into the `reward(prompt_ids, completion_ids, record)` that `GRPOObjective` calls.

- `exact_match`: 1 when the text, stripped of surrounding whitespace, is the record's answer field
  (`answer` by default; `str` of the value, stripped), else 0.
- `think_format`: 1 when the text is `<think>...</think>` then the answer, one think block at the
  start (TRL's `think_format_reward`), else 0.
- `finished`: 1 when the completion ended with an EOS token rather than at the length budget, else 0.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Completion:
    """One completion as the rewards read it."""

    text: str
    finished: bool
    record: Mapping[str, Any]


def exact_match(completion: Completion, answer_field: str) -> float:
    return float(completion.text.strip() == str(completion.record[answer_field]).strip())


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def think_format(completion: Completion, answer_field: str) -> float:
    return float(_THINK.match(completion.text) is not None)


def finished(completion: Completion, answer_field: str) -> float:
    return float(completion.finished)


REWARDS: dict[str, Callable[[Completion, str], float]] = {
    "exact_match": exact_match, "think_format": think_format, "finished": finished}
"""Each reward by the name `--grpo.rewards` takes."""
READS_ANSWER = ("exact_match",)
"""The rewards that read the record's answer field."""


class TextRewards:
    """The sum of the rewards `names` as `GRPOObjective`'s `reward(prompt_ids, completion_ids, record)`:
    the completion's ids decoded with `tokenizer`, an ending id of `eos_ids` dropped from the text and
    counted as finished."""

    def __init__(self, names: Sequence[str], tokenizer, eos_ids: Sequence[int], answer_field: str = "answer"):
        unknown = [name for name in names if name not in REWARDS]
        if unknown or not names:
            raise ValueError(f"rewards {list(names)}: name one or more of {sorted(REWARDS)}")
        self.rewards = [REWARDS[name] for name in names]
        self.tokenizer, self.eos_ids, self.answer_field = tokenizer, tuple(eos_ids), answer_field

    def __call__(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], record: Mapping[str, Any]) -> float:
        ended = bool(completion_ids) and completion_ids[-1] in self.eos_ids
        text = self.tokenizer.decode(list(completion_ids[:-1] if ended else completion_ids))
        completion = Completion(text, ended, record)
        return sum(reward(completion, self.answer_field) for reward in self.rewards)
