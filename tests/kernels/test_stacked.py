"""A scanned run's float kernels read in place by decode steps, and by a bfloat16 prefill with AMX
(`dew.nn.quantize.stacked_in_place`, `dew.kernels.matmul.stacked_product`; the layer operand of
native/gemm.cc's stacked handlers and of native/few_rows.cc) against the same layers' weights indexed out
of the stack, as the scan slices them."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.interop.roundings import decoder_ulps
from dew.kernels import matmul, policy
from dew.nn import mlp
from dew.nn.linear import KERNEL, STACKED_BLOCKS, STACKED_LAYER
from dew.kernels import int8
from dew.nn.quantize import bfloat16_bits, quantize_int8, stacked_in_place
from dew.sampling import Sampling, generate
from tests.conftest import TINY
from tests.tolerances import ulp_bound

RUN = "layers_0to1"
DECODE = jnp.asarray([[3], [17], [42]], jnp.int32)  # three rows, one position each: a decode step's products
PREFILL = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 40)), jnp.int32)  # 40 rows, over FEW_ROWS
# A kernel's copy out of the stack: a dynamic-slice whose result is one layer's kernel (or a stack of one).
_COPY = re.compile(r"= (f32|bf16|u16|s8)\[(1,)?(32,32|32,16|32,64|64,32)\]\{[^}]*\} dynamic-slice\(")

pytestmark = pytest.mark.skipif(not matmul.status()[0], reason="oneDNN's gemm is unavailable here")


def _with(model, **changes):
    return model.clone(config=dataclasses.replace(model.config, **changes))


@pytest.fixture(scope="module")
def model():
    return models.build("causal_transformer", **{**TINY, "scan_layers": 1})


@pytest.fixture(scope="module")
def variables(model):
    # Weights of order one, so that the products' roundings show in the logits.
    init = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
    return jax.tree_util.tree_map(lambda x: x * 20 if x.ndim == 3 else x, init)


def _bfloat16(model, variables):
    model = _with(model, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return model, bfloat16_bits(model, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), variables))


def test_the_kernels_move_whole_and_come_back(model, variables):
    lifted = stacked_in_place(model, variables)
    assert lifted[STACKED_BLOCKS][RUN]["mlp"]["up_proj"][KERNEL].shape == (2, 32, 64)
    np.testing.assert_array_equal(lifted[STACKED_LAYER][RUN]["self_attn"]["k_proj"][KERNEL], [0, 1])
    assert KERNEL not in lifted["params"][RUN]["mlp"]["up_proj"] and "lm_head" in lifted["params"]
    back, per_layer = model.unstack_variables(lifted), model.unstack_variables(variables)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(per_layer)
    for ours, theirs in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(per_layer)):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_reads_each_layer_in_place_with_the_same_products(model, variables, dtype):
    model = _with(model, kernels="native")  # every product in oneDNN, scanned or not: the same calls
    if dtype == "bfloat16":
        if not matmul.status(jnp.bfloat16)[0]:
            pytest.skip(matmul.status(jnp.bfloat16)[1])
        model, variables = _bfloat16(model, variables)
    lifted = stacked_in_place(model, variables)
    ours = np.asarray(jax.jit(model.apply)(lifted, DECODE), np.float32)
    # The same oneDNN call on the same bytes as on the scan's slice of them, only read where they lie: the
    # same bits. (Against unrolled layers too in float32; in bfloat16 XLA rounds the scan's body's other
    # operations otherwise than the unrolled layers', 1.2e-3 apart on logits of 0.3, with or without this.)
    np.testing.assert_array_equal(ours, np.asarray(jax.jit(model.apply)(variables, DECODE), np.float32))
    if dtype == "float32":
        unrolled = _with(model, scan_layers=0)
        per_layer = unrolled.stack_variables(model.unstack_variables(variables))
        np.testing.assert_array_equal(ours, np.asarray(jax.jit(unrolled.apply)(per_layer, DECODE)))
    step = jax.jit(model.apply).lower(lifted, DECODE).compile().as_text()
    assert "dew_gemm_stacked_" in step and not _COPY.search(step)
    sliced = jax.jit(model.apply).lower(variables, DECODE).compile().as_text()
    assert _COPY.search(sliced)  # what the stacked operand avoids: each kernel copied out first


def test_under_auto_the_logits_and_greedy_tokens_are_float32s(model, variables):
    lifted = stacked_in_place(model, variables)
    ours, theirs = (np.asarray(jax.jit(model.apply)(v, DECODE)) for v in (lifted, variables))
    # The stacked product runs in oneDNN (or the few-rows kernel) where the tiny products of the sliced
    # weights stay XLA's (under MIN_FLOPS): the same float32 sums in another order, a random walk of
    # roundings through two layers. Observed: 8.5e-8 on logits of 0.40 (the bound: 2.9e-6).
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=1, libraries=1)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ulp_bound(ulps, np.abs(theirs).max()))
    # A prefill's 40 rows take the indexed layer's product, as the sliced weights do: the same bits.
    np.testing.assert_array_equal(*(np.asarray(jax.jit(model.apply)(v, PREFILL)) for v in (lifted, variables)))
    # Under `xla` every product is XLA's dot of the indexed layer: the same bits as the scan's slices.
    xla = _with(model, kernels="xla")
    np.testing.assert_array_equal(*(np.asarray(jax.jit(xla.apply)(v, DECODE)) for v in (lifted, variables)))
    # `generate` holds the kernels whole itself; under `xla` they are indexed out and XLA multiplies them.
    _same_greedy_tokens(model, xla, variables, [[5, 9, 14, 2], [7, 1, 33, 60]])


def _same_greedy_tokens(model, xla, variables, prompts):
    greedy = Sampling(temperature=0.0)
    with policy.recording() as choices:
        ours = generate(model, variables, prompts, 8, key=jax.random.key(0), sampling=greedy).tokens
    assert "onednn" in choices.values() or "dew" in choices.values()
    np.testing.assert_array_equal(ours, generate(xla, variables, prompts, 8, key=jax.random.key(0),
                                                 sampling=greedy).tokens)


def test_bfloat16_logits_are_the_sliced_weights_and_greedy_tokens_xlas(model, variables):
    if not matmul.status(jnp.bfloat16)[0]:
        pytest.skip(matmul.status(jnp.bfloat16)[1])
    model, variables = _bfloat16(model, variables)
    lifted = stacked_in_place(model, variables)
    # bfloat16 products of a few rows run in the few-rows kernel either way, stacked or lone
    # (dew.kernels.policy.choose_bfloat16_few_rows): the same bits.
    logits = [np.asarray(jax.jit(model.apply)(v, DECODE), np.float32) for v in (lifted, variables)]
    np.testing.assert_array_equal(*logits)
    _same_greedy_tokens(model, _with(model, kernels="xla"), variables, [[5, 9, 14, 2]])


def test_a_bfloat16_prefill_reads_each_layer_in_place_where_there_are_tiles(model, variables):
    if not matmul.few_rows_tiles():
        pytest.skip("no AMX bfloat16 tiles here: a prefill's products index the layer out (XLA's copy)")
    # 64 positions: every linear's product has 64 rows, within policy.BFLOAT16_PREFILL_ROWS.
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, 64)), jnp.int32)
    exact = np.asarray(jax.jit(model.apply)(jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), variables), prompt))
    model, variables = _bfloat16(model, variables)
    lifted = stacked_in_place(model, variables)
    step = jax.jit(model.apply).lower(lifted, prompt).compile().as_text()
    assert "dew_few_rows_bf16_to_bf16" in step and not _COPY.search(step)
    ours, theirs = (np.asarray(jax.jit(model.apply)(v, prompt)) for v in (lifted, variables))
    # The kernel's sums and XLA's dot after the copy add the same products in other orders, and each rounds
    # its sums to bfloat16: two evaluations of one bfloat16 network, each within bfloat16's error of the
    # float32 one on the same weights, so apart by at most twice the sliced weights' distance from it plus
    # one bfloat16 rounding of the largest logit. Observed: the same bits (bound 5.3e-2; logits up to 0.46).
    bound = 2 * np.max(np.abs(theirs - exact)) + 2.0**-8 * np.max(np.abs(exact))
    assert np.max(np.abs(ours - theirs)) <= bound, (np.max(np.abs(ours - theirs)), bound)


def test_a_bfloat16_prefill_gates_its_mlp_in_one_call_with_the_same_bits(model, variables, monkeypatch):
    if not matmul.few_rows_tiles():
        pytest.skip("no AMX bfloat16 tiles here: a prefill's products index the layer out (XLA's copy)")
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, 64, (1, 64)), jnp.int32)
    model, variables = _bfloat16(model, variables)
    lifted = stacked_in_place(model, variables)

    def run():
        apply = jax.jit(lambda v, p: model.apply(v, p))
        return apply.lower(lifted, prompt).compile().as_text(), np.asarray(apply(lifted, prompt))

    step, gated = run()
    assert "dew_few_rows_bf16_gated" in step
    # The same model with the gate and up products apart and XLA's activation after them: the same bits.
    monkeypatch.setattr(mlp, "gated_takes", lambda *args, **kwargs: False)
    step, apart = run()
    assert "dew_few_rows_bf16_gated" not in step
    np.testing.assert_array_equal(gated, apart)


def test_int8_kernels_are_read_in_place_by_the_int8_kernel(model, variables):
    if not int8.kernel_status()[0]:
        pytest.skip(int8.kernel_status()[1])
    quantized = quantize_int8(model, variables)
    lifted = stacked_in_place(model, quantized)
    assert lifted[STACKED_BLOCKS][RUN]["mlp"]["down_proj"][KERNEL].dtype == jnp.int8
    # The int8 kernel's product of the same bytes and scales, only read where they lie: the same bits.
    np.testing.assert_array_equal(*(np.asarray(jax.jit(model.apply)(v, DECODE)) for v in (lifted, quantized)))
    step = jax.jit(model.apply).lower(lifted, DECODE).compile().as_text()
    assert "dew_int8_stacked_product" in step and not _COPY.search(step)
    np.testing.assert_array_equal(*(np.asarray(jax.jit(model.apply)(v, PREFILL)) for v in (lifted, quantized)))
