"""`SampledRollout`: completions drawn from one snapshot of a policy (`LMObjective.policy`), laid out as
a batch an on-policy objective trains on.

A rollout's batch holds right-padded `[R, seq_len + 1]` rows, `R = prompts * group_size`, grouped by
prompt (row `i * group_size + j` is completion `j` of prompt `i`): `text` (prompt, then completion,
then the sampler's `pad_id`), `completion` (1 on each sampled token), `sampled_log_probs` (each sampled
token's log-likelihood as the sampler drew it: tempered, filtered) and `policy_log_probs` (the raw
policy's, the full softmax of the capped logits), float32, 0 elsewhere. A sampler that filters (top-k,
top-p, min-p) also records each sampled token's kept ids as `support_ids` and `support_columns`, int32
`[R, C]`: entry `c` of row `r` keeps id `support_ids[r, c]` for the token in column
`support_columns[r, c]` of `text` (-1: unused; `C` is padded to a power of two, so rollouts reuse
compiled steps), which `LMObjective.sampled_log_probs` renormalises over.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.base import Variables
from dew.sampling import Sampling
from dew.sampling.sampling import SamplingParams, filter_logits


@dataclasses.dataclass(frozen=True, eq=False)
class SampledRollout:
    """Draw `group_size` completions of each prompt, up to `max_new_tokens` each, from
    `objective.policy(params, sampling)` and lay them out as a batch (see the module).

    `objective` is an `LMObjective` (its `seq_len` sets the batch's width, `seq_len + 1`). Calling the
    rollout with `(params, prompts, key)` draws exactly what the policy task draws with that key and
    `n=group_size`.
    """

    objective: object
    sampling: Sampling = Sampling()
    group_size: int = 1
    max_new_tokens: int = 32

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size is {self.group_size!r}; draw at least 1 completion per prompt")
        width = self.objective.seq_len + 1
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= self.objective.seq_len:
            raise ValueError(f"max_new_tokens is {self.max_new_tokens!r}; it must lie in [1, seq_len "
                             f"{width - 1}] (the rows are seq_len + 1 = {width} tokens wide)")

    @property
    def filtered(self) -> bool:
        """Whether the sampler keeps only some ids (top-k, top-p, min-p), so the batch records supports."""
        return any(value is not None for value in (self.sampling.top_k, self.sampling.top_p, self.sampling.min_p))

    def __call__(self, params: Variables, prompts: Sequence[Sequence[int]], key) -> dict[str, np.ndarray]:
        """The batch of one rollout of `prompts` (lists of token ids) from `params` with `key`."""
        width = self.objective.seq_len + 1
        prompts = [list(prompt) for prompt in prompts]
        longest = max((len(prompt) for prompt in prompts), default=0)
        if longest + self.max_new_tokens > width:
            raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens {self.max_new_tokens} is beyond "
                             f"seq_len + 1 = {width}: raise seq_len, or shorten the prompts")
        drawn = self.objective.policy(params, self.sampling)(prompts, self.max_new_tokens, key=key, n=self.group_size)
        rows = len(drawn.tokens)
        batch = {"text": np.full((rows, width), self.sampling.pad_id, np.int32),
                 "completion": np.zeros((rows, width), np.int32),
                 "sampled_log_probs": np.zeros((rows, width), np.float32),
                 "policy_log_probs": np.zeros((rows, width), np.float32)}
        for row, completion in enumerate(drawn.continuations()):
            prompt = prompts[row // self.group_size]
            start, end = len(prompt), len(prompt) + len(completion)
            batch["text"][row, :end] = prompt + completion
            batch["completion"][row, start:end] = 1
            batch["sampled_log_probs"][row, start:end] = drawn.log_probs[row, :len(completion)]
            batch["policy_log_probs"][row, start:end] = drawn.policy_log_probs[row, :len(completion)]
        if self.filtered:
            batch["support_ids"], batch["support_columns"] = self._supports(params, batch)
        return batch

    def _supports(self, params, batch) -> tuple[np.ndarray, np.ndarray]:
        """The ids the sampler kept for each sampled token, as the ragged `(support_ids,
        support_columns)` pair (see the module), read from the snapshot's logits: `[R, S, vocab]`
        booleans at once, the memory a rollout's supports cost."""
        kept_RSV = np.asarray(self._kept(params, jnp.asarray(batch["text"])))
        sampled_RS = batch["completion"][:, 1:] > 0
        targets_RS = batch["text"][:, 1:]
        rows = []
        for row in range(len(kept_RSV)):
            ids, columns = [], []
            for slot in np.flatnonzero(sampled_RS[row]):
                kept = kept_RSV[row, slot].copy()
                kept[targets_RS[row, slot]] = True  # the drawn token was kept, whatever a tie decided here
                found = np.flatnonzero(kept)
                ids.append(found)
                columns.append(np.full(len(found), slot + 1))
            empty = np.zeros(0, np.int64)
            rows.append((np.concatenate(ids or [empty]), np.concatenate(columns or [empty])))
        width = 1 << max(0, int(np.ceil(np.log2(max(1, *(len(ids) for ids, _ in rows))))))
        support_ids = np.zeros((len(rows), width), np.int32)
        support_columns = np.full((len(rows), width), -1, np.int32)
        for row, (ids, columns) in enumerate(rows):
            support_ids[row, :len(ids)], support_columns[row, :len(ids)] = ids, columns
        return support_ids, support_columns

    @functools.cached_property
    def _kept(self):
        """`(params, tokens [R, S + 1]) -> [R, S, vocab]` bool: the ids the sampler keeps after each slot,
        its filter over the capped logits (compiled once per rollout)."""
        def kept(params, tokens):
            scores = self.objective.token_scores(params, tokens)
            logits_RSV = self.objective.head_logits(params, scores.states)
            R, S, V = logits_RSV.shape
            filtered = filter_logits(SamplingParams.of([self.sampling] * (R * S)), logits_RSV.reshape(R * S, V))
            return (filtered > -jnp.inf).reshape(R, S, V)

        return jax.jit(kept)
