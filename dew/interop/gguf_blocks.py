"""A GGUF file's quantized blocks kept as they are stored, for decoding (`load_pretrained(..., quantize="gguf")`).

Loading a GGUF file dequantizes every tensor to float32 (`dew.interop.gguf_files`). With
`quantize="gguf"` the linears, the embedding and an untied head whose tensors are one of the kinds Dew's
blocks kernel multiplies (Q4_0, Q4_1, Q8_0, Q4_K: `dew.kernels.blocks`) keep the file's own bytes
instead: the float kernel leaves the `params` tree and its blocks, `[out, in / n, B]` uint8 (stacked by
layer like the kernels), go into the `quant` collection at the same module path (`kernel_blocks`;
`embed_tokens_blocks` for the embedding, which a tied head reads too); a scanned run's stacks sit whole
in the `quant_stacked` collection instead, with each layer's index in `quant` (`dew.nn.linear`), so the
scan does not copy a layer's blocks out of the stack at every step. The model multiplies them as they
are (`dew.nn.linear.Linear`, `dew.nn.head.Head`), so a batch-1 decoding step streams the file's 4.5-8.5
bits a weight rather than float32's 32. Decoding's products round the activations to two 8-bit layers
and multiply integers (`dew.kernels.blocks`); under the kernel policy `exact` the model computes what the
dequantized float32 model computes, up to the order of float32 roundings. Tensors of other types (float ones, K-quants other than Q4_K) stay float.

The family's GGUF rules say which tensor is which leaf (`tensors.plan`), with llama's query and key
rows put back in transformers' order as whole rows of blocks. The load finds the leaves kept as blocks
first (`stored_blocks`, from the model's shapes) and reads only the other leaves as floats, so a kept
tensor is never dequantized: the load reads the file's bytes once and holds about their size, not the
float32 model's. Like int8 variables, these are for generation only: objectives and `save` refuse them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew.interop import tensors
from dew.interop.export import merge_collections
from dew.nn.linear import EMBED_BLOCKS, KERNEL_BLOCKS, QUANT_COLLECTION
from dew.nn.quantize import linear_paths, mutable_tree, subtree

_EMBEDDING = ("embed_tokens", "embedding")
_HEAD = ("lm_head", "kernel")


Blocks = dict[tuple[str, ...], np.ndarray]
"""The leaves a load keeps as a GGUF file's blocks: a float leaf's path to its blocks `[..., rows, blocks, bytes]`."""


def stored_blocks(model, checkpoint, rules, model_type: str) -> Blocks:
    """Every linear kernel, the embedding and an untied head of `model` that `checkpoint` (a
    `GGUFCheckpoint`, read through `rules`) stores in blocks Dew multiplies, with those blocks; found from
    the model's shapes, before any float leaf is read. Refuses a file with no such tensor, and blocks
    whose scales hold a NaN or an infinity (what the float load refuses in their dequantized values)."""
    shapes = model.variable_shapes()
    leaves = {leaf.path: leaf for leaf in tensors.plan(rules, merge_collections(shapes), model_type).leaves}
    found: Blocks = {}
    for path, transpose in [*(((*module, "kernel"), (1, 0)) for module in [*linear_paths(model, shapes), _HEAD[:1]]),
                            (_EMBEDDING, None)]:
        kept = _leaf_blocks(checkpoint, leaves.get(path), transpose)
        if kept is not None:
            found[path] = kept
    if not found:
        raise ValueError(f"{checkpoint.path.name} stores none of its linears in blocks Dew's kernel multiplies "
                         "(Q4_0, Q4_1, Q8_0, Q4_K): load it without quantize (float32), or with quantize='int8'")
    return found


def without_blocks(variables: Mapping[str, Any], blocks: Blocks) -> dict[str, Any]:
    """`variables` (or their shapes) without the float leaves `blocks` replace."""
    params = mutable_tree(variables["params"])
    for path in blocks:
        _drop(params, path)
    return {**variables, "params": params}


def with_blocks(model, variables: Mapping[str, Any], blocks: Blocks) -> dict[str, Any]:
    """`variables` (the float leaves `without_blocks` leaves) with `blocks` in the `quant` collection at
    their modules' paths, in the model's own form: a scanned run's blocks whole in their collection
    (`dew.nn.stack`)."""
    quant: dict[str, Any] = {}
    for path, kept in blocks.items():
        # the aligned host array as it is (jnp.asarray would compile a program for each new shape, and copy)
        placed = jax.device_put(kept, may_alias=True)
        if path == _EMBEDDING:
            quant[EMBED_BLOCKS] = placed
        else:
            subtree(quant, path[:-1], create=True)[KERNEL_BLOCKS] = placed
    return model.stack_variables({**variables, QUANT_COLLECTION: quant})


def _leaf_blocks(checkpoint, leaf: tensors.LeafPlan | None, transpose) -> np.ndarray | None:
    """The blocks of every tensor a leaf holds, stacked on the leaf's stacked axes, `[..., rows, blocks,
    bytes]` with rows in the leaf's output order; None unless the leaf is whole tensors moved as they are
    (save `transpose`, a float kernel's `[in, out]`, and llama's row permutation) and every one of them is
    stored in blocks."""
    if leaf is None or len(leaf.links) != 1:
        return None
    link = leaf.links[0]
    if link.axis is not None or link.reshape is not None or link.values is not None or link.transpose != transpose:
        return None
    positions = list(leaf.positions())
    stacked = None  # every position's blocks, copied once from the file into one aligned array
    for i, position in enumerate(positions):
        name = link.name.format(**leaf.values(position))
        found = checkpoint.blocks(name)
        if found is None or (stacked is not None and found.shape != stacked.shape[1:]):
            return None
        _check_scales(found, name, checkpoint.path)
        if stacked is None:
            stacked = tensors.aligned_empty((len(positions), *found.shape), found.dtype)
        if link.permute is not None:  # llama.cpp's per-head interleave of the rows, undone row by row
            np.take(found, tensors.interleaved_rows(found.shape[0], link.permute), axis=0, out=stacked[i])
        else:
            stacked[i] = found
    return stacked.reshape(*leaf.shape[:len(leaf.stacked)], *stacked.shape[1:])


# The float16 scales at the start of each kind's block (`dew.kernels.blocks`): d, and Q4_1's m or Q4_K's dmin.
_SCALE_BYTES = {18: 2, 20: 4, 34: 2, 144: 4}


def _check_scales(blocks: np.ndarray, name: str, file) -> None:
    """Refuse blocks `[rows, blocks, bytes]` one of whose float16 scales is a NaN or an infinity: every value
    the block holds would be one, which the float load refuses (`tensors.check_finite`)."""
    scales = np.ascontiguousarray(blocks[..., :_SCALE_BYTES[blocks.shape[-1]]]).view(np.uint16)
    bad = (scales & 0x7C00) == 0x7C00
    if bad.any():
        row, block = (int(i) for i in np.argwhere(bad.any(axis=-1))[0])
        raise ValueError(f"tensor {name!r} in {file.name} holds {int(bad.any(axis=-1).sum()):,} block(s) of its "
                         f"{bad.shape[0] * bad.shape[1]:,} whose scale is NaN or infinite (the first, block {block} of "
                         f"row {row}), so every value they hold is one: the file is damaged, or was written from a run "
                         "that diverged")


def _drop(tree: dict, path: tuple[str, ...]) -> None:
    """Remove the leaf at `path`, and every module left empty by it."""
    parents = [tree]
    for name in path[:-1]:
        parents.append(parents[-1][name])
    del parents[-1][path[-1]]
    for parent, name in zip(reversed(parents[:-1]), reversed(path[:-1])):
        if parent[name]:
            break
        del parent[name]
