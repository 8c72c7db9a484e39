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
rows put back in transformers' order as whole rows of blocks. The load reads the float32 model first
and then swaps the blocks in, so it takes the float load's time and peak memory; the model it returns
holds only the blocks. Like int8 variables, these are for
generation only: objectives and `save` refuse them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from dew.interop import tensors
from dew.nn.linear import EMBED_BLOCKS, KERNEL_BLOCKS, QUANT_COLLECTION
from dew.nn.quantize import is_quantized, linear_paths, mutable_tree, subtree

_EMBEDDING = ("embed_tokens", "embedding")
_HEAD = ("lm_head", "kernel")


def keep_gguf_blocks(model, variables: Mapping[str, Any], checkpoint, rules, model_type: str) -> dict[str, Any]:
    """`variables` (loaded from `checkpoint`, a `GGUFCheckpoint`, through `rules`) with every linear kernel,
    the embedding and an untied head the file stores in blocks Dew multiplies replaced by those blocks
    (see the module). Refuses variables already quantized, and a file with no such tensor."""
    if is_quantized(variables):
        raise ValueError("these variables are already quantized (they hold a 'quant' collection): keep a GGUF "
                         "file's blocks on the float variables loaded from it")
    params = mutable_tree(variables["params"])
    leaves = {leaf.path: leaf for leaf in tensors.plan(rules, params, model_type).leaves}
    quant: dict[str, Any] = {}
    for path in [*linear_paths(model, variables), _HEAD[:1]]:
        kept = _leaf_blocks(checkpoint, leaves.get((*path, "kernel")), transpose=(1, 0))
        if kept is not None:
            _drop(params, (*path, "kernel"))
            subtree(quant, path, create=True)[KERNEL_BLOCKS] = jnp.asarray(kept)
    kept = _leaf_blocks(checkpoint, leaves.get(_EMBEDDING), transpose=None)
    if kept is not None:
        _drop(params, _EMBEDDING)
        quant[EMBED_BLOCKS] = jnp.asarray(kept)
    if not quant:
        raise ValueError(f"{checkpoint.path.name} stores none of its linears in blocks Dew's kernel multiplies "
                         "(Q4_0, Q4_1, Q8_0, Q4_K): load it without quantize (float32), or with quantize='int8'")
    # The model's own form: a scanned run's blocks whole in their collection (`dew.nn.stack`).
    return model.stack_variables({**variables, "params": params, QUANT_COLLECTION: quant})


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
    stacked = []
    for position in leaf.positions():
        found = checkpoint.blocks(link.name.format(**leaf.values(position)))
        if found is None:
            return None
        if link.permute is not None:  # llama.cpp's per-head interleave of the rows, undone row by row
            found = found[tensors.interleaved_rows(found.shape[0], link.permute)]
        stacked.append(found)
    return np.stack(stacked).reshape(*leaf.shape[:len(leaf.stacked)], *stacked[0].shape)


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
