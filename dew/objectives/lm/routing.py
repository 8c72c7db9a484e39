"""The router terms of `LMObjective`: the balance losses, the routers' z-loss, load, and the bias step.

Everything is a sum over a step's routed positions (the input tokens that are not padding), per
sparse layer, so micro-batches add up; the terms are formed once the window's totals are known:

- `aux_loss_alpha`, `seq_aux=True` (DeepSeek V2): per row and layer, `sum_e f_e P_e` with
  `f_e = count_e E / (T k)` (the row's `T` routed tokens' selected slots of expert `e`, relative to
  an even share) and `P_e` the row's mean score of `e`; summed over layers, averaged over the rows
  that hold a routed token.
- `aux_loss_alpha`, `seq_aux=False` (Switch): per layer `E <counts, score_sums> / (P^2 k)` over the
  window's `P` routed positions, whose counts and score sums are added over the window first.
- `router_z_loss` (ST-MoE): the mean over routed positions of each router's squared log-sum-exp of
  its logits, summed over layers.
- `balance_rate` (DeepSeek-V3's aux-loss-free balancing): the window's slot counts are the
  objective's effects; each router's bias moves by `rate * sign(mean - count)` once, after the update.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dew.nn.moe import BIAS_NAME, RouterRecord
from dew.nn.stack import layer_range


@struct.dataclass
class RouterStatistics:
    """Sums over routed positions: `positions` (float32), `rows` that hold one, the selected slots per
    layer and expert `counts` `[L, E]`, and for the terms that need them the score sums `[L, E]`
    (Switch loss), each layer's per-row balance losses summed over rows `[L]` (sequence loss), and
    the squared log-normalisers summed `[L]` (z-loss); None where no term reads them."""

    positions: jax.Array
    rows: jax.Array
    counts: jax.Array
    score_sums: jax.Array | None = None
    sequence_balance: jax.Array | None = None
    log_z_squares: jax.Array | None = None


@struct.dataclass
class RouterTotals:
    """What the router terms divide by or multiply with, over a whole accumulation window:
    routed `positions`, `rows`, and the slot `counts` `[L, E]` for the Switch loss (None without it)."""

    positions: jax.Array
    rows: jax.Array
    counts: jax.Array | None = None


def slot_counts(experts_LBSK: jax.Array, routed_BS: jax.Array, experts: int) -> jax.Array:
    """int32 `[L, E]`: how many routed positions' slots chose each expert, per layer."""
    L = experts_LBSK.shape[0]
    weight = jnp.broadcast_to(routed_BS.astype(jnp.int32)[None, :, :, None], experts_LBSK.shape)
    layer = jnp.broadcast_to(jnp.arange(L)[:, None, None, None], experts_LBSK.shape)
    return jnp.zeros((L, experts), jnp.int32).at[layer, experts_LBSK].add(weight)


@dataclasses.dataclass(frozen=True)
class RouterTerms:
    """The router terms one `LMObjective` asks for, over a model's `layers` (its sparse layers)."""

    experts: int
    top_k: int
    layers: tuple[int, ...]
    aux_loss_alpha: float | None = None
    seq_aux: bool = True
    z_loss: float = 0.0

    @property
    def switch(self) -> bool:
        """Whether the Switch loss, whose counts must be known over the window first, is on."""
        return self.aux_loss_alpha is not None and not self.seq_aux

    @property
    def has_loss(self) -> bool:
        return self.aux_loss_alpha is not None or self.z_loss > 0

    def statistics(self, record: RouterRecord, routed_BS: jax.Array) -> RouterStatistics:
        """The sums of one micro-batch from the layer-stacked `record` (`[L, B, S, ...]`)."""
        mask_BS = routed_BS.astype(jnp.float32)
        counts = jax.lax.stop_gradient(slot_counts(record.experts, routed_BS, self.experts)).astype(jnp.float32)
        stats = dict(positions=jnp.sum(mask_BS), rows=jnp.sum(jnp.any(routed_BS, axis=1).astype(jnp.float32)),
                     counts=counts)
        if self.switch:
            stats["score_sums"] = jnp.einsum("lbse,bs->le", record.scores, mask_BS)
        if self.aux_loss_alpha is not None and self.seq_aux:
            tokens_B = jnp.sum(mask_BS, axis=1)
            mean_LBE = jnp.einsum("lbse,bs->lbe", record.scores, mask_BS) / jnp.maximum(tokens_B, 1.0)[None, :, None]
            # sum_e f_e P_e = E / (T k) * (the row's selected slots' mean scores, summed)
            picked_LBSK = jnp.take_along_axis(mean_LBE[:, :, None, :], record.experts, axis=-1)
            picked_LB = jnp.einsum("lbsk,bs->lb", picked_LBSK, mask_BS)
            stats["sequence_balance"] = jnp.sum(picked_LB * self.experts / (jnp.maximum(tokens_B, 1.0) * self.top_k),
                                                axis=1)
        if self.z_loss > 0:
            stats["log_z_squares"] = jnp.einsum("lbs,bs->l", jnp.square(record.log_z), mask_BS)
        return RouterStatistics(**stats)

    def totals(self, stats: RouterStatistics) -> RouterTotals:
        """The totals a window of these statistics alone has."""
        return RouterTotals(stats.positions, stats.rows, stats.counts if self.switch else None)

    def loss(self, stats: RouterStatistics, totals: RouterTotals):
        """The router terms of these statistics' share of a window with `totals` (linear in `stats`),
        and each term by name. Works on traced arrays and on the host's summed numpy ones alike."""
        terms = {}
        if self.aux_loss_alpha is not None:
            if self.seq_aux:
                balance = stats.sequence_balance.sum() / max_one(totals.rows)
            else:
                positions = max_one(totals.positions)
                balance = (self.experts * (totals.counts * stats.score_sums).sum()
                           / (positions * positions * self.top_k))
            terms["balance_loss"] = self.aux_loss_alpha * balance
        if self.z_loss > 0:
            terms["router_z_loss"] = self.z_loss * stats.log_z_squares.sum() / max_one(totals.positions)
        return sum(terms.values()), terms

    def loads(self, stats: RouterStatistics) -> dict[str, float]:
        """Each layer's most and least loaded expert: its slots over an even share, `P k / E`."""
        even = max(float(stats.positions), 1.0) * self.top_k / self.experts
        values = {}
        for layer, counts_E in zip(self.layers, stats.counts):
            values[f"moe/layers_{layer}/max_load"] = float(counts_E.max()) / even
            values[f"moe/layers_{layer}/min_load"] = float(counts_E.min()) / even
        return values


def max_one(value):
    """`max(value, 1)` for a traced scalar or a host number."""
    return jnp.maximum(value, 1.0) if isinstance(value, jax.Array) else max(float(value), 1.0)


def bias_steps(counts_LE: jax.Array, rate: float) -> jax.Array:
    """float32 `[L, E]`: `rate * sign(mean - count)` per layer, the mean compared exactly in integers
    (`E * count` against the layer's total)."""
    counts_LE = counts_LE.astype(jnp.int32)
    total_L1 = jnp.sum(counts_LE, axis=1, keepdims=True)
    return rate * jnp.sign(total_L1 - counts_LE.shape[1] * counts_LE).astype(jnp.float32)


def move_biases(moe: dict, steps_LE: jax.Array) -> dict:
    """The `moe` collection with each sparse layer's balancing bias moved by its row of `steps_LE`
    (the sparse layers in order: `layers_N` holds one, a scanned `layers_AtoB` a stacked run)."""
    moved = {}
    offset = 0
    for name in sorted(moe, key=lambda name: layer_range(name).start):
        gate = moe[name]["mlp"]["gate"]
        bias = gate[BIAS_NAME]
        count = 1 if bias.ndim == 1 else bias.shape[0]
        step = steps_LE[offset:offset + count]
        offset += count
        moved[name] = {**moe[name], "mlp": {**moe[name]["mlp"], "gate": {
            **gate, BIAS_NAME: bias + (step[0] if bias.ndim == 1 else step)}}}
    if offset != steps_LE.shape[0]:
        raise ValueError(f"the variables hold {offset} routers' balancing biases, and the counts cover "
                         f"{steps_LE.shape[0]} sparse layers: the variables are not this model's")
    return moved
