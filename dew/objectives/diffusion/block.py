"""`BlockDiffusionObjective`: fine-tune a DiffusionGemma with the block loss of Google's public SFT adapter.

A row holds `prompt_length` clean prompt ids, then `num_canvases` response canvases of `canvas_size` ids;
`pad_token_id` marks response positions with no target (a shorter response). Two losses, each a mean
over a row's targets, then over the batch's rows:

- `encoder_ce`: the causal encoder's next-token cross entropy over the clean row (targets that are not
  padding);
- `canvas_ce`: the whole response is corrupted with uniform-vocabulary noise, each position replaced
  with probability `t`, one time per row drawn uniformly from `[safety_epsilon, 1 - safety_epsilon]`;
  one canvas holding a target is chosen per row, and the denoiser reads its noisy tokens after the
  clean prefix before it (the encoder's keys and values, as at generation) and predicts the clean
  ones. With probability `self_cond_prob` per row it is conditioned on its own first pass's logits,
  which carry no gradient. Its cross entropy counts the canvas's non-padding positions.

The loss is `encoder_loss_weight * encoder_ce + decoder_loss_weight * canvas_ce` per row, summed over
rows and divided by the rows (a row without targets adds zero to a term). This is the public SFT
recipe, not the unpublished sampler-distillation and RL objective the released model was trained with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.nn.diffusion_gemma import DiffusionGemma, PrefixCache, scalars_as
from dew.objectives.base import Aux, Mean, MeanLossNoEffects, PathFilter, Step, Variables, path_filter
from dew.objectives.lm.objective import POSITIONS_KEY, SEGMENTS_KEY, TEXT_KEY

F32 = jnp.float32


@struct.dataclass
class BlockStatistics:
    """Sums over a batch, each over its rows: the weighted loss, and its two terms' per-row means."""

    loss: Mean
    canvas_ce: Mean
    encoder_ce: Mean


def _row_mean_ce(logits_BSV, targets_BS, counted_BS):
    """Each row's mean float32 cross entropy over its counted positions (0 for a row with none), and
    whether the row has any."""
    log_z = jax.nn.logsumexp(logits_BSV, axis=-1)
    picked = jnp.take_along_axis(logits_BSV, targets_BS[..., None], axis=-1)[..., 0]
    counted = counted_BS.astype(F32)
    count_B = jnp.sum(counted, axis=-1)
    return jnp.sum((log_z - picked) * counted, axis=-1) / jnp.maximum(count_B, 1.0), count_B > 0


class BlockDiffusionObjective(MeanLossNoEffects):
    """Train a `DiffusionGemma` with the block loss (see the module) on rows of `prompt_length +
    num_canvases * canvas_size` ids (`canvas_size` defaults to the model's canvas length).

    `.model` is the model with its per-layer scalars trainable (`params`), while a loaded checkpoint's
    own model keeps them frozen (`constants`); pass `pretrained=bundle.variables` to start from the
    checkpoint, and export with `dataclasses.replace(bundle, model=objective.model).save(directory,
    variables=state.params)`. Reports `loss`, `canvas_ce` and `encoder_ce`.
    """

    def __init__(self, model: DiffusionGemma, prompt_length: int, num_canvases: int = 1,
                 canvas_size: int | None = None, *, pad_token_id: int = 0, self_cond_prob: float = 0.5,
                 safety_epsilon: float = 1e-4, encoder_loss_weight: float = 1.0, decoder_loss_weight: float = 1.0,
                 ema_decay: float | None = None, pretrained: Variables | None = None,
                 trainable: PathFilter | str | None = None):
        if not isinstance(model, DiffusionGemma):
            raise TypeError(f"BlockDiffusionObjective trains a DiffusionGemma (load_pretrained of a diffusion_gemma "
                            f"checkpoint gives one), not a {type(model).__name__}")
        config = model.config
        canvas_size = config.canvas_length if canvas_size is None else canvas_size
        for name, value in (("prompt_length", prompt_length), ("num_canvases", num_canvases),
                            ("canvas_size", canvas_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} is {value!r}; it must be a whole number of at least 1")
        row = prompt_length + num_canvases * canvas_size
        if row > config.max_seq_len:
            raise ValueError(f"a row of prompt_length {prompt_length} plus {num_canvases} canvases of {canvas_size} "
                             f"is {row} positions, past the model's max_seq_len {config.max_seq_len}: use fewer or "
                             "smaller canvases, or load with a larger max_seq_len")
        if not 0.0 <= self_cond_prob <= 1.0:
            raise ValueError(f"self_cond_prob is {self_cond_prob}; it is a probability in [0, 1]")
        if not 0.0 <= safety_epsilon < 0.5:
            raise ValueError(f"safety_epsilon is {safety_epsilon}; times are drawn from [eps, 1 - eps], so it must "
                             "be in [0, 0.5)")
        if ema_decay is not None and not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"ema_decay is {ema_decay}; use a value in [0, 1], or None for no EMA")
        if not 0 <= pad_token_id < config.vocab_size:
            raise ValueError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {config.vocab_size})")
        self.model = DiffusionGemma(dataclasses.replace(config, trainable_scalars=True))
        self.prompt_length, self.num_canvases, self.canvas_size = prompt_length, num_canvases, canvas_size
        self.row_length = row
        self.seq_len = row  # the ids a row holds, which the trainer counts tokens by
        self.pad_token_id, self.self_cond_prob, self.safety_epsilon = pad_token_id, self_cond_prob, safety_epsilon
        self.encoder_loss_weight, self.decoder_loss_weight = encoder_loss_weight, decoder_loss_weight
        self.ema_decay = ema_decay
        self.pretrained = None if pretrained is None else scalars_as(
            {name: tree for name, tree in pretrained.items() if name in ("params", "constants")}, trainable=True)
        self.trainable = path_filter(trainable)

    # -- variables -------------------------------------------------------------------------------
    def held_variables(self) -> Variables | None:
        return self.pretrained

    def init(self, key, variables: Variables | None = None) -> Variables:
        """Fresh variables from `key`, or `variables` checked against the model's tree."""
        tokens = jnp.zeros((1, self.prompt_length), jnp.int32)
        canvas = jnp.zeros((1, self.model.config.canvas_length), jnp.int32)
        from flax.core import meta

        make = lambda: meta.unbox(self.model.init(key, tokens, canvas))
        if variables is None:
            return make()
        expected = jax.eval_shape(make)
        have = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), variables)
        if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(have):
            raise ValueError("the pretrained variables do not have this DiffusionGemma's tree: pass the loaded "
                             "bundle's variables")
        for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(have)):
            if want.shape != got.shape:
                raise ValueError(f"pretrained {jax.tree_util.keystr(path)} has shape {got.shape}; the model expects "
                                 f"{want.shape}")
        return dict(variables)

    # -- host validation -------------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse rows of another width, ids outside the vocabulary and packed documents."""
        if TEXT_KEY not in batch:
            raise KeyError(f"the batch has no {TEXT_KEY!r} entry (it has {sorted(batch)}); BlockDiffusionObjective "
                           "reads token rows there")
        if SEGMENTS_KEY in batch or POSITIONS_KEY in batch:
            raise ValueError("the batch holds packed documents (text_segment_ids / text_positions): block diffusion "
                             "reads each row as one prompt and its response canvases, and packed rows' context "
                             "boundaries differ; load unpacked token windows")
        tokens = np.asarray(batch[TEXT_KEY])
        if tokens.ndim != 2 or tokens.shape[1] != self.row_length:
            raise ValueError(f"token rows have shape {tokens.shape}; this objective reads [B, {self.row_length}]: "
                             f"prompt_length {self.prompt_length} plus {self.num_canvases} canvases of "
                             f"{self.canvas_size} (token windows of seq_len {self.row_length - 1})")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"token ids have dtype {tokens.dtype}; they must be integers")
        vocab = self.model.config.vocab_size
        bad = (tokens < 0) | (tokens >= vocab)
        if bad.any():
            row, column = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"token id {int(tokens[row, column])} at row {row}, column {column} is outside vocab_size "
                             f"{vocab}: the token files were written with another tokenizer")

    # -- scoring ---------------------------------------------------------------------------------
    def _statistics(self, variables, batch, key) -> BlockStatistics:
        model, P, K, C = self.model, self.prompt_length, self.num_canvases, self.canvas_size
        V = model.config.vocab_size
        tokens_BL = batch[TEXT_KEY].astype(jnp.int32)
        B, L = tokens_BL.shape
        cache = PrefixCache.empty(model.config, B, L)
        hidden_BLE, cache = model.apply(variables, tokens_BL, jnp.ones((B, L), bool), cache, 0, method=model.encode)
        encoder_logits = model.apply(variables, hidden_BLE[:, :-1], method=model.logits)
        targets_BL = tokens_BL[:, 1:]
        encoder_ce_B, encoder_has_B = _row_mean_ce(encoder_logits, targets_BL, targets_BL != self.pad_token_id)

        time_key, noise_key, replace_key, canvas_key, condition_key = jax.random.split(key, 5)
        eps = self.safety_epsilon
        t_B = jax.random.uniform(time_key, (B,), F32, eps, 1.0 - eps)
        response_BR = tokens_BL[:, P:]
        replaced_BR = jax.random.uniform(replace_key, response_BR.shape) < t_B[:, None]
        noisy_BR = jnp.where(replaced_BR, jax.random.randint(noise_key, response_BR.shape, 0, V, jnp.int32),
                             response_BR)
        support_BK = jnp.any((response_BR != self.pad_token_id).reshape(B, K, C), axis=-1)
        # a canvas holding a target, uniformly (canvas 0 for a row with none: it adds nothing)
        scores_BK = jnp.where(support_BK, jax.random.uniform(canvas_key, (B, K)), -1.0)
        chosen_B = jnp.argmax(scores_BK, axis=-1)
        start_B = chosen_B * C
        window = lambda rows_BR: jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, C))(
            rows_BR, start_B)
        canvas_BC, clean_BC = window(noisy_BR), window(response_BR)
        prefix = P + start_B
        visible = dataclasses.replace(cache, valid_BT=jnp.arange(L)[None, :] < prefix[:, None], length_B=prefix)
        first = jax.lax.stop_gradient(model.apply(variables, canvas_BC, visible, method=model.denoise))
        conditioned_B = jax.random.uniform(condition_key, (B,)) < self.self_cond_prob
        logits_BCV = model.apply(variables, canvas_BC, visible, first, conditioned_B, method=model.denoise)
        canvas_ce_B, canvas_has_B = _row_mean_ce(logits_BCV, clean_BC, clean_BC != self.pad_token_id)

        rows = jnp.asarray(B, F32)
        encoder_ce = jnp.sum(jnp.where(encoder_has_B, encoder_ce_B, 0.0))
        canvas_ce = jnp.sum(jnp.where(canvas_has_B, canvas_ce_B, 0.0))
        loss = self.encoder_loss_weight * encoder_ce + self.decoder_loss_weight * canvas_ce
        return BlockStatistics(loss=Mean(loss, rows), canvas_ce=Mean(canvas_ce, rows), encoder_ce=Mean(encoder_ce, rows))

    def loss(self, params, batch, step: Step) -> tuple[BlockStatistics, Aux]:
        return self._statistics(params, batch, step.key), {}

    def evaluate(self, params, batch, step: Step) -> BlockStatistics:
        return self._statistics(params, batch, step.key)

    @staticmethod
    def summarize(stats: BlockStatistics) -> dict[str, float]:
        mean = lambda m: float(m.total) / max(float(m.count), 1.0)
        return {"loss": mean(stats.loss), "canvas_ce": mean(stats.canvas_ce), "encoder_ce": mean(stats.encoder_ce)}


__all__ = ["BlockDiffusionObjective", "BlockStatistics"]
