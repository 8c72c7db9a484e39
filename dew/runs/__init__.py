"""Run directories: what a recipe run leaves behind (`RunDirectory`), the lock one training process holds
on it (`RunLock`), and `dew.pipeline`, generation from a run directory or a published checkpoint."""

from dew.lazy import lazy_names

__all__ = ["RunDirectory", "RunLocked", "RunMismatch", "RunRecordError", "find_runs", "pipeline"]
# Each imported when first used: listing runs (`dew runs`, `dew plot`) reads their records without importing
# what generation needs (jax, Flax, the models).
__getattr__, __dir__ = lazy_names(__name__, {
    "RunLocked": "dew.runs.lock", "pipeline": "dew.runs.generation", "RunDirectory": "dew.runs.run_dir",
    "RunMismatch": "dew.runs.run_dir", "RunRecordError": "dew.runs.run_dir", "find_runs": "dew.runs.run_dir"})
