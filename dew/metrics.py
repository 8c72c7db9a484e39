"""Pass-level metrics: each merges per-batch contributions and finalizes once per evaluation pass."""

from __future__ import annotations

import math


class Perplexity:
    """Report exp of the cross entropy per counted target over a whole pass.

    Every batch weighs by its own count of counted targets, so a packed or padded pass whose batches
    differ in size is scored per token, and a batch with no counted target contributes nothing.
    """

    name = "perplexity"

    @staticmethod
    def initial() -> tuple[float, float]:
        return (0.0, 0.0)

    @staticmethod
    def contribution(stats) -> tuple[float, float]:
        """(summed cross entropy, counted targets) of one batch's statistics."""
        return float(stats.ce.total), float(stats.ce.count)

    @staticmethod
    def merge(accumulated: tuple[float, float], contribution: tuple[float, float]) -> tuple[float, float]:
        return accumulated[0] + contribution[0], accumulated[1] + contribution[1]

    @staticmethod
    def finalize(accumulated: tuple[float, float]) -> float:
        total, count = accumulated
        if count == 0:
            raise ValueError("perplexity over a pass with no counted target is undefined")
        return math.exp(total / count)


def perplexity() -> Perplexity:
    return Perplexity()
