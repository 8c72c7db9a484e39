"""TextGeneration tasks from an objective and a training state."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data import ByteTokenizer
from dew.objectives.lm import LMObjective, Samples
from dew.sampling import Sampling


@pytest.fixture(scope="module")
def byte_model():
    from dew import models

    return models.build("causal_transformer", vocab_size=256, emb_features=32, num_layers=1, num_heads=2,
                        mlp_features=64, max_seq_len=48)


def test_pipeline_reads_the_averaged_weights_and_the_preview_policy(byte_model):
    tokenizer = ByteTokenizer()
    samples = Samples(prompt=tokenizer.encode("ab"), max_new_tokens=5, sampling=Sampling(temperature=0.0),
                      decode=tokenizer.decode)
    objective = LMObjective(byte_model, 16, ema_decay=0.5, samples=samples)
    state = Trainer(objective, optax.sgd(0.5), key=jax.random.key(0)).init_state()
    state = state.replace(params=jax.tree_util.tree_map(lambda x: x * 2.0, state.params))  # live != averaged
    task = objective.pipeline(state, processor=tokenizer)
    assert task.params is state.ema and task.max_new_tokens == 5 and task.sampling.greedy
    result = task("hello", seed=1)
    assert result.text[0].startswith("hello") and result.tokens.shape == (1, 10)
    live = objective.pipeline(state, ema=False, processor=tokenizer)("hello", seed=1)
    assert not np.allclose(live.log_probs, result.log_probs)


def test_policy_takes_ids_and_refuses_text_without_a_tokenizer(byte_model):
    objective = LMObjective(byte_model, 16, ema_decay=None)
    params = objective.init(jax.random.key(0))
    task = objective.policy(params, Sampling(temperature=1.0, top_k=8))
    first = task([[1, 2, 3], [4, 5, 6]], 4, seed=3, n=2)
    again = task([[1, 2, 3], [4, 5, 6]], 4, seed=3, n=2)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert first.tokens.shape == (4, 7)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        task("hello", 4)
    with pytest.raises(ValueError, match="no default budget"):
        task([[1, 2]])
