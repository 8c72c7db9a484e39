"""8-bit weights for generation: every linear kernel, the embedding and the output head held as int8.

Decoding one token reads every weight once and does little arithmetic with it, so on a CPU its speed
is the speed of streaming the weights from memory. Held as int8 with one float32 scale per output
channel and group of `GROUP` consecutive inputs (symmetric, `scale = max|w| / 127` over the group),
the weights take a byte each and the scales 4 bytes per group, about a quarter of float32's bytes.
Groups rather than one scale per channel keep an outlier weight from coarsening its whole column, so
greedy decoding and perplexity stay closer to float32's (docs/performance.md, "int8 in Dew's own
kernel"). The products (`dew.kernels.int8`) widen the int8 values in registers and scale each group's
partial sum.

`quantize_int8(model, variables)` returns the variables with int8 kernels and a `quant` collection of
scales beside them, at the same module paths, with the kernel's shape but its input axis holding the
groups (`quant/layers_0to29/self_attn/q_proj/kernel_scale` `[layers, G, out]`, stacked by layer like
the kernels; `quant/embed_tokens_scale` `[vocab, G]`; `quant/lm_head/kernel_scale` `[G, vocab]` when
the head is untied). `model.apply` and `generate` take them as they are; the linears, the embedding and
the head read the scales where they find them.

What stays float: norms, biases, a router's kernel (its scores choose experts, and float32 routing is
part of the mixture's contract) and stacked experts (`dew.nn.grouped` has no int8 product yet).
The variables are for generation only: objectives refuse them (their tree is not the model's
parameter tree), and `Pretrained.save` refuses them by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew import compilation_cache
from dew.kernels.int8 import group_size
from dew.nn.linear import KERNEL_SCALE, QUANT_COLLECTION, Linear
from dew.nn.stack import lift_kernels, stacked_kernels

EMBED_SCALE = "embed_tokens_scale"
# What `quantize=` names where a model is loaded: int8 made here, or a GGUF file's own blocks kept as stored
# (dew.interop.gguf_blocks).
WEIGHT_FORMATS = ("int8", "gguf")
_INT8_MAX = 127
# Inputs per scale, at most: common widths (SmolLM2's 576 and 1536) split into groups of exactly 64,
# whole cache lines and whole vector steps for the kernel; the scales add 4 bytes per 64 weights. Larger
# groups, and one scale per channel, move perplexity further from float32's (docs/performance.md).
GROUP = 64


def int8_groups(weight, axis: int, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """`(q, scale)` with `q` int8 and `q * scale ~ weight`: along `axis` (the one reduced: a kernel's
    input axis, an embedding's width) of n entries, `G = ceil(n / group)` groups of `ceil(n / G)` entries
    (the last possibly shorter) each get one scale per slice along the other axes; `scale` is `weight`'s
    shape with `G` at `axis`. An all-zero group gets scale 1, so nothing divides by zero."""
    weight = np.moveaxis(np.asarray(jax.device_get(weight), np.float32), axis, -1)
    inputs = weight.shape[-1]
    groups = group_size(inputs, group)
    size = group_size(inputs, groups)
    padded = np.zeros((*weight.shape[:-1], groups * size), np.float32)
    padded[..., :inputs] = weight
    grouped = padded.reshape(*weight.shape[:-1], groups, size)
    peak = np.max(np.abs(grouped), axis=-1, keepdims=True)
    scale = np.where(peak > 0, peak / _INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(grouped / scale), -_INT8_MAX, _INT8_MAX).astype(np.int8)
    q = q.reshape(padded.shape)[..., :inputs]
    return np.moveaxis(q, -1, axis), np.moveaxis(scale[..., 0], -1, axis)


def is_quantized(variables: Mapping[str, Any]) -> bool:
    """Whether `variables` hold int8 weights made by `quantize_int8`."""
    return QUANT_COLLECTION in variables


def linear_paths(model, variables) -> list[tuple[str, ...]]:
    """The module path of every `Linear` that `model` calls, in the tree of `variables` (scanned runs
    name their stacked module once). Found by tracing one abstract forward, so the model's own
    structure says what is a linear, not a table of names. A load asks more than once (bfloat16 bits,
    then the stacked kernels), so the trace is kept per model and tree (`_LINEAR_PATHS`), and a decoder's
    between processes too (`dew.compilation_cache.kept_trace`)."""
    leaves, structure = jax.tree_util.tree_flatten(variables)
    # which linears run depends on the tree and its shapes, not on the leaves' dtypes (bfloat16_bits
    # changes only those); an unhashable model (a config holding an unhashable value) is traced each time
    key = (model, structure, tuple(np.shape(leaf) for leaf in leaves))
    try:
        hash(key)
    except TypeError:
        return _traced_linear_paths(model, variables)
    if key not in _LINEAR_PATHS:
        if len(_LINEAR_PATHS) >= _KEPT_TRACES:
            del _LINEAR_PATHS[next(iter(_LINEAR_PATHS))]
        trace = lambda: _traced_linear_paths(model, variables)  # noqa: E731
        description = compilation_cache.described(model)
        if description is not None:  # a decoder's are kept between processes too, beside JAX's cache
            shapes = "\n".join(f"{np.shape(leaf)}" for leaf in leaves)
            found = compilation_cache.kept_trace("linears", f"{description}\n{structure}\n{shapes}", trace,
                                                 lambda paths: [list(path) for path in paths],
                                                 lambda paths: [tuple(path) for path in paths])
        else:
            found = trace()
        _LINEAR_PATHS[key] = tuple(found)
    return list(_LINEAR_PATHS[key])


_LINEAR_PATHS: dict[tuple, tuple[tuple[str, ...], ...]] = {}
_KEPT_TRACES = 8


def _traced_linear_paths(model, variables) -> list[tuple[str, ...]]:
    seen: dict[tuple[str, ...], None] = {}

    def record(call, args, kwargs, context):
        if isinstance(context.module, Linear) and context.method_name == "__call__":
            seen[tuple(context.module.path)] = None
        return call(*args, **kwargs)

    tokens = jnp.zeros((1, 1), jnp.int32)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda v: model.apply(v, tokens, head=False), variables)
    return list(seen)


def quantize_int8(model, variables: Mapping[str, Any], group: int = GROUP) -> dict[str, Any]:
    """`variables` (a `model.init` tree, either layer form) with int8 linears, embedding and head, one
    scale per output and group of at most `group` inputs (`int8_groups`).

    Refuses variables that are already quantized. The result is a new tree; `variables` is unchanged.
    """
    if is_quantized(variables):
        raise ValueError("these variables are already int8 (they hold a 'quant' collection): quantize float "
                         "weights once")
    if model.config.dtype == jnp.float16:
        raise NotImplementedError("int8 weights with float16 compute are not built: use float32 or bfloat16")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group={group!r} is not a number of inputs per scale: use a positive int (default {GROUP})")
    variables = jax.tree_util.tree_map(lambda x: x, dict(variables))  # a copy of the containers
    params = mutable_tree(variables["params"])
    quant: dict[str, Any] = {}
    for path in linear_paths(model, variables):
        module = subtree(params, path)
        q, scale = int8_groups(module["kernel"], axis=-2, group=group)  # [.., in, out]: scales [.., G, out]
        module["kernel"] = jnp.asarray(q)
        subtree(quant, path, create=True)[KERNEL_SCALE] = jnp.asarray(scale)
    table = params["embed_tokens"]
    q, scale = int8_groups(table["embedding"], axis=-1, group=group)  # [V, E]: scales [V, G] (a tied head's columns)
    table["embedding"] = jnp.asarray(q)
    quant[EMBED_SCALE] = jnp.asarray(scale)
    if "lm_head" in params:
        q, scale = int8_groups(params["lm_head"]["kernel"], axis=-2, group=group)
        params["lm_head"]["kernel"] = jnp.asarray(q)
        quant["lm_head"] = {KERNEL_SCALE: jnp.asarray(scale)}
    variables["params"] = params
    variables[QUANT_COLLECTION] = quant
    return variables


def bfloat16_bits(model, variables: Mapping[str, Any]) -> dict[str, Any]:
    """`variables` with every bfloat16 linear kernel held as its uint16 bits, which `Linear` reads back as
    bfloat16: the same values and bytes, for generation on a CPU. XLA's CPU backend widens a bfloat16 slice
    to float32 over its whole operand, so a scanned run's stacked kernels would be widened at every call
    (and read back) before each layer takes its own; a uint16 stack is sliced as it is. Like int8 weights,
    the result is for `model.apply` and generation, not for training or saving."""
    variables = jax.tree_util.tree_map(lambda x: x, dict(variables))  # a copy of the containers
    params = mutable_tree(variables["params"])
    for path in linear_paths(model, variables):
        module = params
        for name in path:  # a linear kept in a GGUF file's blocks holds no params
            module = module.get(name, {})
        if "kernel" in module and module["kernel"].dtype == jnp.bfloat16:
            module["kernel"] = uint16_bits(module["kernel"])
    variables["params"] = params
    return variables


def uint16_bits(kernel: jax.Array) -> jax.Array:
    """A bfloat16 array's bits as uint16. An array on one CPU device is the same memory viewed as uint16
    (XLA's bitcast would write a copy of every weight); elsewhere, XLA's bitcast."""
    if isinstance(kernel, jax.Array) and len(kernel.sharding.device_set) == 1 \
            and next(iter(kernel.sharding.device_set)).platform == "cpu":
        return jax.device_put(np.asarray(kernel).view(np.uint16), kernel.sharding, may_alias=True)
    return jax.lax.bitcast_convert_type(kernel, jnp.uint16)


def stacked_in_place(model, variables: Mapping[str, Any]) -> dict[str, Any]:
    """`variables` (in `model`'s own form) with each scanned run's linear kernels (float or int8) held whole for
    generation (`dew.nn.stack.lift_kernels`): a decode step's product reads its layer's weight in the
    stack where XLA would copy it out first, every step. The same values; under the kernel policy `xla`,
    and for products of more rows than a decode step's, each layer's weight is indexed out as before.
    Like `bfloat16_bits`, the result is for `model.apply` and generation, not for training or saving."""
    if not stacked_kernels(variables):  # nothing to move: spare tracing the model for its linears
        return dict(variables)
    return lift_kernels(variables, linear_paths(model, variables))


def mutable_tree(tree):
    """A copy of a tree's mappings as dicts (the leaves shared), to edit in place."""
    return {key: mutable_tree(value) for key, value in tree.items()} if isinstance(tree, Mapping) else tree


def subtree(tree: dict, path: tuple[str, ...], create: bool = False) -> dict:
    """The mapping at `path` in `tree`; with `create`, made (empty) where it is missing."""
    for name in path:
        if create:
            tree = tree.setdefault(name, {})
        else:
            tree = tree[name]
    return tree
