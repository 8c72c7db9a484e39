"""The language-model objective: `LMObjective`, `IndexerTraining`, `Perplexity`, `Samples`, `prompt_batch`,
`TEXT_KEY`, the chat pieces it scores (`Role`, `sessions`) and `SampledRollout`, which samples with its policy."""

from dew.data.chat import Role
from dew.metrics import Perplexity, perplexity
from dew.objectives.lm import sessions
from dew.objectives.lm.config import LMRunConfig
from dew.objectives.lm.indexer import IndexerTraining
from dew.objectives.lm.objective import (
    LMObjective, LMStatistics, ROLES_KEY, Samples, Scores, TEXT_KEY, prompt_batch,
)
from dew.objectives.lm.rollout import SampledRollout
from dew.objectives.lm.scoring import Rollout, support_log_probs

__all__ = ["IndexerTraining", "LMObjective", "LMRunConfig", "LMStatistics", "Perplexity", "ROLES_KEY", "Role", "Rollout",
           "SampledRollout", "Samples", "Scores", "TEXT_KEY", "perplexity", "prompt_batch", "sessions", "support_log_probs"]
