"""A train step sharded over a mesh against one device's: what the mesh may change, bounded by rounding.

Splitting the rows over devices splits every sum over rows (the loss's numerator, each weight's gradient) into
per-device partial sums that a collective adds in an order of its own, and a tensor axis splits the products over
heads, MLP width and vocabulary the same way. So no mesh promises one device's bits, and none gives them: eight
CPU devices as data=8, fsdp=8 or data=2 x fsdp=2 x tensor=2 put the first step's gradients 3-6 ulps of a leaf's
largest entry from one device's, and a loss 1 ulp. What is left to check is that nothing else differs (rows
read twice or missed, a gradient summed over the wrong devices, an update on the wrong shard): differences
within the roundings the step makes, which `step_ulps` counts.

The runs train with SGD, which carries a gradient's difference to the parameters in proportion. Adam divides
each gradient by its own size, so an entry whose gradient is within rounding of zero may step by anything up
to the learning rate, and no rounding bounds its parameter (observed: 1.3e-5 apart, lr 1e-2, on a k_proj entry
whose gradient was 8e-10).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta

from tests.tolerances import assert_within, decoder_ulps, ulp_bound

PARTS = ("gradient", "sizes", "params")


def recording(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` behind a transformation that passes the gradient on and keeps in its state the first step's
    gradient and, per leaf, the sum over steps of the gradient's largest |entry| (the parameters' bound's
    scale)."""

    def init(params):
        sizes = jax.tree_util.tree_map(lambda p: jnp.zeros((), p.dtype), meta.unbox(params))
        return jax.tree_util.tree_map(jnp.zeros_like, params), sizes, jnp.zeros((), jnp.int32)

    def update(grads, state, params=None):
        first, sizes, count = state
        first = jax.tree_util.tree_map(lambda g, kept: jnp.where(count == 0, g, kept), grads, first)
        sizes = jax.tree_util.tree_map(lambda g, total: total + jnp.max(jnp.abs(g)), grads, sizes)
        return grads, (first, sizes, count + 1)

    return optax.chain(optax.GradientTransformation(init, update), optimizer)


def step_ulps(config, seq_len: int, rows: int) -> tuple[float, float]:
    """(loss ulps of the loss, gradient ulps of a leaf's largest entry) by which a mesh's train step of the
    decoder `config` over `rows` rows of `seq_len` targets may differ from one device's.

    Along the forward the decoder rounds `decoder_ulps` worth (Dew against itself in another order); the loss
    adds a `vocab_size`-term log-sum-exp and the sum over positions, on logits smaller than the loss (fresh
    weights). The backward retraces the forward's products, transposed, and each weight's gradient then sums
    over the positions. Random walks, as in `decoder_ulps`: sqrt(6 N) ulps for N roundings.
    """
    forward = decoder_ulps(layers=config.num_layers, width=config.emb_features, mlp_width=config.mlp_features,
                           heads=config.num_heads, head_dim=config.head_dim, seq_len=seq_len, libraries=1)
    positions = rows * seq_len
    loss = math.sqrt(forward**2 + 6 * (config.vocab_size + positions - 1))
    gradient = math.sqrt(2 * forward**2 + 6 * (positions - 1))
    return loss, gradient


def outcome(history: list[dict], state, to_host=np.asarray) -> dict:
    """A run under `recording(optax.sgd(...))` for `assert_like_one_device`: its logged losses, and by path
    under `params` its first gradient, summed sizes and final parameters, each brought to the host by
    `to_host`."""
    first, sizes, _ = state.opt_state[0]

    def flat(tree):
        return {jax.tree_util.keystr(path): np.asarray(to_host(leaf))
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

    return {"losses": np.asarray([row["train/loss"] for row in history if "train/loss" in row]),
            "gradient": flat(first), "sizes": flat(sizes), "params": flat(state.params["params"])}


def save(path: str, run: dict) -> None:
    """Write an `outcome` to one .npz file."""
    np.savez(path, losses=run["losses"], **{f"{part}:{name}": value for part in PARTS
                                            for name, value in run[part].items()})


def load(path: str) -> dict:
    """An `outcome` that `save` wrote."""
    with np.load(path) as stored:
        run = {"losses": stored["losses"], **{part: {} for part in PARTS}}
        for key in stored.files:
            part, _, name = key.partition(":")
            if part in PARTS:
                run[part][name] = stored[key]
    return run


def assert_like_one_device(one: dict, other: dict, *, rate: float, ulps: tuple[float, float], what: str) -> None:
    """Hold `other`'s run to one device's `one` (two `outcome`s of SGD at `rate`): losses within `ulps[0]` of
    the loss, first gradients within `ulps[1]` of each leaf's largest entry, and parameters within what those
    gradient differences move them by (the learning rate times `ulps[1]` of each leaf's summed sizes) plus an
    ulp of rounding each step (the update's subtraction)."""
    loss_ulps, gradient_ulps = ulps
    assert len(other["losses"]) == len(one["losses"]) > 0, (other["losses"], one["losses"])
    assert sorted(other["params"]) == sorted(one["params"]) and sorted(other["gradient"]) == sorted(one["gradient"])
    assert_within(other["losses"], one["losses"], ulp_bound(loss_ulps, np.abs(one["losses"])), f"{what}: losses")
    for name, gradient in one["gradient"].items():
        assert_within(other["gradient"][name], gradient, ulp_bound(gradient_ulps, np.abs(gradient).max()),
                      f"{what}: first gradient {name}")
    steps = len(one["losses"])
    for name, params in one["params"].items():
        bound = rate * ulp_bound(gradient_ulps, one["sizes"][name]) + ulp_bound(steps, np.abs(params))
        assert_within(other["params"][name], params, bound, f"{what}: parameters {name}")
