"""`DPOObjective`: direct preference optimisation over chosen and rejected responses to one prompt.

The loss of a pair is DPO's sigmoid loss (Rafailov et al., 2023), with the conservative label
smoothing of cDPO: with `z = beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) -
log ref(rejected)))`, each sequence's log-likelihood summed over its response tokens,
`loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`. The reference is the frozen copy the
trainer keeps in the EMA slot at `ema_decay` 1.0: the starting weights, never moved (with LoRA, the
starting adapters over the frozen base), which the trainer hands to the loss as `reference`.

Pairs come from JSONL (`dew.data.preference_pairs`: `read_pairs`, `pair_dataset`, and the data
source `PreferencePairs`): one `{"prompt", "chosen", "rejected"}` record a line, as TRL's DPOTrainer
reads them. A batch holds `[B, seq_len + 1]` rows under `chosen` and `rejected`, right-padded, and
under `chosen_response` / `rejected_response` 1 on each response token (0 on the prompt and the
padding).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.data.preference_pairs import SIDES, pair_dataset, read_pairs  # noqa: F401  (this module's names too)
from dew.objectives.base import Mean, MeanLossNoEffects, PathFilter, ScoredByLM, Step, Variables, path_filter
from dew.objectives.checks import check_decoder_objective
from dew.objectives.lm import LMObjective, Samples


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
    The EMA slot holds the reference, so `ema_decay` is 1.0. `samples` (`dew.objectives.lm.Samples`)
    are previews drawn from the live policy at each evaluation.
    """

    reads_reference = True
    ema_decay = 1.0

    def __init__(self, model, seq_len: int, *, beta: float = 0.1, label_smoothing: float = 0.0,
                 pretrained: Variables | None = None, trainable: PathFilter | str | None = None, head_chunks: int | None = None,
                 samples: Samples | None = None):
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
                                  token_accuracy=False, samples=samples)

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
