"""How arrays are split over devices: the mesh, logical axis rules, batches, and multi-process start-up.

A mesh has four axes, `("data", "fsdp", "expert", "tensor")`. Every batch is split over `data` and
`fsdp`; a parameter is split by its logical axis names (`"embed"`, `"mlp"`, ... as
`flax.linen.with_logical_partitioning` records them), which `Rules` map onto mesh axes. A leaf
without names (or any leaf, when the model carries none) falls back to one heuristic: split over
`fsdp` along its largest divisible axis. Either way an array under `Layout.min_shard` bytes stays
whole. `MeshSpec(data=8)` is data parallel, `MeshSpec(data=1, fsdp=8)` with a small `min_shard` is
fully sharded, `tensor` and `expert` add tensor and expert parallelism; XLA inserts the collectives.
Several processes join one run through `initialize()` before the first JAX computation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax.core import meta
from flax.linen import LogicallyPartitioned
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# `tensor` is the innermost axis: neighbouring devices (one host, one NVLink island) exchange the most.
MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Device counts per mesh axis; `-1` on one axis takes the devices the others leave."""

    data: int = -1
    """Copies of the parameters that each read their own rows (data parallelism)."""
    fsdp: int = 1
    """Devices that read their own rows and split the parameters between them (fully sharded)."""
    expert: int = 1
    """Devices that split a mixture's experts between them (the `expert` logical axis)."""
    tensor: int = 1
    """Devices that split each layer's heads, MLP width and vocabulary between them (same rows)."""

    def sizes(self, count: int) -> dict[str, int]:
        """The size of every axis on `count` devices, in `MESH_AXES` order."""
        sizes = {axis: getattr(self, axis) for axis in MESH_AXES}
        free = [axis for axis, size in sizes.items() if size == -1]
        if len(free) > 1:
            raise ValueError(f"{self!r}: only one axis may be -1, here {free} are")
        wrong = {axis: size for axis, size in sizes.items() if size < 1 and size != -1}
        if wrong:
            raise ValueError(f"{self!r}: axis sizes {wrong} must be at least 1 (or -1 for the rest)")
        if free:
            fixed = math.prod(size for size in sizes.values() if size != -1)
            sizes[free[0]] = count // fixed if count % fixed == 0 else 0
        if math.prod(sizes.values()) != count or min(sizes.values()) < 1:
            raise ValueError(
                f"{self!r} does not tile the {count} available devices: "
                f"data * fsdp * expert * tensor must equal {count}"
            )
        return sizes

    def build(self, devices=None) -> Mesh:
        """The mesh over `devices` (default every device of every process), in their order."""
        devices = jax.devices() if devices is None else list(devices)
        sizes = self.sizes(len(devices))
        return Mesh(np.asarray(devices).reshape(tuple(sizes.values())), MESH_AXES)


def _axes(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclasses.dataclass(frozen=True)
class Rules:
    """The mesh axes each logical axis name is split over, tried in order; `()` keeps it whole.

    `kv` is the key/value heads axis of grouped-query attention, `head_dim` the width of one head,
    `layers` the stacked axis of scanned layers, `norm` a norm's scale. A rule may be given as one
    axis name (`Rules(embed="fsdp")`); it is stored as a tuple.
    """

    vocab: tuple[str, ...] = ("tensor",)
    embed: tuple[str, ...] = ("fsdp",)
    heads: tuple[str, ...] = ("tensor",)
    kv: tuple[str, ...] = ("tensor",)
    mlp: tuple[str, ...] = ("tensor",)
    head_dim: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    expert: tuple[str, ...] = ("expert",)
    norm: tuple[str, ...] = ()

    def __post_init__(self):
        for field in dataclasses.fields(self):
            axes = _axes(getattr(self, field.name))
            unknown = [axis for axis in axes if axis not in MESH_AXES]
            if unknown or len(set(axes)) != len(axes):
                raise ValueError(
                    f"Rules.{field.name} is {axes}: name each of the mesh axes {MESH_AXES} at most once"
                )
            object.__setattr__(self, field.name, axes)

    def mesh_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes for the logical axis `name`."""
        if name not in _RULE_NAMES:
            raise ValueError(
                f"logical axis name {name!r} has no rule: the names are {_RULE_NAMES}; "
                "annotate the parameter with one of them (flax.linen.with_logical_partitioning)"
            )
        return getattr(self, name)


_RULE_NAMES = tuple(field.name for field in dataclasses.fields(Rules))


def _is_box(x) -> bool:
    return isinstance(x, meta.Partitioned)


def logical_names(tree) -> tuple[Any, Any]:
    """Split a tree holding Flax `Partitioned` boxes into its plain values and their names.

    The names tree matches the plain one: a `PartitionSpec` of logical names per boxed leaf, `None`
    for a leaf that carried none. Optimizer state and EMA built from boxed parameters (under
    `jax.eval_shape`) carry the same boxes, so one call names the whole training state.
    """
    plain = jax.tree_util.tree_map(lambda x: x.value if _is_box(x) else x, tree, is_leaf=_is_box)
    names = jax.tree_util.tree_map(lambda x: PartitionSpec(*x.names) if _is_box(x) else None, tree, is_leaf=_is_box)
    return plain, names


def with_names(tree, names):
    """`tree` with each leaf boxed in its logical axis names from `names` (a tree of `PartitionSpec`s
    matching it, as `flax.linen.get_partition_spec` or a model's `logical_names()` gives); a leaf with
    no names, or a subtree `names` does not cover (a collection the objective adds), stays plain.
    `logical_names` undoes it."""
    if isinstance(tree, Mapping) and isinstance(names, Mapping):
        return {key: with_names(value, names[key]) if key in names else value for key, value in tree.items()}

    def box(value, spec):
        return value if spec is None or len(spec) == 0 else LogicallyPartitioned(value, tuple(spec))

    return jax.tree_util.tree_map(box, tree, names)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How parameters are split: by their logical names through `rules`, else over `fsdp` by size.

    Arrays of fewer than `min_shard` bytes stay whole on every device: splitting them saves little
    memory and costs a collective each.
    """

    min_shard: int = 2**20
    """Bytes below which an array stays whole on every device."""
    rules: Rules = Rules()
    """The mesh axes of each logical axis name."""

    def spec(self, shape: tuple[int, ...], itemsize: int, fsdp: int) -> PartitionSpec:
        """The fallback partition of one unnamed array: its largest axis that `fsdp` divides, or whole."""
        if fsdp == 1 or math.prod(shape) * itemsize < self.min_shard:
            return PartitionSpec()
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % fsdp == 0:
                spec = [None] * len(shape)
                spec[axis] = "fsdp"
                return PartitionSpec(*spec)
        return PartitionSpec()

    def logical_spec(self, names: PartitionSpec, shape: tuple[int, ...], itemsize: int,
                     mesh_sizes: dict[str, int]) -> PartitionSpec:
        """The partition of one array whose axes carry the logical `names` (one entry per axis).

        Each axis takes the mesh axes its names' rules list, in order, skipping a mesh axis of size
        1, one an earlier array axis already took, and one whose size would not divide the axis.
        """
        if math.prod(shape) * itemsize < self.min_shard:
            return PartitionSpec()
        taken: set[str] = set()
        entries = []
        for length, entry in zip(shape, names):
            chosen: list[str] = []
            split = 1
            for name in _axes(entry):
                for axis in self.rules.mesh_axes(name):
                    size = mesh_sizes.get(axis, 1)
                    if size == 1 or axis in taken or length % (split * size):
                        continue
                    chosen.append(axis)
                    taken.add(axis)
                    split *= size
            entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
        if all(entry is None for entry in entries):
            return PartitionSpec()
        return PartitionSpec(*entries)

    def shardings(self, mesh, tree, names=None):
        """A `NamedSharding` for every array (or `ShapeDtypeStruct`) leaf of `tree`.

        `names` is a tree matching `tree` with a `PartitionSpec` of logical names (or `None`) per
        leaf, as `flax.linen.get_partition_spec` gives; without it, Flax `Partitioned` boxes in
        `tree` supply the names (`logical_names`), and the result matches the unboxed tree. A leaf
        with no names, or the empty `PartitionSpec()` Flax gives an unboxed array, takes the
        fallback `spec`. `mesh` may be a `Mesh` or an `AbstractMesh`.
        """
        if names is None:
            tree, names = logical_names(tree)
        sizes = dict(mesh.shape)
        fsdp = sizes.get("fsdp", 1)

        def place(path, leaf, leaf_names):
            shape, itemsize = tuple(leaf.shape), np.dtype(leaf.dtype).itemsize
            if leaf_names is None or (len(leaf_names) == 0 and shape):
                return NamedSharding(mesh, self.spec(shape, itemsize, fsdp))
            if len(leaf_names) != len(shape):
                raise ValueError(
                    f"{jax.tree_util.keystr(path)} has shape {shape} but logical names {tuple(leaf_names)}: "
                    "name every axis once (None for an axis that stays whole)"
                )
            return NamedSharding(mesh, self.logical_spec(leaf_names, shape, itemsize, sizes))

        return jax.tree_util.tree_map_with_path(place, tree, names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over the batch axes (`data`, `fsdp`); the other axes hold whole copies."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def in_mesh(mesh: Mesh, function):
    """`function` traced with `mesh` in force (`jax.sharding.use_abstract_mesh`), so `rows_split` inside it
    constrains to it: the trainer's compiled steps run under this."""

    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return function(*args, **kwargs)

    return traced


def rows_split(x_B):
    """`x_B` with its rows split over the batch axes of the mesh in force (`in_mesh`), its other axes whole;
    unchanged outside one. Activations follow the batch this way: left to itself, XLA lets an fsdp-split
    embedding table split the width instead, gathering every row onto every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x_B
    return jax.lax.with_sharding_constraint(x_B, PartitionSpec(BATCH_AXES))


def place_batch(mesh: Mesh, batch: dict) -> dict:
    """Assemble this process's host rows into global arrays split over the batch axes.

    Each entry is an array of rows or a pytree of them (a `ModelInputs`), placed leaf by leaf."""
    sharding = batch_sharding(mesh)
    shards = math.prod(mesh.shape[axis] for axis in BATCH_AXES)

    def place(rows):
        rows = np.asarray(rows)
        global_rows = rows.shape[0] * jax.process_count()
        if global_rows % shards:
            raise ValueError(
                f"a batch of {global_rows} rows does not split over {shards} devices (data x fsdp): "
                f"use a batch size that is a multiple of {shards}"
            )
        return jax.make_array_from_process_local_data(sharding, rows)

    return {name: jax.tree_util.tree_map(place, rows) for name, rows in batch.items()}


# -- several processes ---------------------------------------------------------------------------
COORDINATOR, NUM_PROCESSES, PROCESS_ID = "DEW_COORDINATOR", "DEW_NUM_PROCESSES", "DEW_PROCESS_ID"


def _setting(value, variable: str, kind):
    if value is not None:
        return value
    text = os.environ.get(variable)
    if text is None or text == "":
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{variable}={text!r} is not a {kind.__name__}") from None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: float = 300) -> bool:
    """Join this process to a multi-process run; returns whether it joined one.

    Call it first, before any JAX computation. The run is described by the arguments, else by
    `DEW_COORDINATOR` (host:port of process 0, which serves it), `DEW_NUM_PROCESSES` and
    `DEW_PROCESS_ID`; with none of them, JAX's own detection runs (`JAX_COORDINATOR_ADDRESS`,
    Slurm, Open MPI, Kubernetes, Cloud TPU), and finding nothing means a single process: nothing
    is started (also when JAX already runs and only that detection could have said otherwise, and, with a
    warning, when the detection cannot reach the cloud metadata server it asks).
    Cross-process collectives on CPU go through gloo. Process 0 waits up to `timeout_s` seconds for
    the others; another process that cannot reach the coordinator in that time raises
    `ConnectionError`.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator = _setting(coordinator, COORDINATOR, str)
    num_processes = _setting(num_processes, NUM_PROCESSES, int)
    process_id = _setting(process_id, PROCESS_ID, int)
    given = {COORDINATOR: coordinator, NUM_PROCESSES: num_processes, PROCESS_ID: process_id}
    explicit = any(value is not None for value in given.values())
    if explicit:
        if num_processes is not None and num_processes < 1:
            raise ValueError(f"{NUM_PROCESSES}={num_processes}: a run has at least one process")
        if num_processes == 1 and process_id in (None, 0):
            return False
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"a multi-process run needs {', '.join(missing)} as well (set: "
                             f"{', '.join(f'{k}={v}' for k, v in given.items() if v is not None)})")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{PROCESS_ID}={process_id} is outside 0..{num_processes - 1} "
                             f"({NUM_PROCESSES}={num_processes})")
        host, port = _host_port(coordinator)
        if process_id != 0:
            # XLA's client aborts the whole process when it cannot register, so look first.
            _wait_for_coordinator(host, port, process_id, num_processes, timeout_s)
    # Set before the backend starts; gloo is also JAX's default, named here so a run never depends on it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        if explicit:
            # Everything is given: JAX's cluster detection must not override it (e.g. under Slurm).
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       initialization_timeout=max(1, math.ceil(timeout_s)),
                                       cluster_detection_method="deactivate")
        else:
            jax.distributed.initialize(initialization_timeout=max(1, math.ceil(timeout_s)))
    except ValueError as error:
        if not explicit and "coordinator_address should be defined" in str(error):
            return False  # no cluster detected: a single process
        raise
    except OSError as error:
        if explicit:
            raise
        # Only detection touches the network here: its Cloud TPU probe asks the cloud's metadata server, which a
        # TPU or GPU machine outside that cloud (a container, a sandbox, a workstation) cannot reach.
        warnings.warn(f"JAX's cluster detection got no answer from the cloud's metadata server ({type(error).__name__}: "
                      f"{str(error)[:160]}): running as a single process; a multi-process run sets {COORDINATOR}, "
                      f"{NUM_PROCESSES} and {PROCESS_ID}", stacklevel=2)
        return False
    except jax.errors.JaxRuntimeError as error:
        if explicit and process_id == 0:
            raise ConnectionError(
                f"process 0 could not serve the run's coordinator on port {port} "
                f"({str(error).strip()}): the port is taken or not bindable here; choose another in {COORDINATOR}"
            ) from None
        raise
    except RuntimeError as error:
        if "must be called before" not in str(error):
            raise
        if not explicit and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
            return False  # JAX already runs as one process and nothing asks for more
        raise RuntimeError("dew.sharding.initialize() came after the first JAX computation: call it first, "
                           "before jax.devices(), an array or a jit") from None
    return True


def _host_port(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR}={coordinator!r} is not host:port (for example 10.0.0.1:1234)")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(host: str, port: int, process_id: int, num_processes: int, timeout_s: float) -> None:
    """Return once the coordinator accepts TCP connections; raise `ConnectionError` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, timeout_s))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"process {process_id} of {num_processes} could not reach the coordinator at {host}:{port} "
                    f"within {timeout_s} s ({error.strerror or error}): start process 0 first, check that "
                    f"{host} port {port} is reachable from here, and give every process the same {COORDINATOR}"
                ) from None
            time.sleep(0.2)
