"""The rewards that ship with Dew, by hand, and `TextRewards` summing them over decoded completions."""

from __future__ import annotations

import pytest

from dew.data.tokenizers import ByteTokenizer
from dew.objectives.rewards import REWARDS, Completion, TextRewards

RECORD = {"prompt": "2+2=", "answer": " 4 ", "solution": 5}


@pytest.mark.parametrize("name, text, finished, expected", [
    ("exact_match", "4", True, 1.0), ("exact_match", " 4\n", False, 1.0), ("exact_match", "44", True, 0.0),
    ("think_format", "<think>2 and 2</think>4", True, 1.0), ("think_format", "4<think>x</think>", True, 0.0),
    ("think_format", "<think>a</think><think>b</think>4", True, 0.0),
    ("finished", "4", True, 1.0), ("finished", "4", False, 0.0),
])
def test_each_reward_by_hand(name, text, finished, expected):
    assert REWARDS[name](Completion(text, finished, RECORD), "answer") == expected


def test_text_rewards_decode_drop_the_eos_and_sum():
    rewards = TextRewards(["exact_match", "finished"], ByteTokenizer(), eos_ids=(10,))
    assert rewards([50, 43, 50, 61], list(b"4\n"), RECORD) == 2.0  # the answer, then the EOS
    assert rewards([50, 43, 50, 61], list(b"4"), RECORD) == 1.0  # cut at the budget: right, not finished
    assert rewards([50, 43, 50, 61], list(b"5\n"), RECORD) == 1.0
    assert TextRewards(["exact_match"], ByteTokenizer(), (), answer_field="solution")([], list(b"5"), RECORD) == 1.0
    with pytest.raises(ValueError, match=r"rewards \['accuracy'\]: name one or more of"):
        TextRewards(["accuracy"], ByteTokenizer(), ())
