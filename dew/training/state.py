"""`TrainState`: the weights, their moving average, the optimizer state, the counters and the key; `Step`,
the position a loss or evaluation runs at."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from dew.trees import overlay


@struct.dataclass
class Step:
    """The position a loss or evaluation runs at: the batch index and that step's random key."""

    index: jax.Array
    key: jax.Array


@struct.dataclass
class TrainState:
    """Everything a checkpoint holds besides the data position.

    `step` counts batches consumed and `updates` optimizer updates applied (a step whose loss has no
    counted target, or is not finite, applies none). `key` is the run's base key as raw key data; step
    `t` draws from `fold_in(key, t)`. `ema` is None when the objective keeps no moving average, and
    holds only the trainable parameters when some are frozen (`dew.trees`): `averaged` and
    `evaluated` put it over the frozen ones.
    """

    params: Any
    ema: Any
    opt_state: Any
    step: jax.Array
    updates: jax.Array
    key: jax.Array

    @property
    def averaged(self):
        """The moving-average variables (with the frozen parameters, which do not move); refused when the
        objective keeps none (`ema_decay=None`)."""
        if self.ema is None:
            raise AttributeError("this state keeps no EMA (the objective has ema_decay=None): use state.params")
        return overlay(self.params, self.ema)

    @property
    def evaluated(self):
        """The variables evaluation and previews read: the EMA when kept, else the live ones."""
        return self.params if self.ema is None else self.averaged
