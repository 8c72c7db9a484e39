"""DPOObjective: the loss by hand and by TRL's formula on the same log-likelihoods, pairs read from JSONL
through a chat template, prompts that differ refused, and a LoRA run against the frozen EMA reference."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data.chat_template import ChatTemplate
from dew.data.tokenizers import ByteTokenizer
from dew.nn.lora import LoRA
from dew.objectives.base import Step
from dew.objectives.preference import DPOObjective, dpo_losses, pair_dataset, read_pairs
from tests.compiled import compiled
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

SEQ = 8
CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_the_sigmoid_loss_by_hand():
    # z = beta * ((-3 + 4) - (-5 + 4)) = 1; loss = 0.9 * -log sigmoid(1) + 0.1 * -log sigmoid(-1).
    losses, chosen, rejected = dpo_losses(jnp.asarray([-3.0]), jnp.asarray([-5.0]), jnp.asarray([-4.0]),
                                          jnp.asarray([-4.0]), beta=0.5, label_smoothing=0.1)
    expected = 0.9 * math.log1p(math.exp(-1.0)) + 0.1 * math.log1p(math.exp(1.0))
    # fp32: a few roundings and two log-sigmoids (LIBRARY_ULPS each) of values near 1. Observed: 0.
    assert abs(float(losses[0]) - expected) <= ulp_bound(2 * LIBRARY_ULPS + 6, 1.5)
    assert float(chosen[0]) == 0.5 and float(rejected[0]) == -0.5


def _pairs(seed: int, rows: int = 3) -> dict[str, np.ndarray]:
    """Random pairs sharing each prompt (2 to 4 tokens), responses of different lengths, right padding."""
    rng = np.random.default_rng(seed)
    batch = {key: np.zeros((rows, SEQ + 1), np.int32) for key in
             ("chosen", "rejected", "chosen_response", "rejected_response")}
    for row in range(rows):
        prompt = rng.integers(1, 64, int(rng.integers(2, 5)))
        for side in ("chosen", "rejected"):
            response = rng.integers(1, 64, int(rng.integers(1, SEQ + 2 - len(prompt))))
            ids = np.concatenate([prompt, response])
            batch[side][row, :len(ids)] = ids
            batch[f"{side}_response"][row, len(prompt):len(ids)] = 1
    return batch


def _by_hand(model, variables, tokens, response) -> np.ndarray:
    """Each row's response log-likelihood from the model's whole logits, log-softmax in float64."""
    logits = np.asarray(compiled(model.apply, variables, jnp.asarray(tokens[:, :-1])), np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    picked = np.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    return (picked * response[:, 1:]).sum(1)


def test_the_loss_equals_trls_formula_on_the_same_log_likelihoods(tiny_model, tiny_variables):
    beta, smoothing = 0.3, 0.2
    objective = DPOObjective(tiny_model, SEQ, beta=beta, label_smoothing=smoothing)
    reference = compiled(tiny_model.init, jax.random.key(7), jnp.zeros((1, SEQ), jnp.int32), head=False)
    batch = _pairs(0)
    objective.check_batch(batch)
    stats = objective.evaluate(tiny_variables, {k: jnp.asarray(v) for k, v in batch.items()},
                               Step(0, jax.random.key(0)), reference=reference)
    pc, pr, rc, rr = (_by_hand(tiny_model, params, batch[side], batch[f"{side}_response"])
                      for params in (tiny_variables, reference) for side in ("chosen", "rejected"))
    # TRL's DPOTrainer, loss_type "sigmoid", as its documentation writes it, in float64.
    logits = (pc - pr) - (rc - rr)
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)
    trl = -log_sigmoid(beta * logits) * (1 - smoothing) - log_sigmoid(-beta * logits) * smoothing
    # fp32 against float64 from the same weights. Per target: the chunked head's float32 log-sum-exp of
    # 64 terms of at most 1 (after the maximum), 66 roundings of 1 in the log; each logit's 32-term
    # product summed in another order, 34 roundings of twice the largest logit; the result, one of
    # log 64 plus that. A sequence adds SEQ targets (SEQ roundings of their sum). The loss and each
    # reward move by at most beta per unit of each of the four log-likelihoods, and the log-sigmoids
    # add LIBRARY_ULPS each. Summed over the 3 pairs: bound 4.7e-4 for the losses (observed 3.2e-7) and
    # for the margins (observed 7.8e-7, of a summed margin of 1.7e-2).
    logit = max(float(np.abs(np.asarray(compiled(tiny_model.apply, params, jnp.asarray(batch[side][:, :-1])))).max())
                for params in (tiny_variables, reference) for side in ("chosen", "rejected"))
    size = math.log(64) + 2 * logit
    per_sequence = SEQ * (ulp_bound(66, 1.0) + ulp_bound(34, 2 * logit) + ulp_bound(1, size)) + ulp_bound(SEQ, SEQ * size)
    pairs = len(trl)
    bound = pairs * (4 * beta * per_sequence + ulp_bound(2 * LIBRARY_ULPS + 4, trl.max()))
    assert_within(float(stats.loss.total), trl.sum(), bound, "summed pair losses")
    assert float(stats.loss.count) == 3
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    assert_within(float(stats.reward_margin.total), (chosen - rejected).sum(), pairs * 4 * beta * per_sequence, "margin")
    assert float(stats.reward_accuracy.total) == float((chosen > rejected).sum())


def test_pairs_read_through_the_chat_template(tmp_path):
    template = ChatTemplate(CHATML, {}, "test")
    records = [
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "assistant", "content": "go"}]},
        # implicit prompt: whole conversations sharing all but their last message
        {"chosen": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
         "rejected": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "5"}]},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    tokenizer = ByteTokenizer()
    rows = read_pairs(path, tokenizer, seq_len=63, template=template)
    assert rows["chosen"].shape == (2, 64)
    decode = lambda ids: bytes(int(i) for i in ids).decode()
    for row, (prompt, response) in enumerate((("<|user|>hi<|end|><|assistant|>", "hello<|end|>"),
                                              ("<|user|>2+2<|end|><|assistant|>", "4<|end|>"))):
        mask = rows["chosen_response"][row] > 0
        start = int(np.argmax(mask))
        assert decode(rows["chosen"][row][:start]) == prompt
        assert decode(rows["chosen"][row][mask]) == response
    with pytest.raises(ValueError, match="holds chat messages and no chat template was given"):
        read_pairs(path, tokenizer, seq_len=63)
    with pytest.raises(ValueError, match=r"line 1: chosen is 42 tokens, beyond seq_len \+ 1 = 17"):
        read_pairs(path, tokenizer, seq_len=16, template=template)


def test_pairs_whose_prompt_differs_are_refused(tmp_path, tiny_model):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({
        "chosen": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "5"}]}) + "\n")
    with pytest.raises(ValueError, match="the prompt of .* line 1 differs between chosen and rejected"):
        read_pairs(path, ByteTokenizer(), seq_len=63, template=ChatTemplate(CHATML, {}, "test"))
    batch = _pairs(1)
    batch["rejected"][2, 0] = (batch["chosen"][2, 0] + 1) % 64  # its first prompt token
    with pytest.raises(ValueError, match="the prompt of pair 2 differs between chosen"):
        DPOObjective(tiny_model, SEQ).check_batch(batch)


@pytest.mark.slow
def test_lora_dpo_raises_reward_accuracy_against_the_frozen_reference(tiny_model, tiny_variables):
    model = LoRA(rank=4, alpha=8.0).adapt(tiny_model)
    start = model.attach(jax.random.key(0), tiny_variables)
    objective = DPOObjective(model, SEQ, beta=0.5, pretrained=start, trainable=LoRA.trainable)
    rows = _pairs(2, rows=8)
    data = pair_dataset(rows, batch=8, val=rows)
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1))
    state = trainer.fit(data, steps=12, log_every=1, eval_every=12, verbose=False)
    losses = [record["train/loss"] for record in trainer.history if "train/loss" in record]
    # The policy starts as the reference: every z is 0 and every pair's loss log 2 (fp32, one log-sigmoid).
    assert abs(losses[0] - math.log(2)) <= ulp_bound(LIBRARY_ULPS + 2, 1.0)
    val = trainer.history[-1]
    assert val["val/reward_accuracy"] == 1.0 and val["val/loss"] < 0.5 * math.log(2), val
    # The reference never moved: the EMA slot holds the starting adapters, bit for bit.
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.ema["params"]):
        expected = start["params"]
        for entry in path:
            expected = expected[entry.key]
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected))
