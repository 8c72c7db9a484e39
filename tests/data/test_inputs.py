"""`ModelInputs` through the decoder and generation: the same results as bare ids and keywords."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dew.data import ModelInputs
from dew.sampling import Sampling, generate


def _padded():
    tokens = np.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]], np.int32)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    return ModelInputs.of(tokens, attention_mask=mask)


def test_the_decoder_reads_inputs_as_it_reads_their_keywords(tiny_model, tiny_variables):
    inputs = _padded()
    whole = np.asarray(tiny_model.apply(tiny_variables, inputs))
    keywords = np.asarray(tiny_model.apply(tiny_variables, inputs.tokens, **inputs.kwargs()))
    np.testing.assert_array_equal(whole, keywords)
    # The padded row's real tokens score as they do alone: padding is read by no real token.
    alone = np.asarray(tiny_model.apply(tiny_variables, np.array([[5, 6, 7]], np.int32)))
    # fp32 logits of order 0.1 through two layers; only the padded keys' zero weights differ: 8 ulps.
    np.testing.assert_allclose(whole[0, 2:], alone[0], rtol=0, atol=8 * 0.1 * np.finfo(np.float32).eps)


def test_rows_are_taken_with_every_field():
    taken = _padded().take_rows(np.array([1, 0, 1]))
    np.testing.assert_array_equal(np.asarray(taken.tokens)[:, 0], [1, 0, 1])
    np.testing.assert_array_equal(np.asarray(taken.token_fields["attention_mask"])[1], [0, 0, 1, 1, 1])
    assert taken.valid_rows() == [[1, 2, 3, 4, 5], [5, 6, 7], [1, 2, 3, 4, 5]]


def test_generation_takes_inputs_and_refuses_media(tiny_model, tiny_variables):
    greedy = Sampling(temperature=0.0)
    inputs = _padded()
    from_inputs = generate(tiny_model, tiny_variables, inputs, 4, key=jax.random.key(0), sampling=greedy)
    from_ids = generate(tiny_model, tiny_variables, [[5, 6, 7], [1, 2, 3, 4, 5]], 4, key=jax.random.key(0),
                        sampling=greedy)
    np.testing.assert_array_equal(from_inputs.tokens, from_ids.tokens)
    media = ModelInputs(inputs.tokens, inputs.token_fields, {"pixel_values": np.zeros((2, 1, 3, 4, 4))})
    with pytest.raises(ValueError, match=r"takes text only and has no place for \['pixel_values'\]"):
        generate(tiny_model, tiny_variables, media, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="token field 'attention_mask' has shape"):
        ModelInputs.of(np.zeros((2, 5), np.int32), attention_mask=np.zeros((2, 4)))
