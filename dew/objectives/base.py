"""What every objective shares with the trainer: `Step`, `Mean`, and the `Objective` protocol.

The trainer knows nothing of language: it asks the objective for a loss whose statistics are sums
(so micro-batches add up exactly and divide once), compiles it with the optimizer and the EMA, and
asks the objective what evaluation means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
from flax import struct

Variables = Mapping[str, Any]
"""A Flax variables tree, `{"params": {...}, ...}`."""

T = TypeVar("T")
Aux = dict
"""Effects a loss asks the trainer to apply to non-trained collections (none for a plain LM)."""

PathFilter = Callable[[str], bool]
"""Chooses parameters by their `/`-joined path, e.g. `"params/layers_0/self_attn/q_proj/kernel"`."""


@struct.dataclass
class Step:
    """The position a loss or evaluation runs at: the batch index and that step's random key."""

    index: jax.Array
    key: jax.Array


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


class Objective(Protocol):
    """The contract `Trainer` compiles. Statistics are pytrees of sums that add across micro-batches.

    An objective may also offer `preview(params, batch, step)` (texts to show at each evaluation, or
    None) and `preview_variables(state)` (the weights previews draw from; default `state.evaluated`).
    """

    ema_decay: float | None
    trainable: PathFilter | None

    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables: ...

    def loss(self, params: Variables, batch: Mapping[str, jax.Array], step: Step) -> tuple[Any, Aux]: ...

    def reduce_loss(self, stats: Any) -> tuple[jax.Array, jax.Array]:
        """(loss numerator, its denominator): the trainer divides once, after summing micro-batches."""
        ...

    def evaluate(self, params: Variables, batch: Mapping[str, jax.Array], step: Step) -> Any: ...

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Validate a host batch (shapes, dtypes, id ranges) before it is placed on devices."""
        ...

    def summarize(self, stats: Any) -> dict[str, float]:
        """The scalars to log for summed statistics, e.g. `{"loss", "ce", "perplexity"}`."""
        ...


def path_filter(spec: PathFilter | str | None) -> PathFilter | None:
    """A callable filter from a callable, or from a regular expression searched in the path."""
    if spec is None or callable(spec):
        return spec
    import re

    pattern = re.compile(spec)
    return lambda path: pattern.search(path) is not None
