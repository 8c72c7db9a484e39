"""The tensor rules engine: a family's checkpoint tensors as Dew parameters, and back.

A family lists `Rule`s. A rule ties Dew leaves (slash paths into the parameter tree, where `layers/`
stands for any layer scope, at the top or nested (a tower's `encoder/layers/`): a lone layer `layers_N`,
or a scanned run `layers_{a}to{b}` whose leaves are stacked on a leading axis) to checkpoint tensors
(names with `{layer}` and other placeholders), through seven kinds of step:

- rename: the Dew path and the tensor name;
- transpose: the Dew leaf holds the tensor's axes in the order `transpose` gives (`(1, 0)`: a
  transformers `[out, in]` weight is Dew's `[in, out]` kernel);
- stack: every placeholder indexes a leading axis of the Dew leaf, so one leaf holds many tensors:
  `{layer}` the run's layer axis (a lone layer binds it without an axis), and the names in `stack`
  the axes after it (`("expert",)`: `mlp.experts.{expert}.*` as one `[E, ...]` leaf);
- split and fuse: one tensor cut along `axis` into several Dew leaves, or several tensors joined
  along `axis` into one leaf (`sizes`: each tensor's extent; a tensor named more than once holds
  those parts in turn); with `groups`, each tensor holds its parts interleaved in that many equal
  groups (Qwen3-Next's projections, per key head: group g holds the g-th share of every part);
- permute: rows interleaved per head, as llama.cpp stores a llama model's queries and keys
  (`permute`: the number of heads);
- reshape: the tensor holds the leaf's item in another shape, row-major (`reshape`: the tensor's
  shape; llama.cpp's Mamba2 convolution `[C, K]` for transformers' `[C, 1, K]`); it moves whole;
- map values: the tensor holds a function of the leaf's values, elementwise (`values`, a `ValueMap`:
  llama.cpp stores Mamba2's `A = -exp(A_log)` where the model keeps `A_log`).

`plan` resolves rules against a tree of arrays or shapes, in either form, into one `LeafPlan` per
leaf and every tensor's shape. `read_region` builds any region of a leaf from a reader (`names`,
`shape`, `dtype`, `read(name, index)`), asking only for the tensors, layers and rows inside it;
`export_tensors` gives each tensor as a builder that cuts it out of the leaves when called.
`check_finite` refuses a tensor holding a NaN or an infinity as it is read.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = "layers"  # the scope placeholder of a rule's Dew path
# Each stored float type as the unsigned integer of its width, and its exponent bits: all of them are set in
# a NaN or an infinity and in no finite value.
_EXPONENT_BITS = {np.dtype(np.float32): (np.uint32, 0x7F800000), np.dtype(np.float16): (np.uint16, 0x7C00),
                  np.dtype(jnp.bfloat16): (np.uint16, 0x7F80)}
_FINITE_BLOCK = 1 << 18  # elements tested at once, so the test's scratch stays in cache
_RUN = re.compile(r"layers_(\d+)to(\d+)")
_LONE = re.compile(r"layers_(\d+)")


@dataclasses.dataclass(frozen=True)
class ValueMap:
    """Stored values as an elementwise function of a Dew leaf's: `write` (leaf to stored) and its inverse
    `read`, numpy functions of float64 arrays, so each direction rounds once, to the stored dtype on the
    way out and to the leaf's on the way in; a round trip is exact only where that rounding loses nothing
    (the caller's map says where). `read` takes the stored values `domain` describes (`accepts` tests
    them); a file holding others is refused. `name` says the map in the checkpoint's own terms."""

    name: str
    read: Callable[[np.ndarray], np.ndarray]
    write: Callable[[np.ndarray], np.ndarray]
    accepts: Callable[[np.ndarray], np.ndarray]
    domain: str

    def to_dew(self, stored: np.ndarray, tensor: str) -> np.ndarray:
        """The leaf's values (float64) for a tensor's `stored` values, refusing values outside the domain."""
        stored = np.asarray(stored, np.float64)
        outside = ~self.accepts(stored)
        if outside.any():
            first = int(np.argmax(outside.reshape(-1)))
            raise ValueError(f"tensor {tensor!r} holds {float(stored.reshape(-1)[first])} at position {first:,} "
                             f"({int(outside.sum()):,} of its {stored.size:,} values are not {self.domain}): it stores "
                             f"{self.name}, so every value must be {self.domain}; the file is damaged or was not "
                             "written that way")
        return self.read(stored)

    def to_stored(self, values: np.ndarray, dtype) -> np.ndarray:
        """The tensor's values, in `dtype`, for a leaf's `values`."""
        return np.asarray(self.write(np.asarray(values, np.float64)), dtype)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Dew leaves `dew` and checkpoint tensors `tensor` that hold the same numbers (see the module).

    One side names one entry; when the other names several, the one is cut along `axis` of the Dew
    leaf's item (its axes after the stacked ones): a split (several Dew leaves, sized by their own
    shapes) or a fuse (several tensors, sized by `sizes`, in order). In a fuse, a tensor named several
    times holds those parts one after another, and with `groups` every tensor holds its parts
    interleaved: `groups` blocks, block g the g-th `1 / groups` of each of its parts in order (the Dew
    leaf holds each part whole). With `reshape` (the tensor's shape) or `values` (a `ValueMap`) the rule
    ties one tensor to one leaf and moves it whole. With `infinities` the tensor may hold infinities (a
    clipping bound, whose infinity means none); a NaN is refused as in every tensor.
    """

    dew: str | tuple[str, ...]
    tensor: str | tuple[str, ...]
    transpose: tuple[int, ...] | None = None
    stack: tuple[str, ...] = ()
    axis: int | None = None
    sizes: tuple[int, ...] | None = None
    permute: int | None = None
    groups: int = 1
    reshape: tuple[int, ...] | None = None
    values: ValueMap | None = None
    infinities: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("dew", (self.dew,) if isinstance(self.dew, str) else tuple(self.dew))
        set_("tensor", (self.tensor,) if isinstance(self.tensor, str) else tuple(self.tensor))
        if len(self.dew) > 1 and len(self.tensor) > 1:
            raise ValueError(f"rule {self.dew} <-> {self.tensor}: one side must name a single entry")
        if (len(self.dew) > 1 or len(self.tensor) > 1) and self.axis is None:
            raise ValueError(f"rule {self.dew} <-> {self.tensor} splits or fuses: give the axis it cuts")
        if len(self.tensor) > 1 and (self.sizes is None or len(self.sizes) != len(self.tensor)):
            raise ValueError(f"rule {self.dew} <-> {self.tensor} fuses {len(self.tensor)} tensors: give one size each")
        if self.reshape is not None:
            set_("reshape", tuple(self.reshape))
        if (self.reshape is not None or self.values is not None) and (
                len(self.dew) > 1 or len(self.tensor) > 1 or self.transpose is not None or self.permute is not None):
            raise ValueError(f"rule {self.dew} <-> {self.tensor} reshapes or maps values, which moves one tensor "
                             "whole: it cannot also split, fuse, transpose or permute; write one rule per tensor")

    def renamed(self, names: Mapping[str, str], permute: Mapping[str, int] | None = None) -> "Rule":
        """This rule over other tensor names (a GGUF file's), with rows permuted per head where
        `permute` gives a tensor (by its old name) a head count."""
        missing = [name for name in self.tensor if name not in names]
        if missing:
            raise KeyError(f"no name given for {missing}")
        heads = {(permute or {})[name] for name in self.tensor if name in (permute or {})}
        return dataclasses.replace(self, tensor=tuple(names[name] for name in self.tensor),
                                   permute=heads.pop() if heads else self.permute)


@dataclasses.dataclass(frozen=True)
class Link:
    """Where one tensor sits in a Dew leaf's item: along `axis` (None: the whole item), the item's
    `[dew_start, dew_start + size)` is the tensor's `[tensor_start, tensor_start + size)` of
    `extent`, once the tensor's axes are put in `transpose` order and its rows un-permuted; or, with
    `reshape` (the tensor's shape), the whole item is the whole tensor reshaped; `values` maps values."""

    name: str
    transpose: tuple[int, ...] | None
    permute: int | None
    axis: int | None = None
    dew_start: int = 0
    tensor_start: int = 0
    size: int = 0
    extent: int = 0
    reshape: tuple[int, ...] | None = None
    values: ValueMap | None = None
    infinities: bool = False

    def tensor_shape(self, item_shape: Sequence[int]) -> tuple[int, ...]:
        if self.reshape is not None:
            return self.reshape
        shape = list(item_shape)
        if self.axis is not None:
            shape[self.axis] = self.extent
        return _untranspose_shape(shape, self.transpose)

    def regions(self, item_bounds: Sequence[tuple[int, int]]):
        """The part of the item region `item_bounds` this tensor holds, in item coordinates, and the
        same part in the tensor's own axes; None when they do not meet. A reshaped tensor is read whole."""
        if self.reshape is not None:
            return list(item_bounds), [(0, n) for n in self.reshape]
        dew = list(item_bounds)
        if self.axis is not None:
            low, high = dew[self.axis]
            low, high = max(low, self.dew_start), min(high, self.dew_start + self.size)
            if low >= high:
                return None
            dew[self.axis] = (low, high)
        tensor = list(dew)
        if self.axis is not None:
            shift = self.tensor_start - self.dew_start
            tensor[self.axis] = (dew[self.axis][0] + shift, dew[self.axis][1] + shift)
        return dew, _untranspose_shape(tensor, self.transpose)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One Dew leaf: its `path`, `shape` and `dtype`, the stacked axes it carries first (`stacked`:
    each a placeholder and the values it takes along the axis), the placeholders bound without an
    axis (`fixed`), and its `links` to tensors."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: Any
    stacked: tuple[tuple[str, tuple[int, ...]], ...]
    fixed: Mapping[str, int]
    links: tuple[Link, ...]

    @property
    def item_shape(self) -> tuple[int, ...]:
        return self.shape[len(self.stacked):]

    def values(self, position: Sequence[int]) -> dict[str, int]:
        """The placeholders' values at one position along the stacked axes."""
        return {**self.fixed, **{name: values[p] for (name, values), p in zip(self.stacked, position)}}

    def positions(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(len(values)) for _, values in self.stacked))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rules resolved against one tree: a `LeafPlan` per leaf, and every tensor's shape in the
    checkpoint (`tensors`, name to shape, in checkpoint order: layer by layer)."""

    leaves: tuple[LeafPlan, ...]
    tensors: Mapping[str, tuple[int, ...]]


def plan(rules: Sequence[Rule], params: Mapping, family: str = "this family") -> Plan:
    """Resolve `rules` against `params` (arrays or `ShapeDtypeStruct`s, runs stacked or not).

    A leaf no rule names, or a split or fused group missing a member, is refused naming `family`.
    """
    by_path = {path: (rule, index) for rule in rules for index, path in enumerate(rule.dew)}
    # the leaves each rule ties together within one layer scope: (rule, scope) -> {index in rule.dew: leaf}
    groups: dict[tuple, dict[int, tuple]] = {}
    for path, leaf in _flat(params):
        scope, stacked, fixed, key = _scope(path)
        if key not in by_path:
            raise ValueError(f"{family} has no tensor rule for the Dew parameter {'/'.join(path)} ({key})")
        rule, index = by_path[key]
        extra = np.shape(leaf)[len(stacked):len(stacked) + len(rule.stack)]
        stacked = stacked + tuple((name, tuple(range(n))) for name, n in zip(rule.stack, extra))
        groups.setdefault((id(rule), scope), {})[index] = (rule, path, leaf, stacked, fixed)
    leaves, tensors = [], {}
    for members in groups.values():
        rule = next(iter(members.values()))[0]
        absent = [rule.dew[i] for i in range(len(rule.dew)) if i not in members]
        if absent:
            raise ValueError(f"{family}'s rule for {rule.tensor} needs {absent} beside "
                             f"{[rule.dew[i] for i in members]}")
        for index, (_, path, leaf, stacked, fixed) in sorted(members.items()):
            item = tuple(np.shape(leaf)[len(stacked):])
            links = _links(rule, index, [np.shape(m[2])[len(m[3]):] for _, m in sorted(members.items())])
            resolved = LeafPlan(tuple(path), tuple(np.shape(leaf)), jnp.dtype(leaf.dtype), stacked, fixed, links)
            leaves.append(resolved)
            for position in resolved.positions():
                values = resolved.values(position)
                for link in links:
                    tensors[link.name.format(**values)] = link.tensor_shape(item)
    order = sorted(tensors, key=_natural)
    return Plan(tuple(leaves), {name: tensors[name] for name in order})


def _links(rule: Rule, index: int, items: list[tuple[int, ...]]) -> tuple[Link, ...]:
    """The links of the rule's `index`-th Dew leaf, given every member leaf's item shape."""
    base = dict(transpose=rule.transpose, permute=rule.permute, infinities=rule.infinities)
    if len(rule.dew) == 1 and len(rule.tensor) == 1:
        if rule.reshape is not None and np.prod(rule.reshape) != np.prod(items[0]):
            raise ValueError(f"rule {rule.dew} <-> {rule.tensor}: the tensor's shape {rule.reshape} does not hold the "
                             f"leaf's {tuple(items[0])} ({int(np.prod(items[0]))} values): give a shape of as many")
        return (Link(rule.tensor[0], **base, reshape=rule.reshape, values=rule.values),)
    axis = rule.axis
    if len(rule.dew) > 1:  # split: the one tensor holds every leaf, in order
        sizes = [item[axis] for item in items]
        return (Link(rule.tensor[0], **base, axis=axis, tensor_start=sum(sizes[:index]), size=sizes[index],
                     extent=sum(sizes)),)
    if sum(rule.sizes) != items[0][axis]:
        raise ValueError(f"rule {rule.dew} <-> {rule.tensor}: sizes {rule.sizes} do not add up to the leaf's "
                         f"{items[0][axis]} along axis {axis}")
    G = rule.groups
    if any(size % G for size in rule.sizes):
        raise ValueError(f"rule {rule.dew} <-> {rule.tensor}: sizes {rule.sizes} do not split into {G} groups")
    starts = np.cumsum((0, *rule.sizes[:-1]))
    links = []
    for part, (name, start, size) in enumerate(zip(rule.tensor, starts, rule.sizes)):
        own = [i for i, other in enumerate(rule.tensor) if other == name]  # the tensor's parts, in order
        block = sum(rule.sizes[i] for i in own) // G
        before = sum(rule.sizes[i] for i in own if i < part) // G
        links += [Link(name, **base, axis=axis, dew_start=int(start) + g * (size // G),
                       tensor_start=g * block + before, size=size // G, extent=block * G) for g in range(G)]
    return tuple(links)


def _scope(path: tuple[str, ...]):
    """(scope, stacked axes, fixed placeholders, rule key) of a leaf path. Its first layer scope, at any
    depth (a decoder's `layers_N`, a vision tower's `encoder/layers_N`), is `layers` in the rule key."""
    for depth, name in enumerate(path):
        run, lone = _RUN.fullmatch(name), _LONE.fullmatch(name)
        if run or lone:
            scope, key = "/".join(path[:depth + 1]), "/".join((*path[:depth], LAYERS, *path[depth + 1:]))
            if run:
                return scope, (("layer", tuple(range(int(run[1]), int(run[2]) + 1))),), {}, key
            return scope, (), {"layer": int(lone[1])}, key
    return "", (), {}, "/".join(path)


def read_region(reader, leaf: LeafPlan, index: tuple[slice, ...] | None, dtype,
                advance: Callable[[int], None] = lambda nbytes: None) -> np.ndarray:
    """The region `index` (slices over `leaf.shape`; None for all of it) of a Dew leaf, as a host
    array of `dtype` (64-byte aligned), read from `reader` one tensor part at a time: only the
    layers, experts and rows inside the region are read, each checked to be finite (`check_finite`).
    `advance` hears the bytes of each read."""
    index = tuple(slice(None) for _ in leaf.shape) if index is None else tuple(index)
    bounds = [s.indices(n)[:2] for s, n in zip(index, leaf.shape)]
    k = len(leaf.stacked)
    region = aligned_empty([high - low for low, high in bounds], dtype)
    item_bounds = bounds[k:]
    for position in itertools.product(*(range(low, high) for low, high in bounds[:k])):
        # with Ellipsis a scalar item (a stacked leaf of per-layer scalars) is a view too, not a copy
        target = region[(*(p - low for p, (low, _) in zip(position, bounds[:k])), Ellipsis)]
        values = leaf.values(position)
        for link in leaf.links:
            parts = link.regions(item_bounds)
            if parts is None:
                continue
            dew, tensor = parts
            name = link.name.format(**values)
            array = _read(reader, name, tensor, link.permute)
            check_finite(array, name, reader.location.get(name), infinities=link.infinities)
            advance(array.nbytes)
            if link.values is not None:
                array = link.values.to_dew(array, name)
            if link.transpose is not None:
                array = array.transpose(link.transpose)
            if link.reshape is not None:
                array = array.reshape(leaf.item_shape)[tuple(slice(low, high) for low, high in dew)]
            target[tuple(slice(low - start, high - start) for (low, high), (start, _) in zip(dew, item_bounds))] = array
            del array  # one tensor part on the host at a time, beside the region
    return region


def check_finite(array: np.ndarray, name: str, file=None, infinities: bool = False) -> None:
    """Refuse a tensor (or a part of it) that holds a NaN or an infinity, naming it and its `file`; with
    `infinities`, only a NaN (the tensor is a bound, for which infinity means none).

    Tests each value's exponent bits through an integer view, a block at a time: one pass, at the speed
    of a copy, where np.isfinite runs a scalar loop on 16-bit floats."""
    if array.dtype not in _EXPONENT_BITS:
        return
    if infinities:  # bounds are a few values: a plain test will do
        if np.isnan(array.astype(np.float32)).any():
            where = "" if file is None else f" in {file.name}"
            raise ValueError(f"tensor {name!r}{where} holds a NaN: it is a bound, a number or an infinity; the "
                             "checkpoint is damaged")
        return
    unsigned, exponent = _EXPONENT_BITS[array.dtype]
    flat = array.reshape(-1).view(unsigned)
    scratch = np.empty(min(_FINITE_BLOCK, flat.size), unsigned)
    for start in range(0, flat.size, _FINITE_BLOCK):
        block = scratch[:min(_FINITE_BLOCK, flat.size - start)]
        np.bitwise_and(flat[start:start + block.size], exponent, out=block)
        if block.max(initial=0) == exponent:
            first = start + int(np.argmax(block == exponent))
            count = int(np.count_nonzero(np.bitwise_and(flat, exponent) == exponent))
            where = "" if file is None else f" in {file.name}"
            raise ValueError(f"tensor {name!r}{where} holds {count:,} NaN or infinite value(s) among the {flat.size:,} "
                             f"read (the first, {array.reshape(-1)[first]}, at position {first:,}): the checkpoint is "
                             "damaged or was saved from a run that diverged, and would generate nothing but garbage; "
                             "load one saved before that")


def aligned_empty(shape: Sequence[int], dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised host array whose data starts on an `alignment`-byte boundary: XLA's CPU backend
    takes such a buffer as it is (`jax.device_put(..., may_alias=True)`), where it copies one numpy
    allocated at its usual 16 bytes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _read(reader, name: str, bounds: Sequence[tuple[int, int]], heads: int | None) -> np.ndarray:
    """One region of a tensor in transformers' row order; with `heads`, the stored rows are
    llama.cpp's per-head interleave, so the rows asked for are gathered from where it keeps them."""
    if heads is None:
        return reader.read(name, tuple(slice(low, high) for low, high in bounds))
    (low, high), rest = bounds[0], tuple(slice(a, b) for a, b in bounds[1:])
    rows = interleaved_rows(reader.shape(name)[0], heads)[low:high]
    first = int(rows.min())
    covering = reader.read(name, (slice(first, int(rows.max()) + 1), *rest))
    return covering[rows - first]


def interleaved_rows(count: int, heads: int) -> np.ndarray:
    """For each row in transformers' order, the row llama.cpp stores it at: within each head the two
    rotated halves are interleaved (row `i` of the first half at `2i`, of the second at `2i + 1`)."""
    return np.arange(count).reshape(heads, count // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def export_tensors(plan_: Plan, params: Mapping) -> list[tuple[str, int, Callable[[], np.ndarray]]]:
    """`(name, nbytes, build)` for every tensor of the plan, in checkpoint order; `build()` cuts the
    tensor out of `params` (device or host arrays, the tree the plan was made from) when called:
    one layer's slice of a stacked leaf, moved to the host and put back in the tensor's axes."""
    pieces: dict[str, list] = {}
    for leaf in plan_.leaves:
        array = _leaf(params, leaf.path)
        for position in leaf.positions():
            values = leaf.values(position)
            for link in leaf.links:
                pieces.setdefault(link.name.format(**values), []).append((leaf, array, position, link))
    exported = []
    for name, shape in plan_.tensors.items():
        dtype = pieces[name][0][0].dtype
        exported.append((name, int(np.prod(shape)) * dtype.itemsize, _builder(shape, dtype, pieces[name])))
    return exported


def _builder(shape, dtype, pieces) -> Callable[[], np.ndarray]:
    def build() -> np.ndarray:
        tensor, heads = None, None
        for _, array, position, link in pieces:
            item = _item(array, position)
            part = item if link.axis is None else np.take(item, range(link.dew_start, link.dew_start + link.size),
                                                           axis=link.axis)
            part = part if link.transpose is None else part.transpose(np.argsort(link.transpose))
            part = part if link.values is None else link.values.to_stored(part, dtype)
            part = part if link.reshape is None else part.reshape(link.reshape)
            if len(pieces) == 1 and link.axis is None and link.permute is None:
                return part  # a view: the writer makes it contiguous as it writes
            if tensor is None:
                tensor = np.empty(shape, dtype)
            start = [0] * len(shape)
            if link.axis is not None:
                start[_untranspose_axis(link.axis, link.transpose)] = link.tensor_start
            tensor[tuple(slice(s, s + n) for s, n in zip(start, part.shape))] = part
            heads = link.permute
        if heads is None:
            return tensor
        stored = np.empty_like(tensor)  # back to llama.cpp's row order
        stored[interleaved_rows(shape[0], heads)] = tensor
        return stored

    return build


@jax.jit
def _take(array, position):
    return array[tuple(position)]


def _item(array, position: tuple[int, ...]) -> np.ndarray:
    """The item at `position` along a leaf's stacked axes, on the host (sliced on its device first,
    so a stacked leaf is never brought over whole)."""
    if not position:
        return np.asarray(jax.device_get(array))
    if isinstance(array, np.ndarray):
        return array[position]
    return np.asarray(jax.device_get(_take(array, jnp.asarray(position, jnp.int32))))


def _untranspose_shape(values: Sequence, transpose: tuple[int, ...] | None) -> tuple:
    """A Dew item's per-axis values (sizes, bounds) in the tensor's own axis order."""
    if transpose is None:
        return tuple(values)
    out = [None] * len(values)
    for dew_axis, tensor_axis in enumerate(transpose):
        out[tensor_axis] = values[dew_axis]
    return tuple(out)


def _untranspose_axis(axis: int, transpose: tuple[int, ...] | None) -> int:
    return axis if transpose is None else transpose[axis]


def _flat(tree, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flat(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _leaf(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _natural(name: str) -> list:
    """Sort key that puts `layers.10` after `layers.9`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
