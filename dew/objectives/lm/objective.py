"""`LMObjective`: next-token cross entropy over `[B, seq_len + 1]` rows, teacher-forced scoring, previews."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dew.data.chat import Role
from dew.data.inputs import ModelInputs
from dew.inference import TextGeneration
from dew.nn.head import Head
from dew.nn.mla import IndexerRecord
from dew.nn.moe import RouterRecord, Routes
from dew.objectives.base import Aux, Maximum, Mean, PathFilter, Prediction, Step, Variables, path_filter
from dew.objectives.checks import check_decoder_objective, init_or_check
from dew.objectives.lm.indexer import IndexerTraining, kl_total
from dew.objectives.lm.rows import _real, _Rows, _rows_of
from dew.objectives.lm.scoring import PolicyScoring
from dew.objectives.lm.routing import RouterStatistics, RouterTerms, RouterTotals, bias_steps, max_one, move_biases, \
    slot_counts
from dew.sampling import Sampling, generate

TEXT_KEY = "text"
"""Batch key the token pipeline packs `[B, seq_len + 1]` int32 ids under."""

SEGMENTS_KEY = f"{TEXT_KEY}_segment_ids"
POSITIONS_KEY = f"{TEXT_KEY}_positions"
ROLES_KEY = f"{TEXT_KEY}_roles"
"""Batch key of a chat batch's `Role` per token, int32 `[B, seq_len + 1]` like the token rows."""


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
    the loss's other named `terms` (`z_loss`, ...), each a sum over the same counted targets, for
    a mixture of experts the `router` sums over routed positions (`RouterStatistics`; None without),
    and with `qk_stats` each attention layer's and head's largest pre-softmax logit over the batch,
    `qk_max`, a float32 `Maximum` `[L, H]` over `DecoderConfig.attention_layers` (None without).

    `loss` is the main term, the token-mass part of the loss, as one `Mean` over the counted
    targets: what `reduce_loss` returns. The router terms carry their own normalisation (rows,
    routed positions); `LMObjective.window_loss` adds them.
    """

    ce: Mean
    token_accuracy: Mean | None
    terms: dict = struct.field(default_factory=dict)
    router: RouterStatistics | None = None
    qk_max: Maximum | None = None

    @property
    def loss(self) -> Mean:
        return Mean(self.ce.total + sum(term.total for term in self.terms.values()), self.ce.count)


@struct.dataclass
class LMTotals:
    """What `LMObjective.window_loss` divides by over a whole accumulation window: the counted
    `targets`, and the routers' `RouterTotals` (None without a mixture)."""

    targets: jax.Array
    router: RouterTotals | None = None


@struct.dataclass
class Scores:
    """Per-target results `[B, S]`: the losses, each target's weight, whether the argmax was right
    (None when the objective has `token_accuracy=False`, which takes no argmax), the log-normaliser,
    and with `routing=True` each sparse layer's `RouterRecord` laid out `[B, S, L, ...]` (the
    selected experts and weights `[B, S, L, K]`, scores `[B, S, L, E]`, log-normalisers `[B, S, L]`).
    `states` are the final-norm output states behind the targets `[B, S, E]` (what `head_logits`
    turns into logits); `layers` the output states of the layers `token_scores(layers=...)` named,
    `{"layers_N": [B, S, E]}` (None when none were). With `depths=True`, `depths` holds the
    multi-token-prediction depths' own `Scores`, `[D, B, S]` each: depth d + 1 at index d scores, at
    position p, the token d + 2 ahead (the main target of position p + d + 1), weighted as that main
    target when p to p + d + 1 lie in one document, else 0. With `indexer=True`, `indexer` holds the
    lightning indexers' `IndexerRecord`s, `[L, B, S, ...]` over the indexed layers (in the warm-up,
    whose loss scores no token, `losses`, `correct` and `lse` are None). With `qk_stats=True`,
    `qk_max` holds each attention layer's largest pre-softmax logit per row and head, float32
    `[L, B, H]` over `DecoderConfig.attention_layers` (see `CausalTransformer`)."""

    losses: jax.Array
    weights: jax.Array
    correct: jax.Array
    lse: jax.Array
    routing: RouterRecord | None = None
    states: jax.Array | None = None
    layers: dict | None = None
    depths: "Scores | None" = None
    indexer: IndexerRecord | None = None
    qk_max: jax.Array | None = None


@struct.dataclass
class _Forward:
    """The model's pass over a batch's inputs, as scoring reads it."""

    hidden_NE: jax.Array
    head: Head
    targets_N: jax.Array
    weights_BS: jax.Array
    routing: RouterRecord | None
    routed_BS: jax.Array
    layers: dict
    depths_DBSE: jax.Array | None = None
    indexer: IndexerRecord | None = None
    qk_max_LBH: jax.Array | None = None


_ROUTER_NEUTRAL = {"balance_rate": None, "aux_loss_alpha": None, "router_z_loss": 0.0}

def _training_rngs(step: Step) -> dict:
    """The rngs a training pass runs the model with: the step's key as `dropout`."""
    return {"dropout": step.key}


def _brief(value) -> str:
    """A value as an error names it: arrays by their shape, not their contents."""
    if isinstance(value, tuple) and any(hasattr(item, "shape") for item in value):
        return "(" + ", ".join(_brief(item) for item in value) + ")"
    return f"<array of shape {tuple(np.shape(value))}>" if hasattr(value, "shape") else repr(value)


def _router_terms(config, *, balance_rate, aux_loss_alpha, seq_aux, router_z_loss) -> RouterTerms | None:
    """The router terms asked for, refused by name where the model cannot give them; None for a model
    without a mixture of experts (which then reports no routing)."""
    sparse = getattr(config, "sparse_layers", ())
    given = dict(balance_rate=balance_rate, aux_loss_alpha=aux_loss_alpha, router_z_loss=router_z_loss)
    asked = {name: value for name, value in given.items() if value != _ROUTER_NEUTRAL[name]}
    for name, value in asked.items():
        if not sparse:
            raise ValueError(f"LMObjective({name}={value!r}) acts on the routers of a mixture of experts, and this "
                             "model has none: build it with mixture={...} (experts, top_k, ...), or leave "
                             f"{name} unset")
    for name in ("balance_rate", "aux_loss_alpha"):
        if name in asked and not asked[name] > 0:
            raise ValueError(f"LMObjective({name}={asked[name]!r}): use a value above 0, or leave it unset")
    if router_z_loss < 0:
        raise ValueError(f"LMObjective(router_z_loss={router_z_loss!r}): use a weight >= 0 (0 adds nothing)")
    if balance_rate is not None and not config.mixture.bias:
        raise ValueError(f"LMObjective(balance_rate={balance_rate!r}) moves each router's balancing bias, and this "
                         "model's mixture has bias=False, so its routers have none: build the mixture with "
                         "bias=True, or leave balance_rate unset")
    if not sparse:
        return None
    return RouterTerms(experts=config.mixture.experts, top_k=config.mixture.top_k, layers=sparse,
                       aux_loss_alpha=aux_loss_alpha, seq_aux=seq_aux, z_loss=float(router_z_loss))


class LMObjective(PolicyScoring):
    """Train a next-token model: shifted cross entropy, teacher-forced scoring, optional previews.

    A batch holds `text`, int ids `[B, seq_len + 1]` (or a `ModelInputs` whose `attention_mask`
    marks padding), and optionally `text_segment_ids`, `text_positions` and, for chat rows,
    `text_roles` (`dew.data.ChatData`). With `loss_role` (a `Role`, or its name) only the targets
    of that role count: in the loss, the accuracy and an accumulation window's token mass.

    With `qk_stats` every step reports each attention layer's and head's largest pre-softmax logit
    (`LMStatistics.qk_max`), logged as `qk_max` (the largest of all) and `qk_max/layers_N` (layer N's
    largest over its heads): the growth MuonClip clips, watched at the cost of one more pass over
    the scores (the fused kernel never keeps them).

    The loss scores the vocabulary in `head_chunks` tiles (`Head.cross_entropy`), so a pass holds
    one tile's logits at a time; None (the default) takes the fewest tiles whose float32 logits fit
    64 MiB each, and a single tile keeps its logits for the backward pass rather than making them again.
    The API reference's default is a fixed 4, for the same end, bounded logits memory; a count chosen
    from the batch's rows and the vocabulary meets it at every size, where 4 tiles would hold 2 GiB
    each for 8,192 rows of a 262k vocabulary and would split a small vocabulary's one tile for nothing
    (the quick start's step runs faster with one: docs/performance.md). `head_chunks=4` gives the
    reference's tiling.
    """

    def __init__(
        self,
        model,
        seq_len: int,
        *,
        ema_decay: float | None = 0.999,
        pad_id: int | None = None,
        head_chunks: int | None = None,
        samples: Samples | None = None,
        pretrained: Variables | None = None,
        balance_rate: float | None = None,
        aux_loss_alpha: float | None = None,
        seq_aux: bool = True,
        loss_role: Role | str | None = None,
        mtp_weight: float | None = None,
        z_loss: float = 0.0,
        router_z_loss: float = 0.0,
        qk_stats: bool = False,
        indexer=None,
        trainable: PathFilter | str | None = None,
        token_accuracy: bool = True,
    ):
        if qk_stats and not getattr(model.config, "attention_layers", ()):
            raise ValueError("LMObjective(qk_stats=True) reports the attention logits, and this model has no "
                             "attention layer: leave qk_stats unset")
        self.qk_stats = bool(qk_stats)
        if not seq_aux and aux_loss_alpha is None:
            raise ValueError(
                "LMObjective(seq_aux=False) shapes the expert balance loss, and aux_loss_alpha is unset, so there is "
                "none: leave seq_aux at True"
            )
        config = model.config
        check_decoder_objective(config, seq_len=seq_len, ema_decay=ema_decay, head_chunks=head_chunks, rows="windows")
        if pad_id is not None and not 0 <= pad_id < config.vocab_size:
            raise ValueError(f"pad_id {pad_id} is outside the vocabulary [0, {config.vocab_size})")
        if mtp_weight is not None:
            if not getattr(config, "mtp_depths", 0):
                raise ValueError(f"LMObjective(mtp_weight={mtp_weight!r}) weighs the multi-token-prediction loss, and "
                                 "this model has no multi-token-prediction modules (mtp_depths 0): build it with "
                                 "mtp_depths >= 1 (a DeepSeek-V3 checkpoint with its model.layers.N.* weights), or "
                                 "leave mtp_weight unset")
            if not mtp_weight >= 0:
                raise ValueError(f"LMObjective(mtp_weight={mtp_weight!r}): use a weight >= 0 (DeepSeek-V3 used 0.3, "
                                 "then 0.1)")
        self.mtp_weight = mtp_weight
        if indexer is not None:
            if not isinstance(indexer, IndexerTraining):
                raise TypeError(f"LMObjective(indexer={indexer!r}): give an IndexerTraining(phase, weight)")
            indexer.check(config)
            if indexer.warmup:
                others = dict(mtp_weight=(mtp_weight, None), z_loss=(z_loss, 0.0), balance_rate=(balance_rate, None),
                              aux_loss_alpha=(aux_loss_alpha, None), router_z_loss=(router_z_loss, 0.0),
                              loss_role=(loss_role, None), trainable=(trainable, None))
                asked = [f"{name}={value!r}" for name, (value, neutral) in others.items() if value != neutral]
                if asked:
                    raise ValueError(f"LMObjective(indexer=IndexerTraining('warmup')) trains the indexer alone on its "
                                     f"KL, with every other weight frozen, so {', '.join(asked)} has nothing to act on: "
                                     "leave it unset, or use phase='sparse'")
                trainable = IndexerTraining.trains
        self.indexer = indexer
        self.router = _router_terms(config, balance_rate=balance_rate, aux_loss_alpha=aux_loss_alpha, seq_aux=seq_aux,
                                    router_z_loss=router_z_loss)
        self.balance_rate = balance_rate
        self.loss_role = None if loss_role is None else Role.of(loss_role, "LMObjective(loss_role=...):")
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
        warmup = self.indexer is not None and self.indexer.warmup
        return init_or_check(self.model, key, self.seq_len, variables, fill=self._fresh_indexers if warmup else None)

    def _fresh_indexers(self, key, tokens, variables) -> Variables:
        """`variables` with the indexer weights a checkpoint lacks (a DeepSeek-V3 one) taken from a fresh
        init; any other missing weight is refused by name."""
        fresh = self.model.init(key, tokens, head=False)
        given = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}
        missing = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(fresh)
                   if jax.tree_util.keystr(path) not in given]
        refused = [path for path in missing if "['indexer']" not in path]
        if refused:
            raise ValueError(f"the pretrained variables lack {refused[:4]}: only the indexer's weights may be missing "
                             "(they start fresh in the warm-up); load the checkpoint the model was built for")
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: given.get(jax.tree_util.keystr(path), leaf), fresh)

    # -- host validation -------------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse a host batch the compiled step would silently mis-score."""
        if TEXT_KEY not in batch:
            raise KeyError(f"the batch has no {TEXT_KEY!r} entry (it has {sorted(batch)}); LMObjective reads token rows there")
        text = batch[TEXT_KEY]
        tokens = np.asarray(text.tokens if isinstance(text, ModelInputs) else text)
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
        fields = dict(text.token_fields) if isinstance(text, ModelInputs) else {}
        for key in (SEGMENTS_KEY, POSITIONS_KEY, ROLES_KEY):
            if key in batch:
                fields[key] = batch[key]
        for key, values in fields.items():
            if np.shape(values)[:2] != tokens.shape:
                raise ValueError(f"{key} has shape {np.shape(values)}; it must match the token rows' {tokens.shape}")
        _rows_of(text)  # refuses media and fields given twice
        if ROLES_KEY in batch:
            roles = np.asarray(batch[ROLES_KEY])
            outside = ~np.isin(roles, [int(role) for role in Role])
            if outside.any():
                row, column = (int(i) for i in np.argwhere(outside)[0])
                raise ValueError(f"{ROLES_KEY} holds {int(roles[row, column])} at row {row}, column {column}, which is "
                                 f"no Role ({', '.join(f'{role.name} {int(role)}' for role in Role)})")
        if self.loss_role is not None and ROLES_KEY not in batch:
            raise ValueError(f"LMObjective(loss_role={self.loss_role.name}) keeps the targets of one role, and the batch "
                             f"has no {ROLES_KEY!r} (it has {sorted(batch)}): train on chat rows (dew.data.ChatData, "
                             "data:chat), or leave loss_role unset")

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, params, tokens, train: bool = False, rngs=None, segment_ids=None, positions=None,
                     routing: bool = False, depths: bool = False, roles=None, qk_stats: bool = False,
                     indexer: bool = False, layers: Sequence[int] = (), routes=None) -> Scores:
        """Score per-token next-token cross entropy over a `[B, seq_len + 1]` batch.

        `tokens` are int ids `[B, seq_len + 1]`, or a `ModelInputs` holding them with their token
        fields (an `attention_mask` marks padding, whose targets and predictions weigh nothing).
        With `segment_ids`, the last token of a document does not predict the first of the next one
        and padding (segment 0) predicts nothing; the model reads `positions` for its rotary angles.
        `roles` (a chat batch's `Role` per token, `[B, seq_len + 1]`) keep only the targets whose role
        is the objective's `loss_role`; they are required with a `loss_role` and refused without one.
        `train` changes nothing itself: a training pass gives `rngs={"dropout": key}`, which LoRA's
        adapter dropout reads (Dew's decoder has no dropout of its own).
        `routing` adds each sparse layer's `RouterRecord` (`Scores.routing`). `routes` replays a
        rollout engine's expert choices: `(ids, covered)`, ids `[B, seq_len + 1, layers, top_k]`
        aligned with the tokens over the model's sparse layers, covered `[B, seq_len + 1]` booleans
        (None for all); every router uses the recorded experts where covered and still weights them
        from its own scores (`dew.nn.moe.Routes`). `layers` names layers whose output states to keep
        (`Scores.layers["layers_N"]`, `[B, seq_len, E]`), as a feature distillation reads them.
        `depths` adds the multi-token-prediction depths' `Scores` (`Scores.depths`), `indexer` the
        lightning indexers' scores, selections and KL (`Scores.indexer`); a model without them is
        refused by name. `qk_stats` adds each attention layer's largest pre-softmax logit per row and
        head (`Scores.qk_max`, `[L, B, H]`).
        """
        if qk_stats and not getattr(self.model.config, "attention_layers", ()):
            raise ValueError("token_scores(qk_stats=True) reports the attention logits, and this model has no "
                             "attention layer: leave qk_stats unset")
        latent = getattr(self.model.config, "latent", None)
        if indexer and (latent is None or not latent.index_heads):
            raise ValueError("token_scores(indexer=True) reports the lightning indexer, and this model has none: leave "
                             "indexer unset")
        if depths and not getattr(self.model.config, "mtp_depths", 0):
            raise ValueError("token_scores(depths=True) scores the multi-token-prediction depths, and this model has "
                             "none (mtp_depths 0): leave depths unset")
        if (routing or routes is not None) and self.router is None:
            asked = "routing=True" if routing else f"routes={_brief(routes)}"
            raise ValueError(f"token_scores({asked}) reads the routers of a mixture of experts, and this model has "
                             "none: build it with mixture={...}, or leave it unset")
        if roles is not None and self.loss_role is None:
            raise ValueError(f"token_scores(roles={_brief(roles)}) keeps the targets of the objective's loss_role, and "
                             "this LMObjective has none: build it with loss_role=Role.ASSISTANT (the role to train on), "
                             "or leave roles unset")
        rows = _rows_of(tokens, roles, segment_ids, positions)
        replay = None if routes is None else self._routes(routes, rows.tokens.shape)
        scores, forward = self._score(params, rows, rngs, replay, layers, depths, indexer, qk_stats)
        if not routing:
            return scores
        # [L, B, S, ...] -> [B, S, L, ...], the layout routes are given in
        return scores.replace(routing=jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 0, 2), forward.routing))

    def _score(self, params, rows: _Rows, rngs, routes: Routes | None = None, layers: Sequence[int] = (),
               depths: bool = False, indexer: bool = False, qk_stats: bool = False):
        """(the per-target `Scores` without routing, with the depths' when `depths`, the indexers'
        records when `indexer` and the attention maxima when `qk_stats`; the `_Forward` behind them).
        The indexer's warm-up scores no token."""
        forward = self._forward(params, rows, rngs, routes, layers, depths, indexer, qk_stats)
        B, S = forward.weights_BS.shape
        if self.indexer is not None and self.indexer.warmup:
            scores = Scores(losses=None, weights=forward.weights_BS, correct=None, lse=None)
        else:
            scores = self._cross_entropy(forward.hidden_NE, forward, forward.targets_N, forward.weights_BS)
        scores = scores.replace(states=forward.hidden_NE.reshape(B, S, -1), layers=forward.layers or None)
        if indexer:
            scores = scores.replace(indexer=forward.indexer)
        if depths:
            scores = scores.replace(depths=self._depth_scores(forward, rows))
        if qk_stats:
            scores = scores.replace(qk_max=forward.qk_max_LBH)
        return scores, forward

    def _scored(self, params, rows: _Rows, rngs=None, layers: Sequence[int] = ()):
        """`_score` with what this objective's loss reads: the depths with `mtp_weight`, the indexers with
        `indexer`, the attention maxima with `qk_stats`."""
        return self._score(params, rows, rngs, layers=layers, depths=self.mtp_weight is not None,
                           indexer=self.indexer is not None, qk_stats=self.qk_stats)

    def _head_losses(self, hidden_NE, head: Head, targets_N):
        """Per-target `(ce, lse, correct)` `[N]` through `head` (`correct` None without accuracy): the
        vocabulary in tiles (`Head.cross_entropy`)."""
        return head.cross_entropy(hidden_NE, targets_N, self.head_chunks, self.token_accuracy)

    def _cross_entropy(self, hidden_NE, forward: _Forward, targets_N, weights_BS) -> Scores:
        ce, lse, correct = self._head_losses(hidden_NE, forward.head, targets_N)
        shape = lambda x: None if x is None else x.reshape(weights_BS.shape)
        return Scores(losses=shape(ce), weights=weights_BS, correct=shape(correct), lse=shape(lse))

    def _depth_scores(self, forward: _Forward, rows: _Rows) -> Scores:
        """Each multi-token-prediction depth's `Scores`, stacked `[D, B, S]` (see `Scores`)."""
        B, S = forward.weights_BS.shape
        segments_BS = None if rows.segment_ids is None else rows.segment_ids[:, :-1]
        depth_scores = []
        for index in range(forward.depths_DBSE.shape[0]):
            ahead = index + 1  # depth index + 1 reads the token `ahead` positions on and predicts the one after
            pad = lambda x_BS: jnp.concatenate([x_BS[:, ahead:], jnp.zeros((B, min(ahead, S)), x_BS.dtype)], 1)[:, :S]
            weights_BS = pad(forward.weights_BS)
            if segments_BS is not None:
                weights_BS = weights_BS * (pad(segments_BS) == segments_BS).astype(jnp.float32)
            targets_N = pad(rows.tokens[:, 1:]).reshape(-1).astype(jnp.int32)
            depth_scores.append(self._cross_entropy(forward.depths_DBSE[index].reshape(B * S, -1), forward, targets_N,
                                                    weights_BS))
        return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *depth_scores)

    def _routes(self, routes, shape) -> Routes:
        """`token_scores`' `(ids [B, S + 1, L, K], covered [B, S + 1] | None)` as the model's `Routes`
        over the input tokens, refused when its shape or ids do not fit this model."""
        if not isinstance(routes, (tuple, list)) or len(routes) != 2:
            raise TypeError(f"routes is {_brief(routes)}; give (ids, covered): ids [B, seq_len + 1, layers, top_k], "
                            "covered [B, seq_len + 1] or None")
        ids, covered = routes
        mixture = self.model.config.mixture
        want = (*shape, len(self.router.layers), mixture.top_k)
        if tuple(np.shape(ids)) != want:
            raise ValueError(f"routes ids have shape {tuple(np.shape(ids))}; token_scores reads [B, seq_len + 1, layers, "
                             f"top_k] = {list(want)}: one id per token, sparse layer ({len(self.router.layers)}) and "
                             f"selected expert (top_k {mixture.top_k})")
        if covered is not None and tuple(np.shape(covered)) != tuple(shape):
            raise ValueError(f"routes covered has shape {tuple(np.shape(covered))}; it marks the tokens, "
                             f"[B, seq_len + 1] = {list(shape)}, or is None for all")
        if not isinstance(ids, jax.core.Tracer):
            values = np.asarray(ids)
            bad = (values < 0) | (values >= mixture.experts)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"routes id {int(values[where])} at [row, token, layer, slot] = {list(where)} is not "
                                 f"one of this model's {mixture.experts} experts [0, {mixture.experts})")
        ids = jnp.asarray(ids)
        return Routes(ids[:, :-1], None if covered is None else jnp.asarray(covered)[:, :-1])

    def _masks(self, rows: _Rows):
        """(the weight of each target `[B, S]`, float32; which input tokens are routed, not padding `[B, S]`)."""
        inputs_BS, targets_BS = rows.tokens[:, :-1], rows.tokens[:, 1:]
        weights_BS = jnp.ones(inputs_BS.shape, jnp.float32)
        routed_BS = jnp.ones(inputs_BS.shape, bool)
        if self.pad_id is not None:
            weights_BS *= (targets_BS != self.pad_id).astype(jnp.float32)
            routed_BS &= inputs_BS != self.pad_id
        real_BT = _real(rows)
        if real_BT is not None:  # padding neither predicts nor is predicted
            weights_BS *= (real_BT[:, :-1] & real_BT[:, 1:]).astype(jnp.float32)
            routed_BS &= real_BT[:, :-1]
        if rows.segment_ids is not None:  # no target across a document boundary
            weights_BS *= (rows.segment_ids[:, 1:] == rows.segment_ids[:, :-1]).astype(jnp.float32)
        image_BS = rows.media_targets()
        if image_BS is not None:  # an image's soft tokens are inputs, never targets
            weights_BS *= (~image_BS).astype(jnp.float32)
        if self.loss_role is not None:
            if rows.roles is None:
                raise ValueError(f"LMObjective(loss_role={self.loss_role.name}) keeps the targets of one role, and no "
                                 f"roles were given: pass the chat rows' {ROLES_KEY} (token_scores(roles=...))")
            weights_BS *= (rows.roles[:, 1:] == int(self.loss_role)).astype(jnp.float32)
        return weights_BS, routed_BS

    def _forward(self, params, rows: _Rows, rngs, routes: Routes | None = None, layers: Sequence[int] = (),
                 depths: bool = False, indexer: bool = False, qk_stats: bool = False) -> _Forward:
        """The model over the inputs (without its head): what the loss and the router terms read."""
        inputs_BS, targets_BS = rows.tokens[:, :-1], rows.tokens[:, 1:]
        B, S = inputs_BS.shape
        weights_BS, routed_BS = self._masks(rows)
        fields = dict(segment_ids=rows.segment_ids, positions=rows.positions, attention_mask=rows.attention_mask)
        kwargs = {name: values[:, :-1] for name, values in fields.items() if values is not None}
        kwargs.update(rows.media_inputs())
        if routes is not None:
            kwargs["routes"] = routes
        if depths:
            kwargs["depths"] = True
        if indexer:
            kwargs["indexer"] = True
        if qk_stats:
            kwargs["qk_stats"] = True
        layers = tuple(int(i) for i in layers)
        output = self.model.apply(params, inputs_BS, head=False, rngs=rngs, layers=layers, **kwargs)
        return _Forward(hidden_NE=output.hidden.reshape(B * S, -1), head=output.head,
                        targets_N=targets_BS.reshape(-1).astype(jnp.int32), weights_BS=weights_BS,
                        routing=output.aux.get("routing"), routed_BS=routed_BS,
                        layers={f"layers_{i}": output.aux[f"layers_{i}"] for i in layers},
                        depths_DBSE=output.aux.get("depths"), indexer=output.aux.get("indexer"),
                        qk_max_LBH=output.aux.get("qk_max"))

    def _statistics(self, scores: Scores, forward: _Forward) -> LMStatistics:
        # the largest over the batch's rows: what a step, a log window and a pass keep the largest of
        qk_max = None if forward.qk_max_LBH is None else Maximum(jnp.max(forward.qk_max_LBH, axis=1))
        if self.indexer is not None and self.indexer.warmup:
            # the KL alone, per counted query (every real input token: the warm-up scores no target)
            queries = jnp.sum(forward.routed_BS.astype(jnp.float32))
            kl = Mean(self.indexer.weight * kl_total(forward.indexer.kl, forward.routed_BS), queries)
            return LMStatistics(ce=Mean(jnp.zeros((), jnp.float32), queries), token_accuracy=None,
                                terms={"indexer_kl": kl}, qk_max=qk_max)
        w = scores.weights
        count = jnp.sum(w)
        ce = Mean(jnp.sum(scores.losses * w), count)
        terms = {}
        if self.z_loss:
            terms["z_loss"] = Mean(self.z_loss * jnp.sum(jnp.square(scores.lse) * w), count)
        if self.mtp_weight is not None:
            # DeepSeek-V3's eq. 24: the weight times the mean over depths of each depth's summed cross
            # entropy, over the mass of the main targets (which the accumulation window adds up).
            depth_ce_D = jnp.sum(scores.depths.losses * scores.depths.weights, axis=(1, 2))
            terms["mtp"] = Mean(self.mtp_weight * jnp.mean(depth_ce_D), count)
        if self.indexer is not None:
            # the KL over the selected keys, summed over counted queries, sharing the cross entropy's mass
            terms["indexer_kl"] = Mean(self.indexer.weight * kl_total(forward.indexer.kl, forward.routed_BS), count)
        accuracy = Mean(jnp.sum(scores.correct * w), count) if self.token_accuracy else None
        router = None if self.router is None else self.router.statistics(forward.routing, forward.routed_BS)
        return LMStatistics(ce=ce, token_accuracy=accuracy, terms=terms, router=router, qk_max=qk_max)

    def _batch_rows(self, batch) -> _Rows:
        """A batch's token rows and fields: `text` (ids, or a `ModelInputs`), `text_segment_ids`,
        `text_positions`, `text_roles`."""
        return _rows_of(batch[TEXT_KEY], batch.get(ROLES_KEY), batch.get(SEGMENTS_KEY), batch.get(POSITIONS_KEY))

    def _effects(self, stats: LMStatistics) -> Aux:
        return {} if self.balance_rate is None else {"counts": stats.router.counts.astype(jnp.int32)}

    def loss(self, params, batch, step: Step) -> tuple[LMStatistics, Aux]:
        """The statistics of one micro-batch, and with `balance_rate` its routers' slot counts (int32
        `[L, E]`) as the effect `counts`, which `apply_effects` turns into the bias step. The model runs
        with the step's key as its `dropout` rng (LoRA's adapter dropout reads it; evaluation passes none)."""
        stats = self._statistics(*self._scored(params, self._batch_rows(batch), _training_rngs(step)))
        return stats, self._effects(stats)

    def predict(self, params, batch, step: Step, *, train: bool,
                layers: Sequence[int] = ()) -> tuple[Mean, Aux[Variables], Prediction]:
        """Score the loss with the logits, the target weights and the outputs of `layers` behind it,
        for a teacher to compare (`Objective.predict`): `(loss, effects, Prediction)`, the loss the
        main term's `Mean` over the counted targets (what `reduce_loss` divides).

        The logits are the whole `[B, seq_len, vocab]` float32 tensor the chunked loss never holds; a
        distillation's KL reads every column. The router loss terms (`aux_loss_alpha`,
        `router_z_loss`) carry their own normalisation, so they cannot ride a distillation's token
        mass and are refused; `balance_rate` balances without a loss term and is kept. With `train`
        the model runs with the step's key as its `dropout` rng, as the training loss does. The
        whole statistics (cross entropy, accuracy, named terms) are `predict_statistics`'.
        """
        stats, effects, prediction = self.predict_statistics(params, batch, step, train=train, layers=layers)
        return stats.loss, effects, prediction

    def predict_statistics(self, params, batch, step: Step, *, train: bool,
                           layers: Sequence[int] = ()) -> tuple[LMStatistics, Aux[Variables], Prediction]:
        """`predict` with the whole `LMStatistics` in place of the loss's `Mean` (one forward pass): for a
        caller that logs the cross entropy, the accuracy or the named terms beside the prediction."""
        if self.router is not None:
            for name, value in (("aux_loss_alpha", self.router.aux_loss_alpha), ("router_z_loss", self.router.z_loss)):
                if value:
                    raise ValueError(
                        f"LMObjective.predict: {name}={value!r} is a router loss normalised by its own totals (rows, "
                        "routed positions), which a distillation's token mass cannot carry: leave it unset in the "
                        "objective that predicts (balance_rate balances the routers without a loss term)")
        if self.indexer is not None and self.indexer.warmup:
            raise ValueError("LMObjective.predict: the indexer warm-up scores no token, so it has nothing to distil; "
                             "predict with an objective without indexer, or with IndexerTraining('sparse')")
        rngs = _training_rngs(step) if train else None
        scores, forward = self._scored(params, self._batch_rows(batch), rngs, layers=layers)
        stats = self._statistics(scores, forward)
        logits_BSV = forward.head.logits(scores.states)
        return stats, self._effects(stats), Prediction(logits=logits_BSV, weights=scores.weights,
                                                       layers=forward.layers)

    @staticmethod
    def reduce_loss(stats: Mean | LMStatistics) -> tuple[jax.Array, jax.Array]:
        """(main term's numerator, counted targets); a plain `Mean` is its own numerator and count.
        The router terms are not in it: `window_loss` adds them with their own normalisation."""
        loss = stats if isinstance(stats, Mean) else stats.loss
        return loss.total, loss.count

    # -- window normalisation (dew.objectives.base, "Window normalisation") -----------------------
    def window_totals(self, params, batch, step: Step) -> LMTotals:
        """One micro-batch's share of the window's totals, without gradient: its counted targets and
        routed positions and rows read off the batch alone, and for the Switch loss its routers' slot
        counts, which need a forward pass of the model (no head)."""
        rows = self._batch_rows(batch)
        weights_BS, routed_BS = self._masks(rows)
        if self.indexer is not None and self.indexer.warmup:
            weights_BS = routed_BS.astype(jnp.float32)  # the warm-up's mass: its counted queries
        router = None
        if self.router is not None:
            counts = None
            if self.router.switch:  # the loss's own pass: the same dropout draw routes the same tokens
                forward = self._forward(params, rows, _training_rngs(step))
                counts = slot_counts(forward.routing.experts, routed_BS, self.router.experts).astype(jnp.float32)
            router = RouterTotals(positions=jnp.sum(routed_BS.astype(jnp.float32)),
                                  rows=jnp.sum(jnp.any(routed_BS, axis=1).astype(jnp.float32)), counts=counts)
        return jax.lax.stop_gradient(LMTotals(targets=jnp.sum(weights_BS), router=router))

    def totals_of(self, stats: LMStatistics) -> LMTotals:
        """The totals of a window made of these statistics alone."""
        return LMTotals(targets=stats.ce.count, router=None if stats.router is None else self.router.totals(stats.router))

    def window_loss(self, stats: LMStatistics, totals: LMTotals):
        """(these statistics' share of the loss of a window with `totals`, whether that window carries
        any loss): the main term over the window's counted targets plus the router terms, each over
        its own totals; linear in `stats`, so the micro-batches' shares add up to the window's loss."""
        loss = (stats.ce.total + sum(term.total for term in stats.terms.values())) / max_one(totals.targets)
        counted = totals.targets > 0
        if self.router is not None and self.router.has_loss:
            loss = loss + self.router.loss(stats.router, totals.router)[0]
            counted = counted | (totals.router.positions > 0)
        return loss, counted

    def apply_effects(self, variables: Variables, effects: Aux) -> Variables:
        """With `balance_rate`, each router's balancing bias moved by `rate * sign(mean - count)` from
        the window's slot counts (`effects["counts"]`); without, `variables` unchanged."""
        if self.balance_rate is None:
            if effects:
                raise ValueError(f"LMObjective without balance_rate produces no effects, got {sorted(effects)}")
            return variables
        steps_LE = bias_steps(effects["counts"], self.balance_rate)
        return {**variables, "moe": move_biases(variables["moe"], steps_LE)}

    def evaluate(self, params, batch, step: Step) -> LMStatistics:
        """Score the complete batch teacher-forced, using EMA when present (the trainer passes the EMA
        weights whenever the state keeps them, a frozen reference included)."""
        return self._statistics(*self._scored(params, self._batch_rows(batch)))

    def summarize(self, stats: LMStatistics) -> dict[str, float]:
        """The loss (main term plus router terms), cross entropy, perplexity, token accuracy, the named
        terms, and for a mixture each router term and each sparse layer's most and least loaded expert
        (`moe/layers_N/max_load`, `min_load`: slots over an even share); with `qk_stats` the largest
        pre-softmax attention logit, `qk_max`, and each attention layer's, `qk_max/layers_N`."""
        targets = max(float(stats.ce.count), 1.0)
        ce = float(stats.ce.total) / targets
        loss = float(stats.loss.total) / targets
        qk = self._qk_values(stats)
        if self.indexer is not None and self.indexer.warmup:  # no cross entropy: the KL per query alone
            return {"loss": loss, "indexer_kl": float(stats.terms["indexer_kl"].total) / targets, **qk}
        router_terms = {}
        if stats.router is not None and self.router is not None:
            extra, router_terms = self.router.loss(stats.router, self.router.totals(stats.router))
            loss += float(extra)
        values = {"loss": loss, "ce": ce, "perplexity": float(np.exp(min(ce, 700.0)))}
        if stats.token_accuracy is not None:
            values["token_accuracy"] = float(stats.token_accuracy.total) / max(float(stats.token_accuracy.count), 1.0)
        for name, term in stats.terms.items():
            values[name] = float(term.total) / max(float(term.count), 1.0)
        values.update({name: float(value) for name, value in router_terms.items()})
        if stats.router is not None and self.router is not None:
            values.update(self.router.loads(stats.router))
        values.update(qk)
        return values

    def _qk_values(self, stats: LMStatistics) -> dict[str, float]:
        """`qk_max` and `qk_max/layers_N` of statistics that carry the attention maxima (else none)."""
        if stats.qk_max is None:
            return {}
        largest_LH = np.asarray(stats.qk_max.value, np.float64)
        values = {"qk_max": float(largest_LH.max())}
        for layer, largest_H in zip(self.model.config.attention_layers, largest_LH):
            values[f"qk_max/layers_{layer}"] = float(largest_H.max())
        return values

    # -- generation ------------------------------------------------------------------------------
    def pipeline(self, state, *, ema: bool = True, processor=None):
        """Publish the decoder over the state's weights as a generation task.

        It reads the averaged weights when `ema` is set and the objective keeps them (the live ones
        otherwise), samples and is budgeted the way this objective's previews are, and `processor`
        (a tokenizer) encodes text prompts and decodes the results.
        """
        # averaged, not ema: with frozen parameters (LoRA) the EMA holds only the trainable part.
        params = state.averaged if ema and state.ema is not None else state.params
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
        # Python ints, so the default decode (`str`) prints "[1, 2]", not "[np.int32(1), np.int32(2)]"
        return [self.samples.decode([int(i) for i in row]) for row in generation.host().tokens]
