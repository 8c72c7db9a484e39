"""`TextProcessor`: strings to left-padded `ModelInputs`, with an `attention_mask` only when a row is padded."""

from __future__ import annotations

import numpy as np
import pytest

from dew.data.text_processor import TextProcessor
from dew.data.tokenizers import ByteTokenizer


def test_padding_is_marked_only_where_there_is_some():
    processor = TextProcessor(ByteTokenizer(), pad_id=0)
    padded = processor(["abc", "a"])
    np.testing.assert_array_equal(padded.tokens, [[97, 98, 99], [0, 0, 97]])
    np.testing.assert_array_equal(padded.token_fields["attention_mask"], [[True] * 3, [False, False, True]])
    level = processor(["ab", "cd"])
    assert "attention_mask" not in level.token_fields  # every slot is real: no mask at all
    assert processor.decode(level.tokens[0]) == "ab"


def test_bad_texts_are_refused():
    processor = TextProcessor(ByteTokenizer())
    with pytest.raises(ValueError, match="text 1 encodes to no tokens"):
        processor(["a", ""])
    with pytest.raises(TypeError, match="a string or a non-empty list of strings"):
        processor([1])
