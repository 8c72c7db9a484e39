"""Prompts for GRPO from JSONL: text and chat prompts as rows, records kept whole, batches of whole groups,
and each refusal naming its line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dew.data.chat_template import ChatTemplate
from dew.data.dataset import Partition
from dew.data.prompts import Prompts, read_prompts
from dew.data.tokenizers import ByteTokenizer

CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_text_and_chat_prompts_become_rows_with_their_records(tmp_path):
    path = _write(tmp_path / "prompts.jsonl", [
        {"prompt": "2+2=", "answer": "4"},
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "hello", "id": 7},
    ])
    rows = read_prompts(path, ByteTokenizer(), seq_len=40, template=ChatTemplate(CHATML, {}, "test"),
                        fields=("answer",))
    assert rows["prompt"].shape == (2, 41) and rows["prompt"].dtype == np.int32
    assert rows["prompt_length"].tolist() == [4, len("<|user|>hi<|end|><|assistant|>")]
    assert bytes(rows["prompt"][1, :rows["prompt_length"][1]].tolist()).decode() == "<|user|>hi<|end|><|assistant|>"
    assert rows["record"][1] == {"prompt": [{"role": "user", "content": "hi"}], "answer": "hello", "id": 7}
    assert not rows["prompt"][0, 4:].any()  # right-padded with 0


@pytest.mark.parametrize("records, options, message", [
    ([{"question": "2+2="}], {}, "line 1 has no 'prompt'"),
    ([{"prompt": "2+2="}, {"prompt": "3+3="}], {"fields": ("answer",)}, "line 1 has no 'answer' field"),
    ([{"prompt": [{"role": "user", "content": "hi"}]}], {}, "holds chat messages and no chat template was given"),
    ([{"prompt": "a long prompt"}], {"seq_len": 8}, r"line 1: the prompt is 13 tokens, and a row of seq_len \+ 1 = 9"),
    ([{"prompt": ""}], {}, "line 1: the prompt is empty"),
])
def test_refusals_name_the_line(tmp_path, records, options, message):
    path = _write(tmp_path / "prompts.jsonl", records)
    with pytest.raises(ValueError, match=message):
        read_prompts(path, ByteTokenizer(), **{"seq_len": 32, **options})


def test_batches_hold_whole_groups_and_replay_in_order(tmp_path):
    path = _write(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)])
    data = Prompts(path=path, seq_len=12, tokenizer="byte", val_path=path).load(8, val_batch=12, completions=4)
    assert data.batch == 8 and data.records == 6 and data.meta["longest_prompt"] == 4
    first, again = data.train(Partition()), data.train(Partition())
    for _ in range(4):  # two prompts a batch, a fresh order each epoch of 3 batches
        batch = next(first)
        assert batch["prompt"].shape == (2, 13) and len(batch["record"]) == 2
        np.testing.assert_array_equal(batch["prompt"], next(again)["prompt"])
    val = list(data.val(Partition()))
    assert len(val) == 2 and [record["answer"] for record in val[0]["record"]] == ["0", "2", "4"]
    with pytest.raises(ValueError, match="batch 6 is not a whole number of prompts of 4 completions each"):
        Prompts(path=path, tokenizer="byte").load(6, completions=4)
