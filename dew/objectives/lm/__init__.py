"""The language-model objective: `LMObjective`, `IndexerTraining`, `Perplexity`, `Samples`, `prompt_batch`, `TEXT_KEY`."""

from dew.metrics import Perplexity, perplexity
from dew.objectives.lm.config import LMRunConfig
from dew.objectives.lm.indexer import IndexerTraining
from dew.objectives.lm.objective import (
    LMObjective, LMStatistics, Samples, Scores, TEXT_KEY, prompt_batch,
)

__all__ = ["IndexerTraining", "LMObjective", "LMRunConfig", "LMStatistics", "Perplexity", "Samples", "Scores", "TEXT_KEY", "perplexity", "prompt_batch"]
