"""Parameter trees split by a path filter, and put back together.

Frozen parameters: `split` cuts the `params` tree into the part that trains and the part that does
not (LoRA's adapters and the base weights, say). The trainer differentiates, updates and averages only the trainable part: frozen leaves get no
gradient, no optimizer state and no EMA copy, and stay in `TrainState.params` (so checkpoints keep
them and a resumed run reads them back). Both parts are plain nested dicts in the tree's own nesting,
each pruned of the modules it has no leaf in, so `join` puts them back into the whole tree exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

PathFilter = Callable[[str], bool]


def split(params: Mapping, keep: PathFilter | None, prefix: str = "params") -> tuple[dict, dict]:
    """(trainable, frozen): the leaves of `params` whose `/`-joined path (`params/layers_0/mlp/...`)
    `keep` accepts, and the others; without `keep` everything trains. A boxed parameter (a
    `flax.linen.LogicallyPartitioned`, not a mapping) is one leaf."""
    trainable, frozen = {}, {}
    for name, value in params.items():
        path = f"{prefix}/{name}"
        if isinstance(value, Mapping):
            inner_trainable, inner_frozen = split(value, keep, path)
            if inner_trainable:
                trainable[name] = inner_trainable
            if inner_frozen:
                frozen[name] = inner_frozen
        elif keep is None or keep(path):
            trainable[name] = value
        else:
            frozen[name] = value
    return trainable, frozen


def join(trainable: Mapping, frozen: Mapping) -> dict:
    """The whole tree of the two parts `split` made (their modules merged, their leaves disjoint)."""
    whole = dict(frozen)
    for name, value in trainable.items():
        whole[name] = join(value, frozen[name]) if name in frozen else value
    return whole


def overlay(variables: Mapping, partial: Mapping) -> Any:
    """`variables` with the leaves `partial` holds (an EMA kept for the trainable part) put over it:
    the full variables an evaluation or a reference reads. A `partial` with the whole tree's
    structure is returned as it is."""
    if _same_keys(variables, partial):
        return partial
    merged = dict(variables)
    for name, value in partial.items():
        merged[name] = overlay(variables[name], value) if isinstance(value, Mapping) else value
    return merged


def _same_keys(whole: Mapping, partial: Mapping) -> bool:
    if set(whole) != set(partial):
        return False
    return all(_same_keys(value, partial[name]) for name, value in whole.items()
               if isinstance(value, Mapping) and isinstance(partial[name], Mapping))
