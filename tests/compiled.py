"""A call such as a model's forward, initialisation or gradient run as one compiled program.

Run outside `jit`, each of a forward's few hundred ops compiles a program of its own, about 20 ms apiece
on a CPU (docs/performance.md, "Where the suite's time goes"); the whole forward as one program compiles in
a fraction of that. A test that compares what a call returns runs it through `compiled`.
"""

from __future__ import annotations

import jax
import numpy as np

from dew.lazy import kept


class _Traced:
    """Marks where an array argument goes among the fixed ones."""

    def __repr__(self) -> str:
        return "<array>"


_TRACED = _Traced()


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def compiled(function, *args, **kwargs):
    """`function(*args, **kwargs)` as one jitted program. The arrays among the arguments (at any depth of
    their pytrees: caches, dicts of pixel values) are its inputs; everything else (flags, `method=`, step
    numbers, None) is fixed into the program. Calls with equal functions and fixed arguments share one
    program (a bound method of a Flax module is hashable: modules compare by their fields); a call with
    something unhashable among them gets a program of its own."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    fixed = tuple(_TRACED if _is_array(leaf) else leaf for leaf in leaves)
    return _program(function, tree, fixed)([leaf for leaf in leaves if _is_array(leaf)])


@kept(maxsize=64)  # a test's programs, not the whole suite's
def _program(function, tree, fixed):
    def run(arrays):
        given = iter(arrays)
        args, kwargs = jax.tree_util.tree_unflatten(tree, [next(given) if leaf is _TRACED else leaf
                                                            for leaf in fixed])
        return function(*args, **kwargs)

    return jax.jit(run)

