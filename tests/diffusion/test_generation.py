"""Masked generation: MDLM's Unmask sampler through `process.generate` and `MaskedGeneration`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import ByteTokenizer
from dew.data.inputs import ModelInputs
from dew.diffusion.unmask import compiled_refinement, inverse_cdf
from dew.inference import CanvasGeneration, MaskedGeneration
from tests.diffusion.conftest import MASK_ID, VOCAB

KEY = jax.random.key(7)


def test_the_default_is_64_evaluations_the_last_a_clean_prediction(masked_model, masked_variables, process):
    drawn = process.generate(masked_model, masked_variables, [[1, 2, 3]], 6, key=KEY)
    assert isinstance(drawn, CanvasGeneration) and list(drawn.refinements) == [64]
    assert not hasattr(drawn, "log_probs")
    # 63 sampling evaluations in one scan, then one more outside it: the clean prediction.
    run = compiled_refinement(masked_model, process.schedule, MASK_ID, 64, 16)
    canvas = np.zeros((1, 22), np.int32)
    jaxpr = jax.make_jaxpr(run)(masked_variables, canvas, np.ones_like(canvas), jax.random.split(KEY, 1))
    scans = [eqn for eqn in jaxpr.eqns[0].params["jaxpr"].eqns if eqn.primitive.name == "scan"]
    assert [eqn.params["length"] for eqn in scans] == [63]
    # With one evaluation, there is only the clean prediction: the argmax of the all-masked canvas.
    once = process.generate(masked_model, masked_variables, [[1, 2, 3]], 6, key=KEY, steps=1)
    canvas = jnp.asarray([[1, 2, 3] + [MASK_ID] * 6])
    logits = masked_model.apply(masked_variables, canvas)[0, 3:].at[:, MASK_ID].set(-jnp.inf)
    assert once.continuations()[0] == list(np.asarray(jnp.argmax(logits, -1))) and list(once.refinements) == [1]


def test_tokens_are_drawn_from_the_softmax_and_never_at_probability_zero():
    logits = jnp.asarray([-jnp.inf, 0.0, 1.0, -jnp.inf, 2.0, -1.0, -jnp.inf], jnp.float32)
    rows = 200_000
    drawn = np.asarray(inverse_cdf(jax.random.key(0), jnp.tile(logits, (rows, 1))))
    frequencies = np.bincount(drawn, minlength=7) / rows
    probabilities = np.asarray(jax.nn.softmax(logits), np.float64)
    # Independent draws: each frequency lies within six standard deviations of its probability.
    assert (np.abs(frequencies - probabilities) <= 6 * np.sqrt(probabilities * (1 - probabilities) / rows)).all()
    assert frequencies[[0, 3, 6]].sum() == 0


def test_mask_ids_are_never_drawn_and_the_prompt_stays(masked_model, masked_variables, process):
    # Make the mask the model's favourite prediction everywhere: the sampler must still never write it.
    favoured = jax.tree_util.tree_map(lambda x: x, masked_variables)
    favoured["params"]["lm_head"]["kernel"] = masked_variables["params"]["lm_head"]["kernel"].at[:, MASK_ID].set(50.0)
    prompt = [5, MASK_ID, 9]  # a literal mask id in the prompt stays as it is
    for steps in (64, 3):
        drawn = process.generate(masked_model, favoured, [prompt], 12, key=KEY, steps=steps, n=3)
        assert (drawn.tokens[:, :3] == prompt).all()
        responses = np.asarray(drawn.continuations())
        assert responses.shape == (3, 12) and not (responses == MASK_ID).any() and (responses < VOCAB).all()


def test_eos_is_applied_after_refinement(masked_model, masked_variables, process):
    whole = process.generate(masked_model, masked_variables, [[3, 1, 4]], 10, key=KEY)
    response = whole.continuations()[0]
    stop = response[4]
    first = response.index(stop)
    cut = process.generate(masked_model, masked_variables, [[3, 1, 4]], 10, key=KEY, eos_token_ids=(stop,), pad_id=47)
    assert bool(cut.terminated[0]) and int(cut.new_tokens[0]) == first + 1 and int(cut.lengths[0]) == 3 + first + 1
    assert cut.continuations()[0] == response[: first + 1]  # the same refinement, cut after its first EOS
    assert list(cut.tokens[0, 3 + first + 1:]) == [47] * (10 - first - 1)
    assert not whole.terminated[0] and int(whole.lengths[0]) == 13


def test_continuations_are_grouped_by_prompt_and_zero_does_not_change(masked_model, masked_variables, process):
    prompts = [[1, 2, 3], [4, 5]]
    one = process.generate(masked_model, masked_variables, prompts, 8, key=KEY, n=1)
    three = process.generate(masked_model, masked_variables, prompts, 8, key=KEY, n=3)
    assert three.tokens.shape == (6, 11) and list(three.lengths) == [11, 11, 11, 10, 10, 10]
    assert three.continuations()[0] == one.continuations()[0] and three.continuations()[3] == one.continuations()[1]
    assert len({tuple(row) for row in three.continuations()[:3]}) > 1  # continuations of one prompt differ
    again = process.generate(masked_model, masked_variables, prompts, 8, key=KEY, n=3)
    np.testing.assert_array_equal(again.tokens, three.tokens)


def test_zero_tokens_keep_the_prompt(masked_model, masked_variables, process):
    drawn = process.generate(masked_model, masked_variables, [[1, 2, 3], [4]], 0, key=KEY, n=2)
    assert drawn.tokens.tolist() == [[1, 2, 3], [1, 2, 3], [4, 0, 0], [4, 0, 0]]
    assert list(drawn.lengths) == [3, 3, 1, 1] and list(drawn.refinements) == [0] * 4 and not drawn.terminated.any()


def test_the_task_refuses_autoregressive_controls_by_name(masked_model, masked_variables, process):
    task = MaskedGeneration(masked_model, masked_variables, process, tokenizer=ByteTokenizer(), max_new_tokens=4)
    result = task([[1, 2]], seed=3, steps=8, n=2, use_cache=False)
    assert result.tokens.shape == (2, 6) and list(result.refinements) == [8, 8]
    inputs = ModelInputs.of(np.asarray([[0, 1, 2]]), attention_mask=np.asarray([[0, 1, 1]]))
    assert task(inputs, seed=3, steps=8).continuations()[0] == result.continuations()[0]
    for name, value, kind in (("temperature", 0.7, "sampling"), ("num_beams", 4, "beam"),
                              ("logits_processor", [], "logits"), ("on_token", print, "streaming")):
        with pytest.raises(ValueError, match=f"{name}=.* is an autoregressive {kind} control.*drop {name}"):
            task([[1, 2]], **{name: value})
    with pytest.raises(ValueError, match="use_cache=True: masked diffusion keeps no KV cache"):
        task([[1, 2]], use_cache=True)
    with pytest.raises(TypeError, match="unexpected keyword stepz=3"):
        task([[1, 2]], stepz=3)
    with pytest.raises(ValueError, match="no autoregressive policy to replace"):
        task.with_sampling(None)
    stopping = dataclasses.replace(task, eos_token_ids=(result.continuations()[0][0],))
    assert int(stopping([[1, 2]], seed=3, steps=8).new_tokens[0]) == 1


def test_bad_requests_are_refused(masked_model, masked_variables, process):
    with pytest.raises(ValueError, match=r"plus max_new_tokens 46 is 49, beyond the model's max_seq_len 48"):
        process.generate(masked_model, masked_variables, [[1, 2, 3]], 46, key=KEY)
    with pytest.raises(ValueError, match="prompt 0 holds token id 60, outside the model's vocab_size 49"):
        process.generate(masked_model, masked_variables, [[60]], 4, key=KEY)
    with pytest.raises(ValueError, match="steps is 0"):
        process.generate(masked_model, masked_variables, [[1]], 4, key=KEY, steps=0)
    with pytest.raises(ValueError, match="max_new_tokens is -1"):
        process.generate(masked_model, masked_variables, [[1]], -1, key=KEY)
