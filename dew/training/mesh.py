"""`MeshSpec` and `Layout`: data parallelism and fully sharded parameters over `jax.sharding`.

Both are one code path: a mesh with axes `("data", "fsdp")`; every batch is split over both axes,
and a parameter (with its optimizer state and EMA) is split over `fsdp` along its largest divisible
axis once it holds at least `Layout.min_shard` bytes. `MeshSpec(data=8)` is data parallel,
`MeshSpec(data=1, fsdp=8)` with a small `min_shard` is fully sharded; XLA inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Device counts per mesh axis; `-1` takes the devices the other axis leaves."""

    data: int = -1
    fsdp: int = 1

    def build(self, devices=None) -> Mesh:
        devices = jax.devices() if devices is None else list(devices)
        count = len(devices)
        data, fsdp = self.data, self.fsdp
        if data == -1 and fsdp == -1:
            raise ValueError("MeshSpec: only one of data and fsdp may be -1")
        if data == -1:
            data = count // fsdp if fsdp > 0 and count % fsdp == 0 else 0
        if fsdp == -1:
            fsdp = count // data if data > 0 and count % data == 0 else 0
        if data < 1 or fsdp < 1 or data * fsdp != count:
            raise ValueError(
                f"MeshSpec(data={self.data}, fsdp={self.fsdp}) does not tile the {count} available devices: "
                f"data * fsdp must equal {count}"
            )
        return Mesh(np.asarray(devices).reshape(data, fsdp), BATCH_AXES)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which parameters the `fsdp` axis splits: those of at least `min_shard` bytes."""

    min_shard: int = 2**20

    def spec(self, shape: tuple[int, ...], itemsize: int, fsdp: int) -> PartitionSpec:
        """The partition of one array: its largest axis that `fsdp` divides, or replicated."""
        if fsdp == 1 or math.prod(shape) * itemsize < self.min_shard:
            return PartitionSpec()
        for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[axis] % fsdp == 0:
                spec = [None] * len(shape)
                spec[axis] = "fsdp"
                return PartitionSpec(*spec)
        return PartitionSpec()

    def shardings(self, mesh: Mesh, tree):
        """A `NamedSharding` for every array (or `ShapeDtypeStruct`) leaf of `tree`."""
        fsdp = mesh.shape["fsdp"]
        return jax.tree_util.tree_map(
            lambda x: NamedSharding(mesh, self.spec(tuple(x.shape), np.dtype(x.dtype).itemsize, fsdp)), tree
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over every device; the other axes whole."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place_batch(mesh: Mesh, batch: dict) -> dict:
    """Assemble this process's host rows into global arrays split over the batch axes."""
    sharding = batch_sharding(mesh)
    devices = mesh.devices.size
    placed = {}
    for name, rows in batch.items():
        rows = np.asarray(rows)
        global_rows = rows.shape[0] * jax.process_count()
        if global_rows % devices:
            raise ValueError(
                f"a batch of {global_rows} rows does not split over {devices} devices: "
                f"use a batch size that is a multiple of {devices}"
            )
        placed[name] = jax.make_array_from_process_local_data(sharding, rows)
    return placed
