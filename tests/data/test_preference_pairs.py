"""The data:preference-pairs source: pairs tokenized with the tokenizer's chat template or a template file,
plain text without one, validation in file order, and its metadata."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dew.data.dataset import Partition
from dew.data.preference_pairs import PreferencePairs

CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_message_pairs_read_through_a_template_file(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(CHATML)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}],
                                        "chosen": [{"role": "assistant", "content": "yes"}],
                                        "rejected": [{"role": "assistant", "content": "no"}]}) + "\n"
                            for i in range(5)))
    data = PreferencePairs(path=str(path), seq_len=40, tokenizer="byte", template=str(template),
                           val_path=str(path)).load(2, val_batch=4)
    assert data.meta["pairs"] == 5 and data.meta["val_pairs"] == 5 and data.meta["template"] == str(template)
    batch = next(data.train(Partition()))
    assert batch["chosen"].shape == (2, 41)
    response = batch["chosen"][0][batch["chosen_response"][0] > 0]
    assert bytes(response.tolist()).decode() == "yes<|end|>"
    assert len(list(data.val(Partition()))) == 1  # one whole batch of 4; the fifth pair is left over
    with pytest.raises(ValueError, match="holds chat messages and no chat template was given"):
        PreferencePairs(path=str(path), tokenizer="byte").load(2)


def test_plain_text_pairs_need_no_template(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "5"}) + "\n")
    data = PreferencePairs(path=str(path), seq_len=8, tokenizer="byte").load(1)
    assert data.meta["template"] is None and data.val is None
    batch = next(data.train(Partition()))
    np.testing.assert_array_equal(batch["rejected"][0, :5], list(b"2+2=5"))
    np.testing.assert_array_equal(batch["rejected_response"][0, :6], [0, 0, 0, 0, 1, 0])
