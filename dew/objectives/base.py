"""What every objective shares with the trainer: `Step` (the trainer's, `dew.training.state`), `Mean`,
`Maximum` (`dew.training.statistics`), and the `Objective` protocol.

The trainer knows nothing of language: it asks the objective for a loss whose statistics are sums
(so micro-batches add up exactly and divide once), compiles it with the optimizer and the EMA, and
asks the objective what evaluation means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import struct

from dew.training.state import Step
from dew.training.statistics import Maximum

Variables = Mapping[str, Any]
"""A Flax variables tree, `{"params": {...}, ...}`."""

T = TypeVar("T")
Aux = dict
"""Effects a loss asks the trainer to apply to non-trained collections (none for a plain LM)."""

PathFilter = Callable[[str], bool]
"""Chooses parameters by their `/`-joined path, e.g. `"params/layers_0/self_attn/q_proj/kernel"`."""


@struct.dataclass
class Mean:
    """A mean kept as `total / count`, so means over different counts combine exactly."""

    total: jax.Array
    count: jax.Array

    def __add__(self, other: "Mean") -> "Mean":
        return Mean(self.total + other.total, self.count + other.count)

    @property
    def value(self) -> jax.Array:
        return self.total / jnp.maximum(self.count, 1)


@struct.dataclass
class Prediction:
    """What a forward pass gives a distillation beside its loss: the whole float32 `logits`
    `[B, seq_len, vocab]`, each target's `weights` `[B, seq_len]` (0 for targets the loss does not
    count), and `layers`, the output states `[B, seq_len, emb]` of the layers asked for, under
    `layers_N`."""

    logits: jax.Array
    weights: jax.Array
    layers: dict = struct.field(default_factory=dict)


class Objective(Protocol):
    """The contract `Trainer` compiles; every objective (language modelling, masked or block diffusion,
    preference and reinforcement objectives) implements it.

    - `init(key, variables)` makes fresh variables, or checks `variables` (`held_variables()`, a
      checkpoint to continue) against the model and returns them in the model's own form.
    - `loss(params, batch, step)` returns `(statistics, effects)`. Statistics are a pytree of sums
      (`Mean`s of named terms) that add across micro-batches (a `Maximum`, such as the largest
      attention logit, keeps the largest instead: `dew.training.statistics`); `reduce_loss(statistics)` gives the
      loss's numerator and denominator, which the trainer divides once after summing a window's
      micro-batches, logs through, and checks for finiteness. Effects are what a loss asks to change
      outside the gradient (a router's balancing bias, say): pytrees that add across micro-batches,
      summed over the accumulation window and handed to `apply_effects(variables, effects)` once,
      after the optimizer's update.
    - `evaluate(params, batch, step)` returns statistics for a validation batch; `summarize(stats)`
      the scalars to log; `check_batch(batch)` refuses a host batch before it is placed.
    - Optional: `preview(params, batch, step)` (texts to show at each evaluation, or None),
      `preview_variables(state)` (the weights previews draw from; default `state.evaluated`),
      `predict(params, batch, step, *, train, layers)` (the loss with the `Prediction` behind it,
      for a distillation to compare a student with a teacher),
      `logical_names()` (each parameter's logical axes, which the trainer maps onto the mesh),
      `on_policy_batch(params, batch, key)` (an on-policy objective, GRPO: the batch a step trains on,
      drawn from the live weights for each batch of the data, its prompts), and the window
      normalisation below.

    Window normalisation (optional; `WindowNormalized`). One numerator over one denominator is exact
    under accumulation only for a loss with a single normalisation. A loss whose terms divide by
    different totals (targets, rows, routed positions), or multiply by window totals (a Switch
    balance loss: slot counts times score sums, each added over the window first), declares them:
    - `window_totals(params, batch, step)`: one micro-batch's share of the totals, a pytree that adds
      across micro-batches, computed without gradient (from the batch alone, or a forward pass);
    - `totals_of(stats)`: the totals a window made of these statistics alone has (so a window of one
      micro-batch needs no separate pass);
    - `window_loss(stats, totals) -> (loss, counted)`: the statistics' share of the loss of a window
      whose totals are `totals`, linear in `stats` so that the micro-batches' shares add up to the
      window's loss, and whether that window carries any loss (it updates only then).
    With these the trainer sums `window_totals` over the window's micro-batches first, then sums the
    gradients of each micro-batch's `window_loss` share, with no division after; so k micro-batches
    equal one batch of k times the rows for every term. `reduce_loss` keeps its meaning: the main
    term's numerator and denominator, which the logs count tokens by.
    """

    ema_decay: float | None
    trainable: PathFilter | None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables: ...

    def held_variables(self) -> Variables | None:
        """The checkpoint a run starts from (None: fresh variables); bound as the initializer's argument."""
        ...

    def loss(self, params: Variables, batch: Mapping[str, jax.Array], step: Step) -> tuple[Any, Aux]: ...

    def reduce_loss(self, stats: Any) -> tuple[jax.Array, jax.Array]:
        """(loss numerator, its denominator): the trainer divides once, after summing micro-batches."""
        ...

    def apply_effects(self, variables: Variables, effects: Aux) -> Variables:
        """`variables` with the window's summed effects applied (after the optimizer's update)."""
        ...

    def evaluate(self, params: Variables, batch: Mapping[str, jax.Array], step: Step) -> Any: ...

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Validate a host batch (shapes, dtypes, id ranges) before it is placed on devices."""
        ...

    def summarize(self, stats: Any) -> dict[str, float]:
        """The scalars to log for summed statistics, e.g. `{"loss", "ce", "perplexity"}`."""
        ...

    def predict(self, params: Variables, batch: Mapping[str, jax.Array], step: Step, *, train: bool,
                layers: Sequence[int] = ()) -> tuple[Any, Aux, Prediction]:
        """(optional) the loss (`LMObjective`'s: its `Mean`) and effects with the `Prediction` behind them:
        the whole logits, the target weights and the output states of `layers`."""
        ...


class WindowNormalized(Objective, Protocol):
    """An objective with the optional window normalisation (see `Objective`)."""

    def window_totals(self, params: Variables, batch: Mapping[str, jax.Array], step: Step) -> Any:
        """One micro-batch's share of the window's totals, additive, without gradient."""
        ...

    def totals_of(self, stats: Any) -> Any:
        """The totals of a window made of these statistics alone."""
        ...

    def window_loss(self, stats: Any, totals: Any) -> tuple[jax.Array, jax.Array]:
        """(the statistics' share of the window's loss given its totals, whether the window counts)."""
        ...


def path_filter(spec: PathFilter | str | None) -> PathFilter | None:
    """A callable filter from a callable, or from a regular expression searched in the path."""
    if spec is None or callable(spec):
        return spec
    import re

    pattern = re.compile(spec)
    return lambda path: pattern.search(path) is not None


class ScoredByLM:
    """The variables side of an objective that scores rows through `self.scorer`, an `LMObjective` over
    `self.model` (DPO, GRPO): the checkpoint it starts from, fresh or checked variables, placement
    names and previews are the language model's."""

    def held_variables(self) -> Variables | None:
        return self.scorer.held_variables()

    def init(self, key, variables: Variables | None = None) -> Variables:
        return self.scorer.init(key, variables)

    def logical_names(self):
        return self.model.logical_names()

    def preview_variables(self, state):
        """The live policy: the EMA slot holds the frozen reference, or nothing."""
        return state.params

    def preview(self, params, batch=None, step: Step | None = None) -> list[str] | None:
        """The scorer's previews of `params` (None when it has no `samples`)."""
        return self.scorer.preview(params, batch, step)


class MeanLossNoEffects:
    """`reduce_loss` and `apply_effects` of an objective whose statistics carry their loss as a `Mean`
    named `loss` and whose step has no effects (no router bias to move): the trainer divides the summed
    totals once, after the micro-batches, and any effect handed back is refused by name."""

    @staticmethod
    def reduce_loss(stats: Any) -> tuple[jax.Array, jax.Array]:
        return stats.loss.total, stats.loss.count

    def apply_effects(self, variables: Variables, effects: Aux) -> Variables:
        if effects:
            raise ValueError(f"{type(self).__name__} produces no effects, got {sorted(effects)}")
        return variables
