"""The layers of a decoder as runs: consecutive layers whose specs agree up to their per-layer values
scan as one `nn.scan`, so the program (and its compile time) does not grow with depth.

A scanned run keeps its layers' variables stacked on a leading axis under one name,
`layers_{first}to{last}` (`layers_0to29` for a uniform 30-layer decoder), with transformers' names
inside; that is the tree `init` returns, the trainer updates (one optimizer op per stacked leaf, not
per layer) and checkpoints hold. `unstack_variables` gives the per-layer form (`layers_N`), which
published checkpoints and exports use, and `stack_variables` the reverse; `apply` accepts either
(a per-layer tree is stacked on the way in, at the cost of one copy of the weights per call).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.kernels.accelerator_attention import RESIDUALS as ATTENTION
from dew.kernels.policy import setting
from dew.nn.attention import NO_WINDOW
from dew.nn.layer import CONSTANTS, DecoderLayer, LayerKnobs, LayerSpec
from dew.nn.linear import (BLOCKS_LAYER, KERNEL, KERNEL_BLOCKS, MLP_PRODUCT, PRODUCT, QUANT_COLLECTION, STACKED_BLOCKS,
                           STACKED_LAYER)
from dew.nn.moe import BIAS_COLLECTION
from dew.nn.rotary import rotary_angles

# What a layer keeps for the backward pass, by the names its values carry (`checkpoint_name`): a linear's output
# is PRODUCT, or MLP_PRODUCT where its weight has an "mlp" axis; an accelerator attention kernel's output and
# log-sum-exp are ATTENTION. The rest (norms, rotary, activations) is recomputed under any policy but "none".
REMAT_POLICIES = {
    "none": None,  # keep every activation
    "dots": (PRODUCT, MLP_PRODUCT, ATTENTION),  # keep every product's output, the attention kernel's too
    "dots_no_batch": (PRODUCT, MLP_PRODUCT),  # keep the linears' outputs; attention runs again
    "dots_no_mlp": (PRODUCT, ATTENTION),  # keep attention's side; the feed-forward runs again
    "full": (),  # keep nothing: the layer runs again
}
# "auto" (DecoderConfig.remat's default): the trainer picks, per step, the first of these (the least
# recomputation first) whose compiled step fits the device's memory (dew.training.memory); elsewhere "none".
AUTO_LADDER = ("none", "dots", "dots_no_mlp", "full")
_REMAT_IN_FORCE = contextvars.ContextVar("dew_remat_in_force", default=None)


def remat_in_force(remat: str) -> contextlib.AbstractContextManager[None]:
    """Trace the layers of a model whose `remat` is "auto" under the policy `remat` (the trainer's choice)."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat {remat!r} is not a policy: use one of {list(REMAT_POLICIES)}")
    return setting(_REMAT_IN_FORCE, remat)


def resolved_remat(remat: str) -> str:
    """The policy a model's `remat` traces under: itself, or for "auto" the one `remat_in_force` set ("none"
    outside a trainer's step)."""
    return (_REMAT_IN_FORCE.get() or "none") if remat == "auto" else remat


def runs(specs: Sequence[LayerSpec], scan_from: int) -> list[tuple[int, int, bool]]:
    """`(start, stop, scanned)` of each run: consecutive like layers (equal `scan_key`) form a run,
    scanned when it holds at least `scan_from` layers (0: never); a shorter run is unrolled, one
    layer a run."""
    groups: list[list[int]] = []
    for index, spec in enumerate(specs):
        if groups and specs[groups[-1][0]].scan_key() == spec.scan_key():
            groups[-1].append(index)
        else:
            groups.append([index])
    bounds = []
    for group in groups:
        if scan_from and len(group) >= scan_from:
            bounds.append((group[0], group[-1] + 1, True))
        else:
            bounds.extend((i, i + 1, False) for i in group)
    return bounds


def _layer_name(index: int) -> str:
    return f"layers_{index}"


_RUN = re.compile(r"layers_(\d+)to(\d+)")


def layer_range(name: str) -> range:
    """The layers a variables subtree named `layers_N` or `layers_{first}to{last}` holds."""
    match = _RUN.fullmatch(name)
    if match is not None:
        return range(int(match[1]), int(match[2]) + 1)
    index = int(name.removeprefix("layers_"))
    return range(index, index + 1)


def run_name(start: int, stop: int) -> str:
    """The name a scanned run of layers `start` to `stop - 1` keeps its stacked variables under."""
    return f"layers_{start}to{stop - 1}"


def stack_variables(specs: Sequence[LayerSpec], scan_from: int, variables):
    """Variables in the form a model with these specs keeps: its scanned runs stacked
    (`layers_{first}to{last}`), every other layer on its own (`layers_N`). A tree already in that
    form is returned as it is; any other is brought to it from its per-layer form."""
    if not isinstance(variables, Mapping):
        return variables
    wanted = {run_name(start, stop): (start, stop) for start, stop, scanned in runs(specs, scan_from) if scanned}
    inside = {_layer_name(i) for start, stop in wanted.values() for i in range(start, stop)}
    trees = [tree for tree in variables.values() if isinstance(tree, Mapping)]
    if all(key in wanted or (not _RUN.fullmatch(key) and key not in inside) for tree in trees for key in tree):
        return _lifted(variables, wanted)
    stacked = {}
    for collection, tree in unstack_variables(variables).items():
        if not isinstance(tree, Mapping):
            stacked[collection] = tree
            continue
        moved = dict(tree)
        for name, (start, stop) in wanted.items():
            layers = [moved.pop(_layer_name(i)) for i in range(start, stop) if _layer_name(i) in moved]
            if layers:
                moved[name] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
        stacked[collection] = moved
    return _lifted(stacked, wanted)


def _lifted(variables: Mapping, runs_named: Mapping) -> Mapping:
    """`variables` with the blocks of every scanned run (`runs_named`) in the `STACKED_BLOCKS`
    collection (`_lift_blocks`); as they are where there are none to move."""
    quant = variables.get(QUANT_COLLECTION)
    if not isinstance(quant, Mapping) or not any(name in quant for name in runs_named):
        return variables
    whole = {name: {} for name in runs_named if name in quant}
    lifted = {name: _lift_blocks(tree, whole[name]) if name in whole else tree for name, tree in quant.items()}
    whole = {name: tree for name, tree in whole.items() if tree}
    if not whole:
        return variables
    return {**variables, QUANT_COLLECTION: lifted, STACKED_BLOCKS: {**variables.get(STACKED_BLOCKS, {}), **whole}}


def _lift_blocks(tree: Mapping, whole: dict) -> dict:
    """A scanned run's quant subtree with each stack of blocks moved to `whole` (its place in the
    `STACKED_BLOCKS` collection) and replaced by its layers' indices `BLOCKS_LAYER` `[L]`, which the scan
    slices to each layer's own."""
    kept = {}
    for key, value in tree.items():
        if key == KERNEL_BLOCKS:
            whole[key] = value
            kept[BLOCKS_LAYER] = layer_indices(value)
        elif isinstance(value, Mapping):
            inner = whole.setdefault(key, {})
            kept[key] = _lift_blocks(value, inner)
            if not inner:
                del whole[key]
        else:
            kept[key] = value
    return kept


def _lower_blocks(quant: Mapping, whole: Mapping) -> dict:
    """`_lift_blocks` undone: each `BLOCKS_LAYER` in `quant` replaced by the stack of blocks `whole` holds."""
    lowered = {key: value for key, value in quant.items() if key != BLOCKS_LAYER}
    for key, value in whole.items():
        lowered[key] = value if key == KERNEL_BLOCKS else _lower_blocks(quant[key], value)
    return lowered


def lift_kernels(variables: Mapping, paths) -> dict:
    """`variables` (in a model's own form) with the kernel (float32, bfloat16 or its uint16 bits, int8) of
    every linear at `paths` (module paths) inside a scanned run moved whole to the `STACKED_BLOCKS`
    collection, which the scan hands every layer unsliced, and its layers' indices `[L]` put in
    `STACKED_LAYER`, which the scan slices: a decode step's product then reads its layer in place
    (`dew.kernels.matmul.stacked_product`) where a slice would copy it every step. For generation, not for
    training (the in-place product has no gradient); `unstack_variables` puts the kernels back."""
    moved, params = False, dict(variables.get("params", {}))
    whole, indices = dict(variables.get(STACKED_BLOCKS, {})), dict(variables.get(STACKED_LAYER, {}))
    for path in paths:
        if not path or not _RUN.fullmatch(path[0]):
            continue
        trail = [params]
        for name in path:
            trail.append(trail[-1].get(name) if isinstance(trail[-1], Mapping) else None)
        kernel = trail[-1].get(KERNEL) if isinstance(trail[-1], Mapping) else None
        if kernel is None or kernel.ndim != 3 or kernel.dtype not in (jnp.float32, jnp.bfloat16, jnp.uint16, jnp.int8):
            continue
        module = {key: value for key, value in trail[-1].items() if key != KERNEL}
        for depth in range(len(path) - 1, -1, -1):  # rebuild the containers along the path without the kernel
            parent = dict(trail[depth])
            parent[path[depth]] = module
            module = parent
        params = module
        _place(whole, path, kernel)
        _place(indices, path, layer_indices(kernel))
        moved = True
    if not moved:
        return dict(variables)
    return {**variables, "params": params, STACKED_BLOCKS: whole, STACKED_LAYER: indices}


def stacked_kernels(variables: Mapping) -> bool:
    """Whether `variables` hold a kernel `lift_kernels` could move: a 3-D `KERNEL` leaf inside a scanned
    run's params (a GGUF file's blocks sit in their own collections, so a file kept whole in blocks has none)."""

    def holds(tree) -> bool:
        return isinstance(tree, Mapping) and any(
            (key == KERNEL and getattr(value, "ndim", 0) == 3) or holds(value) for key, value in tree.items())

    return any(_RUN.fullmatch(name) and holds(tree) for name, tree in variables.get("params", {}).items())


def layer_indices(stack) -> jax.Array:
    """`[0, L)` for a stack of L layers, on the devices that hold the stack (replicated over them): a
    model placed on several devices keeps every variable there."""
    if not isinstance(stack, jax.Array) or isinstance(stack, jax.core.Tracer):
        return jnp.arange(stack.shape[0], dtype=jnp.int32)
    index = np.arange(stack.shape[0], dtype=np.int32)  # put from the host: jnp.arange would compile a program
    devices = sorted(stack.sharding.device_set, key=lambda device: device.id)
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    return jax.device_put(index, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _place(tree: dict, path, leaf) -> None:
    """Put `leaf` under `KERNEL` at `path` of `tree`, copying the mappings on the way (they may be shared)."""
    for name in path:
        tree[name] = dict(tree.get(name, {}))
        tree = tree[name]
    tree[KERNEL] = leaf


def _lower_kernels(params: Mapping, whole: Mapping, indices: Mapping) -> tuple[dict, dict]:
    """`lift_kernels` undone for the kernels `indices` names: (params with each back in place, what else
    `whole` holds)."""
    params, whole = dict(params), dict(whole)
    for key, value in indices.items():
        if key == KERNEL:
            params[KERNEL] = whole.pop(KERNEL)
            continue
        params[key], whole[key] = _lower_kernels(params.get(key, {}), whole[key], value)
        if not whole[key]:
            del whole[key]
    return params, whole


def unstack_variables(variables):
    """The inverse of `stack_variables`: each `layers_{first}to{last}` subtree split into `layers_N`
    subtrees (run names say their layers, so no spec is needed)."""
    if not isinstance(variables, Mapping) or not any(
            isinstance(tree, Mapping) and any(_RUN.fullmatch(key) for key in tree) for tree in variables.values()):
        return variables
    if STACKED_LAYER in variables:
        variables = dict(variables)
        variables["params"], whole = _lower_kernels(variables["params"], variables.pop(STACKED_BLOCKS),
                                                    variables.pop(STACKED_LAYER))
        if whole:
            variables[STACKED_BLOCKS] = whole
    if STACKED_BLOCKS in variables:
        variables = dict(variables)
        variables[QUANT_COLLECTION] = _lower_blocks(variables[QUANT_COLLECTION], variables.pop(STACKED_BLOCKS))
    unstacked = {}
    for collection, tree in variables.items():
        if not isinstance(tree, Mapping):
            unstacked[collection] = tree
            continue
        moved = {}
        for key, value in tree.items():
            match = _RUN.fullmatch(key)
            if match is None:
                moved[key] = value
                continue
            first, last = int(match[1]), int(match[2])
            for i in range(first, last + 1):
                moved[_layer_name(i)] = jax.tree_util.tree_map(lambda x, i=i: x[i - first], value)
        unstacked[collection] = dict(sorted(moved.items(), key=lambda item: _order(item[0])))
    return unstacked


def _order(name: str):
    """Sort `layers_N` by N among the other names, so trees print in layer order."""
    return (1, int(name.removeprefix("layers_")), "") if name.startswith("layers_") else (0, 0, name)


def rotary_tables(specs: Sequence[LayerSpec], positions_BS, rotary_positions_BS3=None) -> tuple[dict, dict]:
    """One cos/sin table per distinct rotary setting of `specs`' mixers, at integer `positions_BS`
    (a three-axis setting, one with an `mrope_section`, at `rotary_positions_BS3` where given):
    `(tables, rotary)` as `apply_layers` and `LayerContext.rotary` read them (each setting's index among
    those of its width; per width the stacked tables, float32 `[R, B, S, width]`)."""
    ropes = list(dict.fromkeys(spec.mixer.rope() for spec in specs))
    tables, rotary = {}, {}
    for width in dict.fromkeys(rope[0] for rope in ropes):
        same = [rope for rope in ropes if rope[0] == width]
        tables.update({rope: index for index, rope in enumerate(same)})
        pairs = [rotary_angles(positions_BS if rotary_positions_BS3 is None or rope[2].mrope_section is None
                               else rotary_positions_BS3, *rope) for rope in same]
        rotary[width] = (jnp.stack([cos for cos, _ in pairs]), jnp.stack([sin for _, sin in pairs]))
    return tables, rotary


def _knobs(specs: Sequence[LayerSpec], tables: Mapping, start: int, stop: int, replay_LBSK) -> LayerKnobs:
    windows = [spec.mixer.window for spec in specs[start:stop]]
    slides = not all(w is None for w in windows)
    return LayerKnobs(
        window=jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32) if slides else None,
        windows=tuple(sorted({NO_WINDOW if w is None else w for w in windows})) if slides else (),
        rope=jnp.asarray([tables[spec.mixer.rope()] for spec in specs[start:stop]], jnp.int32),
        index=jnp.arange(start, stop, dtype=jnp.int32),
        local=jnp.arange(stop - start, dtype=jnp.int32),
        replay=None if replay_LBSK is None else replay_LBSK[start:stop],
    )


def _kv_kind(spec: LayerSpec) -> str:
    """Which layers' keys and values a layer shares: sliding layers' or full ones'."""
    return "full" if spec.mixer.window is None else "sliding"


def apply_layers(parent: nn.Module, specs: Sequence[LayerSpec], x_BSE, context, cache_runs, *, scan_from: int,
                 remat: str, keep: tuple[int, ...], tables: Mapping, dtype, param_dtype, replay_LBSK=None):
    """Run every layer inside `parent`'s compact scope; returns `(x_BSE, cache runs, kept states,
    routing, mixer reports)`: what the feed-forward blocks report (a `RouterRecord` per sparse layer)
    and what the mixers report (a dict of what the context asks for: `qk_max`, `indexer`), each
    stacked on a leading axis over the reporting layers in order (None when none reports).

    `tables` maps each layer's `mixer.rope()` key to its index among the tables of its width;
    `replay_LBSK` (one entry per layer, read by sparse ones) holds replayed experts, or is None.
    """
    kept = tuple(jnp.zeros_like(x_BSE) for _ in keep)
    new_cache = []
    layer_class = DecoderLayer
    kept_names = REMAT_POLICIES[resolved_remat(remat)]
    if kept_names is not None:
        policy = jax.checkpoint_policies.save_only_these_names(*kept_names)
        layer_class = nn.remat(DecoderLayer, policy=policy, prevent_cse=False)
    reports, mixer_reports = [], []
    shared = {}  # the keys and values a "store" layer of each kind reported, for the "reuse" layers after it
    for run, (start, stop, scan) in enumerate(runs(specs, scan_from)):
        spec = specs[start].scan_key() if scan else specs[start]
        knobs = _knobs(specs, tables, start, stop, replay_LBSK)
        cache = None if cache_runs is None else cache_runs[run]
        role = getattr(specs[start].mixer, "shared_kv", None)
        run_context = context.replace(shared_kv=shared[_kv_kind(specs[start])]) if role == "reuse" else context
        if scan:
            # Every collection a layer holds is stacked by layer: params, a router's balancing bias, int8
            # weights' scales, frozen output scalars, the indices of kernels read in place.
            scanned = nn.scan(layer_class, variable_axes={"params": 0, BIAS_COLLECTION: 0, QUANT_COLLECTION: 0,
                                                          CONSTANTS: 0, STACKED_LAYER: 0},
                              variable_broadcast=STACKED_BLOCKS,
                              split_rngs={"params": True, "dropout": True},
                              in_axes=(0, nn.broadcast), length=stop - start,
                              metadata_params={nn.PARTITION_NAME: "layers"})
            layer = scanned(spec, dtype, param_dtype, keep, parent=parent, name=run_name(start, stop))
            (x_BSE, cache, kept), report = layer((x_BSE, cache, kept), knobs, run_context)
        else:
            layer = layer_class(spec, dtype, param_dtype, keep, parent=parent, name=_layer_name(start))
            one = jax.tree_util.tree_map(lambda v: v[0], knobs)
            (x_BSE, cache, kept), report = layer((x_BSE, cache, kept), one, run_context)
            report = jax.tree_util.tree_map(lambda v: v[None], report)
        if role == "store":  # the run's last layer is the one that stores (runs of them are alike)
            mixed = dict(report[1])
            shared[_kv_kind(specs[start])] = jax.tree_util.tree_map(lambda v: v[-1], mixed.pop("shared_kv"))
            report = (report[0], mixed or None)
        if report[0] is not None:
            reports.append(report[0])
        if report[1] is not None:
            mixer_reports.append(report[1])
        new_cache.append(cache)
    stack = lambda found: jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *found) if found else None
    return x_BSE, None if cache_runs is None else tuple(new_cache), kept, stack(reports), stack(mixer_reports)
