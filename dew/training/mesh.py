"""The mesh and parameter layout, kept importable here for existing callers; they live in `dew.sharding`."""

from dew.sharding import BATCH_AXES, Layout, MeshSpec, Rules, batch_sharding, place_batch, replicated

__all__ = ["BATCH_AXES", "Layout", "MeshSpec", "Rules", "batch_sharding", "place_batch", "replicated"]
