"""`LMObjective`: next-token cross entropy over `[B, seq_len + 1]` rows, teacher-forced scoring, previews."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.objectives.base import Aux, Mean, PathFilter, Step, Variables, path_filter
from dew.objectives.lm.loss import chunked_cross_entropy
from dew.sampling import Sampling, generate

TEXT_KEY = "text"
"""Batch key the token pipeline packs `[B, seq_len + 1]` int32 ids under."""

SEGMENTS_KEY = f"{TEXT_KEY}_segment_ids"
POSITIONS_KEY = f"{TEXT_KEY}_positions"


@dataclasses.dataclass(frozen=True)
class Samples:
    """Configure the text preview drawn once per event.

    Prompts contain token IDs, with equal lengths for multiple prompts. This display count does not
    limit the teacher-forced scoring population.
    """

    prompt: Sequence[int] | Sequence[Sequence[int]]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    decode: Callable[[list[int]], str] = lambda ids: str(ids)


def prompt_batch(prompt) -> jax.Array:
    """Build `[B, P]` int32 ids from one prompt, or several of the same length."""
    rows = [list(prompt)] if len(prompt) == 0 or np.isscalar(prompt[0]) else [list(row) for row in prompt]
    lengths = sorted({len(row) for row in rows})
    if len(lengths) != 1:
        raise ValueError(f"prompts have lengths {lengths}; prompt_batch needs prompts of one length")
    if lengths[0] == 0:
        raise ValueError("the prompt is empty; give at least one token id")
    return jnp.asarray(np.asarray(rows, dtype=np.int32))


@struct.dataclass
class LMStatistics:
    """Sums over counted targets: the cross entropy, the argmax hits (None without `token_accuracy`),
    and the loss's other named `terms` (`z_loss`, ...), each a sum over the same counted targets.

    `loss` is the whole loss as one `Mean` over the counted targets, what `reduce_loss` returns, so
    micro-batches add up and the trainer divides once.
    """

    ce: Mean
    token_accuracy: Mean | None
    terms: dict = struct.field(default_factory=dict)

    @property
    def loss(self) -> Mean:
        return Mean(self.ce.total + sum(term.total for term in self.terms.values()), self.ce.count)


@struct.dataclass
class Scores:
    """Per-target results `[B, S]`: the losses, each target's weight, whether the argmax was right
    (None when the objective has `token_accuracy=False`, which takes no argmax), and the log-normaliser."""

    losses: jax.Array
    weights: jax.Array
    correct: jax.Array
    lse: jax.Array


_LATER = {
    "balance_rate": "mixture-of-experts routing",
    "aux_loss_alpha": "mixture-of-experts routing",
    "router_z_loss": "mixture-of-experts routing",
    "loss_role": "chat role masks",
    "mtp_weight": "multi-token prediction",
    "indexer": "DeepSeek-V3.2's lightning indexer",
    "qk_stats": "attention logit statistics",
}
_NEUTRAL = {"balance_rate": None, "aux_loss_alpha": None, "router_z_loss": 0.0, "loss_role": None,
            "mtp_weight": None, "indexer": None, "qk_stats": False}

# What `token_scores` can be asked to report beside the losses, the capability each needs, and the
# value that asks for nothing.
_SCORED_LATER = {
    "routing": ("mixture-of-experts routing", False),
    "depths": ("multi-token prediction", False),
    "roles": ("chat role masks", None),
    "qk_stats": ("attention logit statistics", False),
    "indexer": ("DeepSeek-V3.2's lightning indexer", False),
    "layers": ("keeping layers' output states for feature distillation", ()),
    "routes": ("mixture-of-experts routing (replayed expert choices)", None),
}


def _refuse_unbuilt_scoring(requested: dict[str, Any]) -> None:
    for name, value in requested.items():
        capability, neutral = _SCORED_LATER[name]
        if name == "layers":
            value = tuple(value)
        # roles and routes are arrays when given: only None asks for nothing.
        asked = value is not None if neutral is None else value != neutral
        if asked:
            raise NotImplementedError(
                f"token_scores({name}={_brief(value)}): {capability} is not built in Dew yet; leave {name} unset"
            )


def _brief(value) -> str:
    """A value as an error names it: arrays by their shape, not their contents."""
    if isinstance(value, tuple) and any(hasattr(item, "shape") for item in value):
        return "(" + ", ".join(_brief(item) for item in value) + ")"
    return f"<array of shape {tuple(np.shape(value))}>" if hasattr(value, "shape") else repr(value)


class LMObjective:
    """Train a next-token model: shifted cross entropy, teacher-forced scoring, optional previews."""

    def __init__(
        self,
        model,
        seq_len: int,
        *,
        ema_decay: float | None = 0.999,
        pad_id: int | None = None,
        head_chunks: int = 4,
        samples: Samples | None = None,
        pretrained: Variables | None = None,
        balance_rate: float | None = None,
        aux_loss_alpha: float | None = None,
        seq_aux: bool = True,
        loss_role=None,
        mtp_weight: float | None = None,
        z_loss: float = 0.0,
        router_z_loss: float = 0.0,
        qk_stats: bool = False,
        indexer=None,
        trainable: PathFilter | str | None = None,
        token_accuracy: bool = True,
    ):
        given = dict(balance_rate=balance_rate, aux_loss_alpha=aux_loss_alpha, loss_role=loss_role,
                     mtp_weight=mtp_weight, router_z_loss=router_z_loss, qk_stats=qk_stats, indexer=indexer)
        for name, value in given.items():
            if value != _NEUTRAL[name]:
                raise NotImplementedError(
                    f"LMObjective({name}={value!r}): {_LATER[name]} is not built in Dew yet; leave {name} unset"
                )
        if not seq_aux and aux_loss_alpha is None:
            raise ValueError(
                "LMObjective(seq_aux=False) shapes the expert balance loss, and aux_loss_alpha is unset, so there is "
                "none: leave seq_aux at True"
            )
        config = model.config
        if config.attention_dropout > 0:
            raise NotImplementedError(
                f"the model's attention_dropout is {config.attention_dropout}: Dew does not apply attention dropout, "
                "so training would not be the training that rate asks for; build the model with attention_dropout "
                "0.0 to train without it (generation reads the rate nowhere and needs no change)"
            )
        if seq_len < 1:
            raise ValueError(f"seq_len is {seq_len}; it must be at least 1")
        if seq_len > config.max_seq_len:
            raise ValueError(
                f"seq_len {seq_len} is longer than the model's max_seq_len {config.max_seq_len}: "
                f"build the model with max_seq_len >= {seq_len} or use shorter windows"
            )
        if ema_decay is not None and not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"ema_decay is {ema_decay}; use a value in [0, 1], or None for no EMA")
        if head_chunks < 1:
            raise ValueError(f"head_chunks is {head_chunks}; it must be at least 1")
        if pad_id is not None and not 0 <= pad_id < config.vocab_size:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary [0, {config.vocab_size})")
        self.model = model
        self.seq_len = seq_len
        self.ema_decay = ema_decay
        self.pad_id = pad_id
        self.head_chunks = head_chunks
        self.samples = samples
        self.pretrained = pretrained
        self.seq_aux = seq_aux
        self.z_loss = float(z_loss)
        self.trainable = path_filter(trainable)
        self.token_accuracy = token_accuracy

    # -- variables -------------------------------------------------------------------------------
    def held_variables(self) -> Variables | None:
        """Return the checkpoint a continued-pretraining run starts from."""
        return self.pretrained

    def logical_names(self):
        """Each parameter's logical axis names (a tree like `init`'s), for placement on a mesh."""
        return self.model.logical_names()

    def init(self, key, variables: Variables | None = None) -> Variables:
        """Fresh variables from `key`, or `variables` (the pretrained ones) checked against the model."""
        tokens = jnp.zeros((1, self.seq_len), jnp.int32)
        if variables is None:
            return self.model.init(key, tokens, head=False)
        expected = jax.eval_shape(lambda: self.model.init(key, tokens, head=False))
        variables = self.model.stack_variables(variables)  # a checkpoint's per-layer tree, in the model's form
        got = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), variables)
        if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(got):
            raise ValueError("the pretrained variables do not have this model's parameter tree")
        for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(got)):
            if want.shape != have.shape:
                raise ValueError(
                    f"pretrained {jax.tree_util.keystr(path)} has shape {have.shape}; the model expects {want.shape}"
                )
        return variables

    # -- host validation -------------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse a host batch the compiled step would silently mis-score."""
        if TEXT_KEY not in batch:
            raise KeyError(f"the batch has no {TEXT_KEY!r} entry (it has {sorted(batch)}); LMObjective reads token rows there")
        tokens = np.asarray(batch[TEXT_KEY])
        width = self.seq_len + 1
        if tokens.ndim != 2 or tokens.shape[1] != width:
            raise ValueError(
                f"token rows have shape {tokens.shape}; LMObjective(seq_len={self.seq_len}) reads [B, {width}] "
                f"(seq_len inputs plus the last target): load windows with seq_len={self.seq_len}"
            )
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"token ids have dtype {tokens.dtype}; they must be integers")
        vocab = self.model.config.vocab_size
        bad = (tokens < 0) | (tokens >= vocab)
        if bad.any():
            row, column = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"token id {int(tokens[row, column])} at row {row}, column {column} is outside vocab_size {vocab}: "
                "the token files were written with another tokenizer, or the model's vocab_size is too small"
            )
        for key in (SEGMENTS_KEY, POSITIONS_KEY):
            if key in batch and np.shape(batch[key]) != tokens.shape:
                raise ValueError(f"{key} has shape {np.shape(batch[key])}; it must match the token rows' {tokens.shape}")

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, params, tokens, train: bool = False, rngs=None, segment_ids=None, positions=None,
                     routing: bool = False, depths: bool = False, roles=None, qk_stats: bool = False,
                     indexer: bool = False, layers: Sequence[int] = (), routes=None) -> Scores:
        """Score per-token next-token cross entropy over a `[B, seq_len + 1]` batch.

        With `segment_ids`, the last token of a document does not predict the first of the next one
        and padding (segment 0) predicts nothing; the model reads `positions` for its rotary angles.
        `train` changes nothing today: Dew's decoder has no training-only layer (no dropout).
        `routing`, `depths`, `roles`, `qk_stats`, `indexer`, `layers` and `routes` ask for what
        mixtures of experts, multi-token prediction, chat masks, attention statistics, the lightning
        indexer and feature distillation report; none is built yet, so each is refused by name when
        set, and accepted at its neutral value (False, None or no layers).
        """
        _refuse_unbuilt_scoring(dict(routing=routing, depths=depths, roles=roles, qk_stats=qk_stats, indexer=indexer,
                                     layers=layers, routes=routes))
        hidden_NE, weight, targets_N, weights_BS, transposed = self._head_inputs(params, tokens, rngs, segment_ids,
                                                                                 positions)
        ce, lse, correct = chunked_cross_entropy(hidden_NE, weight, targets_N, transposed, self.head_chunks,
                                                 self.model.config.logit_softcap, self.token_accuracy)
        shape = lambda x: None if x is None else x.reshape(weights_BS.shape)
        return Scores(losses=shape(ce), weights=weights_BS, correct=shape(correct), lse=shape(lse))

    def _head_inputs(self, params, tokens, rngs, segment_ids, positions):
        """(final hidden states `[N, E]`, head weight in the compute dtype, targets `[N]`, target weights
        `[B, S]`, whether the head is the transposed embedding)."""
        inputs_BS, targets_BS = tokens[:, :-1], tokens[:, 1:]
        B, S = inputs_BS.shape
        weights_BS = jnp.ones((B, S), jnp.float32)
        if self.pad_id is not None:
            weights_BS *= (targets_BS != self.pad_id).astype(jnp.float32)
        kwargs = {}
        if segment_ids is not None:
            same_document = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
            weights_BS *= same_document.astype(jnp.float32)
            kwargs["segment_ids"] = segment_ids[:, :-1]
        if positions is not None:
            kwargs["positions"] = positions[:, :-1]
        output = self.model.apply(params, inputs_BS, head=False, rngs=rngs, **kwargs)
        return (output.hidden.reshape(B * S, -1), output.head.weight, targets_BS.reshape(-1).astype(jnp.int32),
                weights_BS, output.head.transposed)

    def _statistics(self, params, batch) -> LMStatistics:
        scores = self.token_scores(
            params, batch[TEXT_KEY], segment_ids=batch.get(SEGMENTS_KEY), positions=batch.get(POSITIONS_KEY)
        )
        w = scores.weights
        count = jnp.sum(w)
        ce = Mean(jnp.sum(scores.losses * w), count)
        terms = {}
        if self.z_loss:
            terms["z_loss"] = Mean(self.z_loss * jnp.sum(jnp.square(scores.lse) * w), count)
        accuracy = Mean(jnp.sum(scores.correct * w), count) if self.token_accuracy else None
        return LMStatistics(ce=ce, token_accuracy=accuracy, terms=terms)

    def loss(self, params, batch, step: Step) -> tuple[LMStatistics, Aux]:
        return self._statistics(params, batch), {}

    @staticmethod
    def reduce_loss(stats: Mean | LMStatistics) -> tuple[jax.Array, jax.Array]:
        """(loss numerator, counted targets); a plain `Mean` is its own numerator and count."""
        loss = stats if isinstance(stats, Mean) else stats.loss
        return loss.total, loss.count

    def apply_effects(self, variables: Variables, effects: Aux) -> Variables:
        if effects:
            raise ValueError(f"LMObjective produces no effects, got {sorted(effects)}")
        return variables

    def evaluate(self, params, batch, step: Step) -> LMStatistics:
        """Score the complete batch teacher-forced, using EMA when present (the trainer passes the EMA
        weights whenever the state keeps them, a frozen reference included)."""
        return self._statistics(params, batch)

    @staticmethod
    def summarize(stats: LMStatistics) -> dict[str, float]:
        ce = float(stats.ce.total) / max(float(stats.ce.count), 1.0)
        values = {"loss": float(stats.loss.total) / max(float(stats.loss.count), 1.0), "ce": ce,
                  "perplexity": float(np.exp(min(ce, 700.0)))}
        if stats.token_accuracy is not None:
            values["token_accuracy"] = float(stats.token_accuracy.total) / max(float(stats.token_accuracy.count), 1.0)
        for name, term in stats.terms.items():
            values[name] = float(term.total) / max(float(term.count), 1.0)
        return values

    # -- generation ------------------------------------------------------------------------------
    def policy(self, params: Variables, sampling: Sampling = Sampling()):
        """Expose the model over this training tree as a generation task."""
        from dew.inference import TextGeneration

        return TextGeneration(self.model, params, sampling=sampling)

    def pipeline(self, state, *, ema: bool = True, processor=None):
        """Publish the decoder over the state's weights as a generation task.

        It reads the averaged weights when `ema` is set and the objective keeps them (the live ones
        otherwise), samples and is budgeted the way this objective's previews are, and `processor`
        (a tokenizer) encodes text prompts and decodes the results.
        """
        from dew.inference import TextGeneration

        params = state.ema if ema and state.ema is not None else state.params
        sampling = self.samples.sampling if self.samples else Sampling()
        budget = self.samples.max_new_tokens if self.samples and self.samples.max_new_tokens else None
        return TextGeneration(self.model, params, tokenizer=processor, sampling=sampling, max_new_tokens=budget)

    # -- previews --------------------------------------------------------------------------------
    @property
    def _ema_is_reference(self) -> bool:
        """Whether the EMA slot holds a frozen reference (`ema_decay=1.0`) rather than an average, so
        previews draw from the live policy instead of it."""
        return self.ema_decay == 1.0

    def preview_variables(self, state):
        """The variables `preview` draws from in `state`: the live ones when the EMA slot holds a frozen
        reference (`_ema_is_reference`), else the evaluated ones (the EMA when kept)."""
        return state.params if self._ema_is_reference else state.evaluated

    def preview(self, params, batch=None, step: Step | None = None, *, scored=None) -> list[str] | None:
        """Sample the configured prompt once, then decode only on process zero.

        Every process runs the sampling (the weights may be sharded across them); process zero gets
        the decoded texts, the others None. None too when no `samples` are configured. `batch` and
        `scored` are the event's batch and its scores, which this preview does not read.
        """
        if self.samples is None or self.samples.max_new_tokens == 0:
            return None
        key = jax.random.key(0) if step is None else step.key
        prompts = np.asarray(prompt_batch(self.samples.prompt))
        generation = generate(self.model, params, [list(row) for row in prompts], self.samples.max_new_tokens,
                              key=key, sampling=self.samples.sampling)
        if jax.process_index() != 0:
            return None
        return [self.samples.decode(list(row)) for row in generation.host().tokens]
