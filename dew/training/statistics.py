"""How statistics combine across micro-batches, steps and a validation pass: every leaf adds, except a
`Maximum`'s, which keeps the larger value (the largest attention logit of a window is the largest of
its micro-batches', not their sum)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Maximum:
    """A statistic whose micro-batches, steps and batches combine by keeping the largest `value`."""

    value: jax.Array


def _is_maximum(node) -> bool:
    return isinstance(node, Maximum)


def add_statistics(total: Any, more: Any) -> Any:
    """`total + more` leaf by leaf, a `Maximum` by its larger value (inside a compiled step)."""
    return jax.tree_util.tree_map(
        lambda a, b: Maximum(jnp.maximum(a.value, b.value)) if _is_maximum(a) else a + b, total, more,
        is_leaf=_is_maximum)


def empty_statistics(shapes: Any) -> Any:
    """What `add_statistics` starts a window from, for statistics of these shapes (`jax.eval_shape`'s):
    zeros, and -inf for a `Maximum`."""
    return jax.tree_util.tree_map(
        lambda x: Maximum(jnp.full(x.value.shape, -jnp.inf, x.value.dtype)) if _is_maximum(x)
        else jnp.zeros(x.shape, x.dtype), shapes, is_leaf=_is_maximum)


def host_sum(trees: list) -> Any:
    """Statistics pytrees combined on the host in float64 (`add_statistics`' rule)."""
    as_host = lambda tree: jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)
    total = as_host(trees[0])
    for tree in trees[1:]:
        total = jax.tree_util.tree_map(
            lambda a, b: Maximum(np.maximum(a.value, b.value)) if _is_maximum(a) else a + b, total, as_host(tree),
            is_leaf=_is_maximum)
    return total
