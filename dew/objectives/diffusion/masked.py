"""`MaskedDiffusionObjective`: MDLM's negative ELBO over rows of exactly `seq_len` token ids.

A row is corrupted at a time drawn for it (antithetic across the batch), a bidirectional decoder
reads the noisy row, and each masked position's cross entropy against the clean token is weighted
by the process's NELBO weight. The loss is that weighted sum per real token: the negative ELBO per
token, whose exp bounds the model's perplexity from above. There is no next-token shift: the
model reads the row it predicts, so a row holds `seq_len` ids, not `seq_len + 1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.inference import MaskedGeneration
from dew.objectives.base import Aux, Mean, MeanLossNoEffects, PathFilter, Step, Variables, path_filter
from dew.objectives.checks import check_decoder_objective, init_or_check
from dew.objectives.lm.objective import POSITIONS_KEY, SEGMENTS_KEY, TEXT_KEY, Samples, prompt_batch
from dew.sampling import Sampling


@struct.dataclass
class MaskedStatistics:
    """Sums over a batch: the loss (NELBO-weighted masked cross entropy over real tokens), the
    masked positions' argmax hits over masked positions, and the masked positions over real ones."""

    loss: Mean
    masked_accuracy: Mean | None
    masked_fraction: Mean

    @property
    def ce(self) -> Mean:
        """The loss under the name `metrics.perplexity()` reads: its exp is the ELBO perplexity bound."""
        return self.loss


class MaskedDiffusionObjective(MeanLossNoEffects):
    """Train a bidirectional decoder as a masked diffusion model (MDLM): `process` corrupts, the
    model predicts the clean tokens, the loss is the negative ELBO per token.

    The batch is `{"text": int32 [B, seq_len]}`, with `text_segment_ids` and `text_positions` for
    packed rows: documents then attend only within themselves, in both directions, and padding
    (segment 0) is never masked nor counted. The model predicts only real tokens, never the mask
    (its logit is left out of the softmax, MDLM's SUBS parameterisation). Reports `loss`,
    `perplexity` (exp of the loss, an upper bound on the model's own), `masked_accuracy` (the argmax
    at masked positions; `token_accuracy=False` skips it) and `masked_fraction`.
    """

    def __init__(self, model, process, seq_len: int, *, ema_decay: float | None = 0.999, head_chunks: int | None = None,
                 samples: Samples | None = None, pretrained: Variables | None = None,
                 trainable: PathFilter | str | None = None, token_accuracy: bool = True):
        config = model.config
        process.check_model(model)
        check_decoder_objective(config, seq_len=seq_len, ema_decay=ema_decay, head_chunks=head_chunks, rows="rows")
        if samples is not None and samples.sampling != Sampling():
            raise ValueError(
                f"samples.sampling is {samples.sampling}: masked-diffusion previews unmask with the process's "
                "sampler, not an autoregressive policy; leave Samples.sampling at Sampling()"
            )
        self.model = model
        self.process = process
        self.seq_len = seq_len
        self.ema_decay = ema_decay
        self.head_chunks = head_chunks
        self.samples = samples
        self.pretrained = pretrained
        self.trainable = path_filter(trainable)
        self.token_accuracy = token_accuracy

    # -- variables -------------------------------------------------------------------------------
    def held_variables(self) -> Variables | None:
        """The checkpoint a continued run starts from (None: fresh weights)."""
        return self.pretrained

    def init(self, key, variables: Variables | None = None) -> Variables:
        """Fresh variables from `key`, or `variables` checked against the model's parameter tree."""
        return init_or_check(self.model, key, self.seq_len, variables)

    def logical_names(self):
        """Each parameter's logical axis names (a tree like `init`'s), for placement on a mesh."""
        return self.model.logical_names()

    # -- host validation -------------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse a host batch the compiled step would mis-score: rows of another width, ids outside
        the vocabulary, or the mask id in the clean text."""
        if TEXT_KEY not in batch:
            raise KeyError(f"the batch has no {TEXT_KEY!r} entry (it has {sorted(batch)}); "
                           "MaskedDiffusionObjective reads token rows there")
        tokens = np.asarray(batch[TEXT_KEY])
        if tokens.ndim != 2 or tokens.shape[1] != self.seq_len:
            windows = (f"load windows with seq_len={self.seq_len - 1}, which hold {self.seq_len} ids each"
                       if self.seq_len > 1 else f"load rows of {self.seq_len} id")
            raise ValueError(
                f"token rows have shape {tokens.shape}; MaskedDiffusionObjective(seq_len={self.seq_len}) reads "
                f"[B, {self.seq_len}], exactly seq_len ids (no next-token shift): {windows}"
            )
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"token ids have dtype {tokens.dtype}; they must be integers")
        vocab, mask_id = self.model.config.vocab_size, self.process.mask_id
        for bad, why in (((tokens < 0) | (tokens >= vocab), f"is outside vocab_size {vocab}: the token files were "
                          "written with another tokenizer, or the model's vocab_size is too small"),
                         (tokens == mask_id, f"is the mask id {mask_id}: the mask needs an id the tokenizer never "
                          "writes (the id after its last)")):
            if bad.any():
                row, column = (int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"token id {int(tokens[row, column])} at row {row}, column {column} {why}")
        for key in (SEGMENTS_KEY, POSITIONS_KEY):
            if key in batch and np.shape(batch[key]) != tokens.shape:
                raise ValueError(f"{key} has shape {np.shape(batch[key])}; it must match the token rows' "
                                 f"{tokens.shape}")

    # -- scoring ---------------------------------------------------------------------------------
    def _statistics(self, params, batch, key) -> MaskedStatistics:
        tokens_BS = batch[TEXT_KEY].astype(jnp.int32)
        segments_BS, positions_BS = batch.get(SEGMENTS_KEY), batch.get(POSITIONS_KEY)
        B, S = tokens_BS.shape
        real_BS = jnp.ones((B, S), bool) if segments_BS is None else segments_BS != 0
        time_key, mask_key = jax.random.split(key)
        t_B = self.process.sample_times(time_key, B)
        noisy_BS, masked_BS = self.process.corrupt(mask_key, tokens_BS, real_BS, t_B)
        kwargs = {name: value for name, value in (("segment_ids", segments_BS), ("positions", positions_BS))
                  if value is not None}
        output = self.model.apply(params, noisy_BS, head=False, **kwargs)
        head, mask_id = output.head, self.process.mask_id
        # The mask is never a clean token: its column leaves the softmax, and the ids above it move down one.
        targets_N = tokens_BS.reshape(-1)
        targets_N = jnp.where(targets_N > mask_id, targets_N - 1, targets_N)
        hidden_BSE = self.process.predicting_states(output.hidden, segments_BS)
        ce_N, _, correct_N = head.without_column(mask_id).cross_entropy(
            hidden_BSE.reshape(B * S, -1), targets_N, self.head_chunks, self.token_accuracy)
        masked = masked_BS.astype(jnp.float32)
        real_count, masked_count = jnp.sum(real_BS.astype(jnp.float32)), jnp.sum(masked)
        weighted_BS = masked * self.process.weight(t_B)[:, None]
        loss = Mean(jnp.sum(ce_N.reshape(B, S) * weighted_BS), real_count)
        accuracy = Mean(jnp.sum(correct_N.reshape(B, S) * masked), masked_count) if self.token_accuracy else None
        return MaskedStatistics(loss=loss, masked_accuracy=accuracy, masked_fraction=Mean(masked_count, real_count))

    def loss(self, params, batch, step: Step) -> tuple[MaskedStatistics, Aux]:
        return self._statistics(params, batch, step.key), {}

    def evaluate(self, params, batch, step: Step) -> MaskedStatistics:
        """Estimate the batch's negative ELBO with the evaluation key's times and masks (the trainer
        passes the EMA weights whenever the state keeps them)."""
        return self._statistics(params, batch, step.key)

    @staticmethod
    def summarize(stats: MaskedStatistics) -> dict[str, float]:
        mean = lambda m: float(m.total) / max(float(m.count), 1.0)
        loss = mean(stats.loss)
        values = {"loss": loss, "perplexity": float(np.exp(min(loss, 700.0))),
                  "masked_fraction": mean(stats.masked_fraction)}
        if stats.masked_accuracy is not None:
            values["masked_accuracy"] = mean(stats.masked_accuracy)
        return values

    # -- generation ------------------------------------------------------------------------------
    def pipeline(self, state, *, ema: bool = True, processor=None):
        """The decoder over the state's weights as a `MaskedGeneration` task: the averaged weights when
        `ema` is set and kept (the live ones otherwise), this objective's process and preview budget,
        and `processor` (a tokenizer) to encode text prompts and decode results."""
        params = state.averaged if ema and state.ema is not None else state.params  # frozen leaves included
        budget = self.samples.max_new_tokens if self.samples and self.samples.max_new_tokens else None
        return MaskedGeneration(self.model, params, self.process, tokenizer=processor, max_new_tokens=budget)

    def preview_variables(self, state):
        """The variables previews draw from: the live ones when the EMA slot holds a frozen reference
        (`ema_decay=1.0`), else the evaluated ones."""
        return state.params if self.ema_decay == 1.0 else state.evaluated

    def preview(self, params, batch=None, step: Step | None = None, *, scored=None) -> list[str] | None:
        """Unmask `samples.max_new_tokens` tokens after the configured prompt; texts on process zero only."""
        if self.samples is None or self.samples.max_new_tokens == 0:
            return None
        key = jax.random.key(0) if step is None else step.key
        prompts = np.asarray(prompt_batch(self.samples.prompt))
        drawn = self.process.generate(self.model, params, [list(row) for row in prompts], self.samples.max_new_tokens,
                                      key=key)
        if jax.process_index() != 0:
            return None
        return [self.samples.decode(list(row)) for row in drawn.host().tokens]
