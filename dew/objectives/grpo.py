"""`GRPOObjective`: group relative policy optimisation (DeepSeekMath, Shao et al., 2024) with rewards
from a Python callable.

A rollout (`rollout`) draws `group_size` completions of each prompt from one snapshot of the policy,
scores each with `reward(prompt_ids, completion_ids) -> float`, and normalises the rewards within each
group: `A = (r - mean) / (std + 1e-4)` (the sample standard deviation), every token of a completion
carrying its completion's advantage. The update's loss per completion token is PPO's clipped
surrogate against the likelihood the sampler recorded when it drew the token, `-min(rho A,
clip(rho, 1 - clip, 1 + clip) A)` with `rho = exp(log pi(token) - log pi_sampler(token))`, plus with
`kl_weight` the k3 estimate of the KL to the frozen reference, `exp(d) - d - 1` with `d = log ref -
log pi`; the reference is the EMA slot at decay 1.0 (`reads_reference`). The loss is the mean over
every completion token of the batch (token-level, as DAPO normalises), so micro-batches add up exactly.

Rollouts come from `LMObjective.policy` at the objective's `sampling` (any temperature above 0, with
or without top-k, top-p and min-p filters), and the ratio is taken between likelihoods of the same
distribution: the sampler recorded each token's under the snapshot's tempered logits renormalised
over the ids its filters kept, and the update scores the live policy's the same way
(`LMObjective.sampled_log_probs` with the temperature and each token's kept ids, its support). The
support is read at the rollout from the snapshot's logits through the sampler's own filter
(`dew.sampling.filter_logits`); it holds the drawn token always, since the sampler kept it. The KL
term compares the policy and the reference under that same distribution, so at the first step it is
an exact zero. A repetition penalty depends on the row's history and is refused.

A rollout's batch is `SampledRollout`'s (`text`, `completion`, `sampled_log_probs`, `policy_log_probs`,
and with filters `support_ids` and `support_columns`), to which `rollout` adds `advantages` and
`rewards` (float32 `[R]`; the rewards are logged as `reward`, the mean over completions).
`examples/grpo_arithmetic.py` alternates rollouts and updates by hand; `Trainer.fit` does it through
`on_policy_batch`, one rollout of each batch of prompts per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.objectives.base import Mean, MeanLossNoEffects, PathFilter, ScoredByLM, Step, Variables, path_filter
from dew.objectives.checks import check_decoder_objective
from dew.objectives.lm import LMObjective, SampledRollout, Samples
from dew.objectives.lm.scoring import check_support
from dew.sampling import Sampling

ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Rewards `[P * G]` (grouped by prompt, as `generate(n=G)` orders rows) as advantages: each minus
    its group's mean, over the group's sample standard deviation plus `ADVANTAGE_EPS`."""
    grouped = np.asarray(rewards, np.float64).reshape(-1, group_size)
    spread = grouped.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(grouped[:, :1])
    return ((grouped - grouped.mean(axis=1, keepdims=True)) / (spread + ADVANTAGE_EPS)).reshape(-1).astype(np.float32)


def clipped_token_losses(new_log_probs, sampled_log_probs, advantages, clip: float, reference_log_probs=None,
                         kl_weight: float = 0.0):
    """Per-token GRPO losses `[R, S]` and their ratios and KL terms, from log-likelihoods `[R, S]` and
    advantages `[R]` (see the module); positions that are not sampled tokens are the caller's to mask."""
    ratio = jnp.exp(new_log_probs - sampled_log_probs)
    advantage = advantages[:, None]
    surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1.0 - clip, 1.0 + clip) * advantage)
    kl = jnp.zeros_like(ratio)
    if reference_log_probs is not None:
        gap = reference_log_probs - new_log_probs
        kl = jnp.exp(gap) - gap - 1.0
    return -surrogate + kl_weight * kl, ratio, kl


@struct.dataclass
class GRPOStatistics:
    """Sums over completion tokens: the loss, the ratio, whether the ratio was clipped, the KL estimate;
    and over completions their rewards (None for a batch that carries none)."""

    loss: Mean
    ratio: Mean
    clipped: Mean
    kl: Mean
    reward: Mean | None = None


class GRPOObjective(ScoredByLM, MeanLossNoEffects):
    """Train a policy on its own rollouts' rewards (see the module).

    `reward(prompt_ids, completion_ids)` scores one completion (its ids up to and including EOS); a
    rollout given `records` (one per prompt) calls `reward(prompt_ids, completion_ids, record)`.
    `group_size` completions are drawn per prompt, each up to `max_new_tokens` with `sampling` (a
    temperature above 0, any filters, no repetition penalty; see the module). `clip` is PPO's
    epsilon. `kl_weight` above zero keeps the starting weights as a frozen reference in the EMA slot
    (`ema_decay` 1.0) and adds the KL to it; 0 keeps no copy. `trainable` freezes the rest (LoRA's
    `LoRA.trainable`), `pretrained` is the checkpoint the policy starts from; `samples`
    (`dew.objectives.lm.Samples`) are previews drawn from the live policy at each evaluation.
    """

    def __init__(self, model, seq_len: int, reward: Callable[[list[int], list[int]], float], *, group_size: int = 8,
                 max_new_tokens: int = 32, clip: float = 0.2, kl_weight: float = 0.0,
                 sampling: Sampling = Sampling(), pretrained: Variables | None = None,
                 trainable: PathFilter | str | None = None, head_chunks: int | None = None,
                 samples: Samples | None = None):
        self.ema_decay = 1.0 if kl_weight > 0 else None
        self.reads_reference = kl_weight > 0
        check_decoder_objective(model.config, seq_len=seq_len, ema_decay=self.ema_decay, head_chunks=head_chunks,
                                rows="rollouts")
        if group_size < 2:
            raise ValueError(f"group_size is {group_size}; GRPO normalises rewards within a group of at least 2 "
                             "completions per prompt (8 or 16 are common)")
        if not 0 < clip < 1:
            raise ValueError(f"clip is {clip}; PPO's epsilon lies in (0, 1) (0.2 is common)")
        if kl_weight < 0:
            raise ValueError(f"kl_weight is {kl_weight}; use 0 for no KL term or a weight above 0 (0.04 is common)")
        if sampling.repetition_penalty is not None:
            raise NotImplementedError(
                f"GRPOObjective samples with repetition_penalty={sampling.repetition_penalty!r}: the penalty "
                "depends on each row's history, and the update scores the sampler's likelihood from the "
                "temperature and the kept ids alone; leave repetition_penalty unset")
        if sampling.greedy:
            raise ValueError("GRPOObjective samples at temperature 0: every completion of a prompt would be the "
                             "same greedy one, so every advantage would be 0; sample at a temperature above 0")
        if not callable(reward):
            raise TypeError(f"reward is {reward!r}; give a function (prompt_ids, completion_ids) -> float")
        self.model, self.seq_len, self.reward = model, seq_len, reward
        self.group_size, self.max_new_tokens, self.sampling = group_size, max_new_tokens, sampling
        self.clip, self.kl_weight = float(clip), float(kl_weight)
        self.trainable = path_filter(trainable)
        self.scorer = LMObjective(model, seq_len, ema_decay=None, pretrained=pretrained, head_chunks=head_chunks,
                                  token_accuracy=False, samples=samples)
        self.sampler = SampledRollout(self.scorer, sampling, group_size, max_new_tokens)

    # -- rollouts (host) -------------------------------------------------------------------------
    def rollout(self, params: Variables, prompts: Sequence[Sequence[int]], key,
                records: Sequence | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Draw `group_size` completions of each prompt from `params` (one snapshot of the policy, through
        `sampler`, a `SampledRollout`), score them (with each prompt's entry of `records`, when given),
        and add their rewards and advantages to the rollout's batch; returns `(batch, rewards [R])`,
        rows grouped by prompt."""
        if records is not None and len(records) != len(prompts):
            raise ValueError(f"{len(records)} records for {len(prompts)} prompts: give one record per prompt")
        batch = self.sampler(params, prompts, key)
        rewards = np.zeros(len(batch["text"]), np.float32)
        for row, (text, completion) in enumerate(zip(batch["text"], batch["completion"])):
            prompt = list(prompts[row // self.group_size])
            context = () if records is None else (records[row // self.group_size],)
            rewards[row] = float(self.reward(prompt, text[completion > 0].tolist(), *context))
        batch["advantages"] = group_advantages(rewards, self.group_size)
        batch["rewards"] = rewards
        return batch, rewards

    def on_policy_batch(self, params: Variables, prompts: Mapping[str, np.ndarray], key) -> dict[str, np.ndarray]:
        """The batch a step trains on, drawn from `params` (the live policy) for a batch of prompts
        (`Trainer.fit` calls it each step): `prompt`, int32 `[P, W]` right-padded ids, `prompt_length`
        int32 `[P]`, and optionally `record`, `[P]` objects each handed to the reward (see `rollout`)."""
        for name in ("prompt", "prompt_length"):
            if name not in prompts:
                raise KeyError(f"the prompt batch has no {name!r} entry (it has {sorted(prompts)}); "
                               "GRPOObjective.on_policy_batch reads prompt and prompt_length (dew.data.prompts)")
        ids = [row[:length].tolist() for row, length in zip(np.asarray(prompts["prompt"]),
                                                            np.asarray(prompts["prompt_length"]))]
        records = prompts.get("record")
        return self.rollout(params, ids, key, None if records is None else list(records))[0]

    @property
    def filtered(self) -> bool:
        """Whether the sampler keeps only some ids (top-k, top-p, min-p), so a rollout records supports."""
        return self.sampler.filtered

    def check_batch(self, batch: Mapping) -> None:
        """Refuse a batch that is not a rollout's layout (see the module)."""
        for key in ("text", "completion", "sampled_log_probs", "advantages"):
            if key not in batch:
                raise KeyError(f"the batch has no {key!r} entry (it has {sorted(batch)}); GRPOObjective reads a "
                               "rollout's batch (GRPOObjective.rollout builds it)")
        self.scorer.check_batch({"text": batch["text"]})
        for key in ("completion", "sampled_log_probs"):
            if np.shape(batch[key]) != np.shape(batch["text"]):
                raise ValueError(f"{key} has shape {np.shape(batch[key])}; it must match text's {np.shape(batch['text'])}")
        if self.filtered:
            for key in ("support_ids", "support_columns"):
                if key not in batch:
                    raise KeyError(f"the batch has no {key!r} entry (it has {sorted(batch)}); a GRPOObjective whose "
                                   "sampler filters reads each token's kept ids (GRPOObjective.rollout records them)")
            check_support((batch["support_ids"], batch["support_columns"]), batch["text"], self.model.config.vocab_size)
        for key in ("advantages", "rewards"):
            if key in batch and np.shape(batch[key]) != (np.shape(batch["text"])[0],):
                raise ValueError(f"{key} have shape {np.shape(batch[key])}; one per row, [{np.shape(batch['text'])[0]}]")

    # -- the update ------------------------------------------------------------------------------
    def log_probs(self, params, tokens, support=None, rngs=None) -> jax.Array:
        """Each next token's log-likelihood `[R, seq_len]`, float32, as the sampler draws it: the
        policy's logits over the sampling temperature, renormalised over `support` (a rollout's
        `(support_ids, support_columns)`) where it keeps ids."""
        scores = self.scorer.token_scores(params, tokens, train=rngs is not None, rngs=rngs)
        return self.scorer.sampled_log_probs(params, scores, tokens, support, self.sampling.temperature)

    def _statistics(self, params, batch, reference, rngs=None) -> GRPOStatistics:
        tokens = batch["text"]
        mask = batch["completion"][:, 1:].astype(jnp.float32)  # targets that are sampled tokens
        support = (batch["support_ids"], batch["support_columns"]) if self.filtered else None
        new = self.log_probs(params, tokens, support, rngs)
        ref = None if reference is None else jax.lax.stop_gradient(self.log_probs(reference, tokens, support))
        losses, ratio, kl = clipped_token_losses(new, batch["sampled_log_probs"][:, 1:], batch["advantages"],
                                                 self.clip, ref, self.kl_weight)
        count = jnp.sum(mask)
        total = lambda x: Mean(jnp.sum(x * mask), count)
        clipped = (jnp.abs(ratio - 1.0) > self.clip).astype(jnp.float32)
        reward = None
        if "rewards" in batch:
            rewards = batch["rewards"].astype(jnp.float32)
            reward = Mean(jnp.sum(rewards), jnp.asarray(rewards.shape[0], jnp.float32))
        return GRPOStatistics(loss=total(losses), ratio=total(ratio), clipped=total(clipped), kl=total(kl),
                              reward=reward)

    def loss(self, params, batch, step: Step, *, reference=None) -> tuple[GRPOStatistics, dict]:
        return self._statistics(params, batch, reference, {"dropout": step.key}), {}

    def evaluate(self, params, batch, step: Step, *, reference=None) -> GRPOStatistics:
        return self._statistics(params, batch, reference)

    def summarize(self, stats: GRPOStatistics) -> dict[str, float]:
        """The mean loss, ratio, clipped fraction and KL estimate over the completion tokens, and the
        mean reward over the completions."""
        values = {name: float(value.total) / max(float(value.count), 1.0) for name, value in
                  (("loss", stats.loss), ("ratio", stats.ratio), ("clipped", stats.clipped), ("kl", stats.kl),
                   ("reward", stats.reward)) if value is not None}
        if not self.reads_reference:
            del values["kl"]
        return values
