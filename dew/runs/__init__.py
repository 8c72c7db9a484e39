"""Run directories: what a recipe run leaves behind (`RunDirectory`), the lock one training process holds
on it (`RunLock`), and `dew.pipeline`, generation from a run directory or a published checkpoint."""

from dew.runs.lock import RunLocked
from dew.runs.pipeline import pipeline
from dew.runs.run_dir import RunDirectory, RunMismatch, RunRecordError, find_runs

__all__ = ["RunDirectory", "RunLocked", "RunMismatch", "RunRecordError", "find_runs", "pipeline"]
