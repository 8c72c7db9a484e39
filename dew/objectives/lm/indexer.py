"""`IndexerTraining`: DeepSeek-V3.2's two stages of training the lightning indexer (arXiv 2512.02556,
section 2.1.1), and the KL term both read from the model's `IndexerRecord`s (`dew.nn.mla`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

PHASES = ("warmup", "sparse")


@dataclasses.dataclass(frozen=True)
class IndexerTraining:
    """Train DeepSeek-V3.2's lightning indexer, one stage at a time.

    `warmup` trains a fresh indexer alone: the model attends densely (a latent mixer with the indexer's
    heads and no `index_topk`), every other weight is frozen, and the loss is the KL of the indexer's
    softmax from the dense attention distribution over every allowed key; no cross entropy. `sparse`
    trains everything: the model attends to its top-k, the cross entropy trains the main weights, and
    the KL over the selected keys trains the indexer, whose inputs are detached so neither reaches
    the other. `weight` scales the KL (MaxText's `indexer_loss_scaling_factor`).
    """

    phase: Literal["warmup", "sparse"]
    weight: float = 1.0

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"IndexerTraining phase is {self.phase!r}; it is one of {list(PHASES)}")
        if not self.weight >= 0:
            raise ValueError(f"IndexerTraining weight is {self.weight}; use a weight >= 0")

    @property
    def warmup(self) -> bool:
        return self.phase == "warmup"

    def check(self, config) -> None:
        """Refuse a model this stage cannot train, naming the fix."""
        latent = getattr(config, "latent", None)
        if latent is None or not latent.index_heads:
            raise ValueError(f"IndexerTraining(phase={self.phase!r}) trains a lightning indexer, and this model has "
                             "none: build it with latent=LatentAttention(..., index_heads=...) (DeepSeek-V3.2), or "
                             "leave indexer unset")
        if self.warmup and latent.index_topk is not None:
            raise ValueError(f"IndexerTraining(phase='warmup') trains the indexer beside dense attention, and this "
                             f"model attends only to the indexer's top {latent.index_topk}: build it with index_topk "
                             "None for the warm-up, or use phase='sparse'")
        if not self.warmup and latent.index_topk is None:
            raise ValueError("IndexerTraining(phase='sparse') trains on the indexer's top-k keys, and this model has "
                             "no index_topk (it attends densely): build it with index_topk (DeepSeek-V3.2: 2048)")

    @staticmethod
    def trains(path: str) -> bool:
        """The warm-up's trainable parameters: the indexers' (`.../self_attn/indexer/...`)."""
        return "/indexer/" in path


def kl_total(kl_LBS: jnp.ndarray, counted_BS: jnp.ndarray) -> jnp.ndarray:
    """The KL summed over the counted queries, averaged over the indexed layers (float32 scalar)."""
    return jnp.sum(kl_LBS * counted_BS[None].astype(jnp.float32)) / kl_LBS.shape[0]


__all__ = ["IndexerTraining", "kl_total"]
