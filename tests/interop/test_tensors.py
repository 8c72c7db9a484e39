"""The tensor rules engine on synthetic tensors: each kind of rule in and back out, bit for bit, and
region reads that ask only for the layers and rows they need."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import tensors
from dew.interop.tensors import Rule, ValueMap
from tests.tolerances import assert_within

F32 = np.float32


class ArrayReader:
    """Tensors held in a dict, read the way the checkpoint readers are; records each region asked for."""

    def __init__(self, arrays):
        self.arrays, self.asked = arrays, []
        self.location = {name: Path("arrays") for name in arrays}

    def names(self):
        return list(self.arrays)

    def shape(self, name):
        return self.arrays[name].shape

    def dtype(self, name):
        return "F32"

    def read(self, name, index=()):
        self.asked.append((name, index))
        return np.array(self.arrays[name][index])


def _shapes(tree):
    return jax.tree_util.tree_map(lambda shape: jax.ShapeDtypeStruct(shape, F32), tree,
                                  is_leaf=lambda x: isinstance(x, tuple))


def _nest(leaves: dict) -> dict:
    tree: dict = {}
    for path, value in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _round_trip(rules, shapes, seed=0):
    """Random checkpoint tensors for `rules` over a tree of `shapes`, read into Dew leaves and exported
    back: the export must give every tensor bit for bit. Returns (Dew params, the tensors)."""
    plan = tensors.plan(rules, _shapes(shapes))
    rng = np.random.default_rng(seed)
    stored = {name: rng.normal(size=shape).astype(F32) for name, shape in plan.tensors.items()}
    params = _nest({leaf.path: tensors.read_region(ArrayReader(stored), leaf, None, F32) for leaf in plan.leaves})
    for as_device in (False, True):  # host leaves, and device ones sliced on their device
        source = jax.tree_util.tree_map(jnp.asarray, params) if as_device else params
        exported = {name: np.ascontiguousarray(build()) for name, _, build in tensors.export_tensors(plan, source)}
        assert list(exported) == list(stored)
        for name in stored:
            np.testing.assert_array_equal(exported[name], stored[name], err_msg=name)
    return params, stored


def test_rename_and_transpose():
    rules = (Rule("embed/embedding", "model.embed.weight"), Rule("head/kernel", "lm_head.weight", transpose=(1, 0)))
    params, stored = _round_trip(rules, {"embed": {"embedding": (7, 3)}, "head": {"kernel": (3, 7)}})
    np.testing.assert_array_equal(params["embed"]["embedding"], stored["model.embed.weight"])
    np.testing.assert_array_equal(params["head"]["kernel"], stored["lm_head.weight"].T)


def test_stack_over_layers_and_over_experts():
    """`{layer}` stacks a run's layers, `stack=("expert",)` an axis that is not the layers'; a lone layer
    binds `{layer}` without an axis."""
    rules = (Rule("layers/mlp/experts/up/kernel", "model.layers.{layer}.mlp.experts.{expert}.up.weight",
                  transpose=(1, 0), stack=("expert",)),)
    shapes = {"layers_0to2": {"mlp": {"experts": {"up": {"kernel": (3, 4, 6, 5)}}}},
              "layers_3": {"mlp": {"experts": {"up": {"kernel": (4, 6, 5)}}}}}
    params, stored = _round_trip(rules, shapes)
    assert len(stored) == 4 * 4 and stored["model.layers.2.mlp.experts.3.up.weight"].shape == (5, 6)
    run = params["layers_0to2"]["mlp"]["experts"]["up"]["kernel"]
    lone = params["layers_3"]["mlp"]["experts"]["up"]["kernel"]
    np.testing.assert_array_equal(run[2, 3], stored["model.layers.2.mlp.experts.3.up.weight"].T)
    np.testing.assert_array_equal(lone[1], stored["model.layers.3.mlp.experts.1.up.weight"].T)


def test_layer_scopes_nested_below_the_top():
    """`layers/` inside a subtree (a vision tower's `encoder/layers_N` under a model's `tower/`) binds
    `{layer}` as a top-level scope does, runs and lone layers alike, beside the decoder's own layers."""
    rules = (Rule("tower/encoder/layers/fc/kernel", "vision.encoder.layers.{layer}.fc.weight", transpose=(1, 0)),
             Rule("layers/fc/kernel", "model.layers.{layer}.fc.weight", transpose=(1, 0)),
             Rule("tower/post/scale", "vision.post.weight"))
    encoder = {"layers_0to1": {"fc": {"kernel": (2, 3, 4)}}, "layers_2": {"fc": {"kernel": (3, 4)}}}
    shapes = {"tower": {"encoder": encoder, "post": {"scale": (3,)}},
              "layers_0": {"fc": {"kernel": (3, 5)}}}
    params, stored = _round_trip(rules, shapes)
    assert sorted(stored) == ["model.layers.0.fc.weight", "vision.encoder.layers.0.fc.weight",
                              "vision.encoder.layers.1.fc.weight", "vision.encoder.layers.2.fc.weight",
                              "vision.post.weight"]
    encoder = params["tower"]["encoder"]
    for scope, index, layer in (("layers_0to1", (1,), 1), ("layers_2", (), 2)):
        np.testing.assert_array_equal(encoder[scope]["fc"]["kernel"][index],
                                      stored[f"vision.encoder.layers.{layer}.fc.weight"].T)


def test_split_one_tensor_into_several_leaves():
    """A fused query/key/value projection (one `[q + k + v, in]` tensor) as three Dew kernels."""
    names = ("layers/attn/q/kernel", "layers/attn/k/kernel", "layers/attn/v/kernel")
    rules = (Rule(names, "model.layers.{layer}.attn.qkv.weight", transpose=(1, 0), axis=1),)
    shapes = {"layers_0to1": {"attn": {"q": {"kernel": (2, 5, 8)}, "k": {"kernel": (2, 5, 4)},
                                       "v": {"kernel": (2, 5, 4)}}}}
    params, stored = _round_trip(rules, shapes)
    qkv = stored["model.layers.1.attn.qkv.weight"]
    assert qkv.shape == (16, 5)
    attn = params["layers_0to1"]["attn"]
    for name, rows in (("q", slice(0, 8)), ("k", slice(8, 12)), ("v", slice(12, 16))):
        np.testing.assert_array_equal(attn[name]["kernel"][1], qkv[rows].T, err_msg=name)


def test_fuse_several_tensors_into_one_leaf():
    """transformers' separate gate and up projections as one `[in, 2 * mlp]` Dew kernel."""
    rules = (Rule("layers/mlp/gate_up/kernel", ("model.layers.{layer}.mlp.gate.weight",
                                                "model.layers.{layer}.mlp.up.weight"),
                  transpose=(1, 0), axis=1, sizes=(6, 6)),)
    params, stored = _round_trip(rules, {"layers_4": {"mlp": {"gate_up": {"kernel": (5, 12)}}}})
    fused = params["layers_4"]["mlp"]["gate_up"]["kernel"]
    np.testing.assert_array_equal(fused[:, :6], stored["model.layers.4.mlp.gate.weight"].T)
    np.testing.assert_array_equal(fused[:, 6:], stored["model.layers.4.mlp.up.weight"].T)


def test_fuse_tensors_whose_parts_are_interleaved_in_groups():
    """Qwen3-Next's projections: `qkvz` holds, per key head (2 groups), its query (2 rows), key (2) and value
    (4) rows, `ba` per key head its b (1) and a (1); Dew's kernel holds each part whole, in order."""
    qkvz, ba = "model.layers.{layer}.qkvz.weight", "model.layers.{layer}.ba.weight"
    rules = (Rule("layers/attn/in_proj/kernel", (qkvz,) * 3 + (ba,) * 2, transpose=(1, 0), axis=1,
                  sizes=(4, 4, 8, 2, 2), groups=2),)
    params, stored = _round_trip(rules, {"layers_0": {"attn": {"in_proj": {"kernel": (3, 20)}}}})
    fused = params["layers_0"]["attn"]["in_proj"]["kernel"].T
    groups = stored["model.layers.0.qkvz.weight"].reshape(2, 8, 3)
    np.testing.assert_array_equal(fused[:4], groups[:, :2].reshape(4, 3))  # queries, group 0's then group 1's
    np.testing.assert_array_equal(fused[4:8], groups[:, 2:4].reshape(4, 3))
    np.testing.assert_array_equal(fused[8:16], groups[:, 4:].reshape(8, 3))
    pairs = stored["model.layers.0.ba.weight"].reshape(2, 2, 3)
    np.testing.assert_array_equal(fused[16:18], pairs[:, 0])
    np.testing.assert_array_equal(fused[18:], pairs[:, 1])


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key row order (convert_hf_to_gguf.py): each head's two halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def test_permute_puts_llama_cpp_rows_back():
    rules = (Rule("layers/attn/q/kernel", "blk.{layer}.attn_q.weight", transpose=(1, 0), permute=2),)
    params, stored = _round_trip(rules, {"layers_0": {"attn": {"q": {"kernel": (5, 8)}}}})
    kernel = params["layers_0"]["attn"]["q"]["kernel"]
    np.testing.assert_array_equal(_llama_cpp_permute(kernel.T, 2), stored["blk.0.attn_q.weight"])


def test_regions_read_only_their_layers_and_rows():
    rules = (Rule("layers/attn/q/kernel", "model.layers.{layer}.q.weight", transpose=(1, 0)),
             Rule("layers/attn/k/kernel", "blk.{layer}.attn_k.weight", transpose=(1, 0), permute=2))
    plan = tensors.plan(rules, _shapes({"layers_0to3": {"attn": {"q": {"kernel": (4, 5, 6)},
                                                                   "k": {"kernel": (4, 5, 8)}}}}))
    rng = np.random.default_rng(1)
    stored = {name: rng.normal(size=shape).astype(F32) for name, shape in plan.tensors.items()}
    q, k = sorted(plan.leaves, key=lambda leaf: leaf.path[2] != "q")
    whole = {leaf.path[2]: tensors.read_region(ArrayReader(stored), leaf, None, F32) for leaf in plan.leaves}

    reader = ArrayReader(stored)
    index = (slice(1, 3), slice(None), slice(2, 4))  # layers 1-2, the kernel's columns 2-3 (the tensor's rows)
    np.testing.assert_array_equal(tensors.read_region(reader, q, index, F32), whole["q"][index])
    assert reader.asked == [(f"model.layers.{i}.q.weight", (slice(2, 4), slice(0, 5))) for i in (1, 2)]

    reader = ArrayReader(stored)
    index = (slice(3, 4), slice(None), slice(0, 4))  # the last layer's first head: rows 0-3, stored interleaved
    np.testing.assert_array_equal(tensors.read_region(reader, k, index, F32), whole["k"][index])
    assert reader.asked == [("blk.3.attn_k.weight", (slice(0, 4), slice(0, 5)))]


# A map llama.cpp uses (Mamba2's A = -exp(A_log)), here as a generic one: float64 inside, one rounding each way.
NEGATIVE_EXP = ValueMap("a = -exp(x)", read=lambda a: np.log(-a), write=lambda x: -np.exp(x), accepts=lambda a: a < 0,
                        domain="negative")


def test_reshape_and_value_map_round_trip():
    """A `[C, 1, K]` leaf stored as `[C, K]`, a `[H]` leaf stored as `[H, 1]` through a value map. Reshapes move
    values bit for bit; the map rounds once each way: float32 x -> a = -exp(x) -> log(-a) comes back exactly for
    |x| >= 1 (a's rounding moves log(-a) by less than 2^-24, under half an ulp of x) and within 2^-24 + half an
    ulp of x below that; a -> x -> a within half an ulp of x's relative change, |x| 2^-24, plus a's rounding."""
    rules = (Rule("layers/conv/kernel", "blk.{layer}.conv.weight", reshape=(6, 4)),
             Rule("layers/a_log", "blk.{layer}.a", reshape=(5, 1), values=NEGATIVE_EXP))
    plan = tensors.plan(rules, _shapes({"layers_0to1": {"conv": {"kernel": (2, 6, 1, 4)}, "a_log": (2, 5)}}))
    assert plan.tensors == {"blk.0.a": (5, 1), "blk.0.conv.weight": (6, 4), "blk.1.a": (5, 1),
                            "blk.1.conv.weight": (6, 4)}
    rng = np.random.default_rng(3)
    stored = {name: (-np.exp(rng.uniform(-3, 3, shape)) if name.endswith(".a") else rng.normal(size=shape))
              .astype(F32) for name, shape in plan.tensors.items()}
    conv, a_log = sorted(plan.leaves, key=lambda leaf: leaf.path[1] != "conv")
    read = {leaf.path[1]: tensors.read_region(ArrayReader(stored), leaf, None, F32) for leaf in plan.leaves}
    np.testing.assert_array_equal(read["conv"][1], stored["blk.1.conv.weight"][:, None, :])
    x = np.log(-stored["blk.1.a"][:, 0].astype(np.float64))
    np.testing.assert_array_equal(read["a_log"][1], x.astype(F32))  # one rounding, from float64
    index = (slice(1, 2), slice(2, 5), slice(None), slice(1, 3))  # a region of a reshaped leaf: cut from the whole
    np.testing.assert_array_equal(tensors.read_region(ArrayReader(stored), conv, index, F32), read["conv"][index])

    params = _nest({leaf.path: value for leaf, value in zip((conv, a_log), (read["conv"], read["a_log"]))})
    exported = {name: np.asarray(build()) for name, _, build in tensors.export_tensors(plan, params)}
    for name in stored:
        if name.endswith("conv.weight"):
            np.testing.assert_array_equal(exported[name], stored[name])
            continue
        x = read["a_log"][int(name[4])].astype(np.float64)
        assert_within(exported[name][:, 0], stored[name][:, 0],
                      np.abs(stored[name][:, 0]) * (np.spacing(np.abs(x.astype(F32))) / 2 + 2.0**-24), name)
        back = np.log(-exported[name][:, 0].astype(np.float64)).astype(F32)  # x -> a -> x
        assert_within(back, read["a_log"][int(name[4])], 2.0**-24 + np.spacing(np.abs(x.astype(F32))) / 2, name)
        exact = np.abs(x) >= 1
        np.testing.assert_array_equal(back[exact], read["a_log"][int(name[4])][exact])


def test_a_value_outside_the_maps_domain_is_refused_by_name():
    plan = tensors.plan((Rule("a_log", "blk.0.ssm_a", values=NEGATIVE_EXP),), _shapes({"a_log": (3,)}))
    stored = {"blk.0.ssm_a": np.array([-1.0, 0.5, -2.0], F32)}
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ssm_a' holds 0.5 at position 1 \(1 of its 3 values are not "
                                         r"negative\): it stores a = -exp\(x\), so every value must be negative"):
        tensors.read_region(ArrayReader(stored), plan.leaves[0], None, F32)


@pytest.mark.parametrize("rule, message", [
    (Rule("layers/other/kernel", "x.weight"), r"has no tensor rule for the Dew parameter layers_0/attn/q/kernel"),
    (Rule(("layers/attn/q/kernel", "layers/attn/k/kernel"), "qkv.weight", axis=1), r"needs \['layers/attn/k/kernel'\]"),
    (Rule("layers/attn/q/kernel", ("a.weight", "b.weight"), axis=1, sizes=(2, 2)), r"sizes \(2, 2\) do not add up"),
    (Rule("layers/attn/q/kernel", "q.weight", reshape=(4, 8)), r"shape \(4, 8\) does not hold the leaf's \(5, 6\)"),
])
def test_rules_that_do_not_fit_the_tree_are_refused(rule, message):
    with pytest.raises(ValueError, match=message):
        tensors.plan((rule,), _shapes({"layers_0": {"attn": {"q": {"kernel": (5, 6)}}}}), "a test family")


def test_a_rule_names_its_split_axis_and_fused_sizes():
    with pytest.raises(ValueError, match="give the axis it cuts"):
        Rule(("a", "b"), "ab.weight")
    with pytest.raises(ValueError, match="give one size each"):
        Rule("ab", ("a.weight", "b.weight"), axis=0)
    with pytest.raises(ValueError, match="moves one tensor whole: it cannot also split, fuse, transpose or permute"):
        Rule("a", "a.weight", reshape=(2, 3), transpose=(1, 0))
