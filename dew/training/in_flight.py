"""`InFlight`: the outputs of dispatched steps, read to the host without stalling the devices.

JAX dispatches a compiled step and returns at once; reading its output waits for it. The loop reads
each output once it is computed (checked without waiting) and waits only when more than `depth`
steps are outstanding, so the host runs a bounded distance ahead: the devices always have the next
step queued, and a stop request or a non-finite step is seen within `depth` steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import jax


def _ready(tree) -> bool:
    return all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(tree) if isinstance(leaf, jax.Array))


class InFlight:
    """Outputs of dispatched computations, oldest first; `read(tag, host_output)` receives each in order."""

    def __init__(self, depth: int, read: Callable[[Any, Any], None]):
        if depth < 0:
            raise ValueError(f"depth is {depth}; it must be at least 0")
        self.depth, self.read = depth, read
        self.queue: deque = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, tag, output) -> None:
        """Queue a dispatched output, read those already computed, and wait while over `depth` remain."""
        self.queue.append((tag, output))
        self.poll()
        while len(self.queue) > self.depth:
            self._read_oldest()

    def poll(self) -> None:
        """Read, in order, the outputs already computed; never waits."""
        while self.queue and _ready(self.queue[0][1]):
            self._read_oldest()

    def drain(self) -> None:
        """Wait for and read every outstanding output."""
        while self.queue:
            self._read_oldest()

    def _read_oldest(self) -> None:
        tag, output = self.queue.popleft()
        self.read(tag, jax.device_get(output))
