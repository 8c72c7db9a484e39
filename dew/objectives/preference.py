"""`DPOObjective`: direct preference optimisation over chosen and rejected responses to one prompt.

The loss of a pair is DPO's sigmoid loss (Rafailov et al., 2023), with the conservative label
smoothing of cDPO: with `z = beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) -
log ref(rejected)))`, each sequence's log-likelihood summed over its response tokens,
`loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`. The reference is the frozen copy the
trainer keeps in the EMA slot at `ema_decay` 1.0: the starting weights, never moved (with LoRA, the
starting adapters over the frozen base), which the trainer hands to the loss as `reference`.

Pairs come from JSONL (`read_pairs`): one record a line, `{"prompt", "chosen", "rejected"}`, each a
string (plain text, no template) or a list of chat messages rendered with the checkpoint's chat
template (`dew.data.chat_template`); without `prompt`, chosen and rejected are whole conversations
whose messages before the last one are the prompt. A batch holds `[B, seq_len + 1]` rows under
`chosen` and `rejected`, right-padded, and under `chosen_response` / `rejected_response` 1 on each
response token (0 on the prompt and the padding).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.data.dataset import Dataset
from dew.objectives.base import Mean, MeanLossNoEffects, PathFilter, ScoredByLM, Step, Variables, path_filter
from dew.objectives.checks import check_decoder_objective
from dew.objectives.lm import LMObjective

SIDES = ("chosen", "rejected")


# -- data ----------------------------------------------------------------------------------------

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
        raise ValueError(f"{where} holds chat messages and no chat template was given: pass the checkpoint's "
                         "(dew.data.chat_template.chat_template(directory)), or give the pairs as plain text")
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
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not JSON ({error.msg}); a preference file holds one record a line") from None
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
    if not rows["chosen"]:
        raise ValueError(f"{path} holds no preference record")
    return {key: np.stack(value) for key, value in rows.items()}


def pair_dataset(train: Mapping[str, np.ndarray], batch: int, val: Mapping[str, np.ndarray] | None = None,
                 seed: int = 0) -> Dataset:
    """A `Dataset` over `read_pairs` rows: each epoch a fresh shuffle (from `seed` and the epoch), cut
    into batches of `batch` pairs (the last partial batch of an epoch dropped); `val` in order, whole
    batches. A plain iterator: a resumed run replays it to the same next batch."""
    count = len(train["chosen"])
    if count < batch:
        raise ValueError(f"{count} training pairs do not fill one batch of {batch}: use a smaller batch")

    def train_batches(partition):
        epoch = 0
        while True:
            order = np.random.default_rng([seed, epoch]).permutation(count)
            for start in range(0, count - batch + 1, batch):
                rows = order[start:start + batch][partition.index::partition.count]
                yield {key: value[rows] for key, value in train.items()}
            epoch += 1

    def val_batches(partition):
        for start in range(0, len(val["chosen"]) - batch + 1, batch):
            yield {key: value[start:start + batch][partition.index::partition.count] for key, value in val.items()}

    return Dataset(train=train_batches, val=None if val is None else val_batches, records=count, batch=batch)


# -- the objective -------------------------------------------------------------------------------

@struct.dataclass
class PreferenceStatistics:
    """Sums over pairs: the loss, whether the chosen reward beat the rejected one, the reward margin,
    each side's reward (`beta` times its log-likelihood ratio to the reference)."""

    loss: Mean
    reward_accuracy: Mean
    reward_margin: Mean
    chosen_reward: Mean
    rejected_reward: Mean


def dpo_losses(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float,
               label_smoothing: float = 0.0):
    """Per-pair DPO sigmoid losses and the two rewards, from sequence log-likelihoods `[B]`."""
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    z = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
    return losses, chosen_reward, rejected_reward


class DPOObjective(ScoredByLM, MeanLossNoEffects):
    """Train a policy on preference pairs against its frozen starting point (see the module).

    `beta` sets how far the policy may move from the reference (0.1 is common); `label_smoothing`
    (cDPO's eps, in [0, 0.5)) is the assumed rate of flipped labels. `trainable` freezes the rest
    (LoRA's `LoRA.trainable`); `pretrained` is the checkpoint the policy and the reference start from.
    The EMA slot holds the reference, so `ema_decay` is 1.0.
    """

    reads_reference = True
    ema_decay = 1.0

    def __init__(self, model, seq_len: int, *, beta: float = 0.1, label_smoothing: float = 0.0,
                 pretrained: Variables | None = None, trainable: PathFilter | str | None = None, head_chunks: int | None = None):
        check_decoder_objective(model.config, seq_len=seq_len, ema_decay=self.ema_decay, head_chunks=head_chunks,
                                rows="pairs")
        if not beta > 0:
            raise ValueError(f"DPO beta is {beta}; it must be above 0 (0.1 is common)")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing is {label_smoothing}; it is the assumed rate of flipped labels, in "
                             "[0, 0.5)")
        self.model, self.seq_len, self.beta, self.label_smoothing = model, seq_len, float(beta), float(label_smoothing)
        self.trainable = path_filter(trainable)
        # The scoring of next-token log-likelihoods is the language model's, over the same rows.
        self.scorer = LMObjective(model, seq_len, ema_decay=None, pretrained=pretrained, head_chunks=head_chunks,
                                  token_accuracy=False)

    def check_batch(self, batch: Mapping) -> None:
        """Refuse rows that are not pairs of `[B, seq_len + 1]` ids with response masks, a side with no
        response token, and a pair whose prompt tokens differ between its sides."""
        width = self.seq_len + 1
        for side in SIDES:
            for key in (side, f"{side}_response"):
                if key not in batch:
                    raise KeyError(f"the batch has no {key!r} entry (it has {sorted(batch)}); DPOObjective reads "
                                   "chosen, rejected, chosen_response and rejected_response (read_pairs builds them)")
                if np.ndim(batch[key]) != 2 or np.shape(batch[key])[1] != width:
                    raise ValueError(f"{key} has shape {np.shape(batch[key])}; DPOObjective(seq_len={self.seq_len}) "
                                     f"reads [B, {width}]")
            self.scorer.check_batch({"text": batch[side]})
        responses = {side: np.asarray(batch[f"{side}_response"]) > 0 for side in SIDES}
        for side in SIDES:
            empty = np.flatnonzero(~responses[side].any(axis=1))
            if empty.size:
                raise ValueError(f"pair {int(empty[0])} has no {side} response token; every side needs one")
        starts = {side: responses[side].argmax(axis=1) for side in SIDES}
        for row in range(len(starts["chosen"])):
            length = int(starts["chosen"][row])
            chosen, rejected = np.asarray(batch["chosen"][row]), np.asarray(batch["rejected"][row])
            if length != int(starts["rejected"][row]) or not np.array_equal(chosen[:length], rejected[:length]):
                raise ValueError(f"the prompt of pair {row} differs between chosen ({length} prompt tokens) and "
                                 f"rejected ({int(starts['rejected'][row])}): a pair answers one prompt; build the "
                                 "rows with read_pairs")

    def _log_likelihoods(self, params, tokens_BT, response_BT, rngs=None):
        """Each row's log-likelihood of its response tokens `[B]`, float32 (`rngs`: a training pass's
        dropout key, which LoRA's adapter dropout reads)."""
        scores = self.scorer.token_scores(params, tokens_BT, train=rngs is not None, rngs=rngs)
        return -jnp.sum(scores.losses * response_BT[:, 1:].astype(jnp.float32), axis=1)

    def _statistics(self, params, batch, reference, rngs=None) -> PreferenceStatistics:
        tokens = jnp.concatenate([batch["chosen"], batch["rejected"]])
        response = jnp.concatenate([batch["chosen_response"], batch["rejected_response"]])
        policy = jnp.split(self._log_likelihoods(params, tokens, response, rngs), 2)
        ref = jnp.split(jax.lax.stop_gradient(self._log_likelihoods(reference, tokens, response)), 2)
        losses, chosen, rejected = dpo_losses(*policy, *ref, self.beta, self.label_smoothing)
        pairs = jnp.asarray(losses.shape[0], jnp.float32)
        total = lambda x: Mean(jnp.sum(x.astype(jnp.float32)), pairs)
        return PreferenceStatistics(loss=total(losses), reward_accuracy=total(chosen > rejected),
                                    reward_margin=total(chosen - rejected), chosen_reward=total(chosen),
                                    rejected_reward=total(rejected))

    def loss(self, params, batch, step: Step, *, reference) -> tuple[PreferenceStatistics, dict]:
        return self._statistics(params, batch, reference, {"dropout": step.key}), {}

    def evaluate(self, params, batch, step: Step, *, reference) -> PreferenceStatistics:
        """The live policy's statistics against the reference on a validation batch."""
        return self._statistics(params, batch, reference)

    def summarize(self, stats: PreferenceStatistics) -> dict[str, float]:
        """The mean loss, reward accuracy, reward margin and each side's reward over the pairs."""
        return {name: float(value.total) / max(float(value.count), 1.0) for name, value in
                (("loss", stats.loss), ("reward_accuracy", stats.reward_accuracy),
                 ("reward_margin", stats.reward_margin), ("chosen_reward", stats.chosen_reward),
                 ("rejected_reward", stats.rejected_reward))}
