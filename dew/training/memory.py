"""A train step that fits the device's memory by itself: the cheapest rematerialization (then micro-batches)
whose compiled step fits, and a clear refusal where nothing does.

A model whose `remat` is "auto" (the default) trains, on a device that reports its memory (a TPU, a GPU), under
the first candidate of `candidates` that fits: the remat policies of `dew.nn.stack.AUTO_LADDER` from the least
recomputation to the most, then "full" with the batch split into 2, 4, ... micro-batches. Each candidate is
estimated before it is compiled (`estimate`: the state, its gradients, and what the loss's backward pass keeps,
traced, not compiled), so a step that cannot fit is not compiled for minutes; the one compiled is then checked
against XLA's own memory analysis (`compiled_bytes`). An explicit policy is kept, and refused the same way when
it does not fit. The CPU reports no limit: there "auto" traces as "none" and nothing is planned.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dew.nn.stack import AUTO_LADDER

# An estimate may take this share of the device's memory before its step is compiled: the rest is left to XLA's
# temporaries (the backward's working set, the optimizer's update), which the estimate does not trace.
ESTIMATE_SHARE = 0.9
MICRO_BATCHES = (2, 4, 8, 16, 32, 64)  # the splits tried, with "full", once no policy fits the whole batch


class DoesNotFit(ValueError):
    """The train step cannot fit the device's memory under what was asked or any candidate: the message names the
    memory it needs, the device's, and what to change."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a compiled train step runs with and how much of the device it takes: `remat` (the policy), `micro`
    (the micro-batches each batch is split into, the caller's accumulation included), `needed` (bytes on one
    device, by XLA's memory analysis) of the device's `available`, `chosen` (whether the planner chose it, or
    the model named it), and `tried`, the candidates before it that did not fit, `(remat, micro, bytes)`."""

    remat: str
    micro: int
    needed: int
    available: int
    device: str
    chosen: bool
    tried: tuple[tuple[str, int, int], ...] = ()

    def line(self) -> str:
        """The plan as one log line."""
        how = "chose" if self.chosen else "kept"
        text = (f"memory: {how} remat {self.remat!r} with {self.micro} micro-batch{'es' if self.micro > 1 else ''}: "
                f"the step takes {gigabytes(self.needed)} of the {self.device}'s {gigabytes(self.available)}")
        if self.tried:
            text += "; " + ", ".join(f"{remat!r} x{micro} needs about {gigabytes(size)}" for remat, micro, size
                                     in self.tried)
        return text

    def record(self) -> dict:
        """The plan as JSON for the run's record."""
        return {**dataclasses.asdict(self), "tried": [list(entry) for entry in self.tried]}


def gigabytes(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def device_memory() -> tuple[int, str] | None:
    """(bytes one device may hold, its kind) where the backend reports a limit (TPUs, GPUs), else None."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return (int(limit), device.device_kind) if limit else None


def candidates(asked: str, rows: int, accumulation: int, shards: int) -> list[tuple[str, int]]:
    """`(remat, micro-batches)` to try in order for a model whose remat is `asked`, a batch of `rows` rows the
    caller splits into `accumulation` micro-batches, over `shards` batch shards: the one asked, or for "auto"
    the ladder, then "full" with the micro-batches split further while each still gives every shard a row."""
    if asked != "auto":
        return [(asked, accumulation)]
    ladder = [(remat, accumulation) for remat in AUTO_LADDER]
    for factor in MICRO_BATCHES:
        micro = accumulation * factor
        if rows % (micro * shards) == 0:
            ladder.append(("full", micro))
    return ladder


def shard_bytes(tree) -> int:
    """Bytes one device holds of the arrays in `tree` (each leaf's shard under its sharding)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if hasattr(leaf, "sharding") else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def residual_bytes(function, differentiated, *others) -> int:
    """Bytes the backward pass of `function(differentiated, *others)` (a scalar, differentiated in its first
    argument) keeps from its forward pass, arguments excluded: its VJP's residuals, traced (not compiled);
    the arguments may be `jax.ShapeDtypeStruct`s."""
    closed = jax.make_jaxpr(lambda x, *rest: jax.vjp(lambda y: function(y, *rest), x)[1])(differentiated, *others)
    inputs = set(closed.jaxpr.invars)
    seen, total = set(), 0
    for var in closed.jaxpr.outvars:
        if hasattr(var, "val") or var in inputs or var in seen:  # a literal, an argument, or counted already
            continue
        seen.add(var)
        total += math.prod(var.aval.shape) * np.dtype(var.aval.dtype).itemsize
    return total


def compiled_bytes(compiled) -> int:
    """Bytes one device holds while the compiled step runs, by XLA's memory analysis: its arguments, outputs not
    aliased to them, temporaries and code."""
    stats = compiled.memory_analysis()
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
               + stats.temp_size_in_bytes + stats.generated_code_size_in_bytes)


def out_of_memory(error: BaseException) -> bool:
    """Whether a compile failed for want of device memory."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def refusal(needed: int, available: int, device: str, what: str) -> DoesNotFit:
    return DoesNotFit(
        f"the train step needs about {gigabytes(needed)} on one device ({what}) and the {device} has "
        f"{gigabytes(available)}: train fewer rows or tokens a step (a smaller batch, more accumulation or a shorter "
        "seq_len), keep parameters in bfloat16 (param_dtype), drop the EMA copy (ema_decay=None), use a smaller model, "
        "or shard it over more devices (MeshSpec's fsdp axis)")


__all__ = ["DoesNotFit", "MemoryPlan", "candidates", "compiled_bytes", "device_memory", "residual_bytes",
           "shard_bytes"]
