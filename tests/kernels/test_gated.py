"""A gated feed-forward's `act(x gate) * (x up)` in one call of the kernel's AMX body
(`dew.kernels.matmul.stacked_gated_product`, native/few_rows.cc) against the path it replaces: the two products
read in place, each rounded to bfloat16, and XLA's fusion of the activation after them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from dew.kernels import matmul, policy
from dew.nn.mlp import ACTIVATIONS

pytestmark = pytest.mark.skipif(not matmul.few_rows_tiles(),
                                reason="no AMX bfloat16 tiles here: a prefill's products take other kernels")


@functools.partial(jax.jit, static_argnames="activation")
def _apart(x, gate, gate_layer, up, up_layer, activation):
    """`dew.nn.mlp.GatedMLP`'s path without the gated call."""
    g = matmul.stacked_product(x, gate, gate_layer, jnp.bfloat16)
    u = matmul.stacked_product(x, up, up_layer, jnp.bfloat16)
    return activation(g.astype(jnp.float32)).astype(jnp.bfloat16) * u


_gated = jax.jit(matmul.stacked_gated_product, static_argnames=("activation", "policy"))


def _bits(array):
    return np.asarray(lax.bitcast_convert_type(array, jnp.uint16))


def _same_bits_or_both_nan(ours, theirs):
    """Equal bits, except that two NaNs count as equal: XLA's multiply of two NaNs keeps either one's sign."""
    nan = np.isnan(np.asarray(ours, np.float32)) & np.isnan(np.asarray(theirs, np.float32))
    differ = (_bits(ours) != _bits(theirs)) & ~nan
    assert not differ.any(), (np.argwhere(differ)[:5], _bits(ours)[differ][:5], _bits(theirs)[differ][:5])


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_bfloat16_gate_gives_xlas_activation(activation):
    # x one column of ones against a gate whose one row holds each of the 65,536 bfloat16 bit patterns: the
    # products are those values exactly (denormals flushed by the tiles on both paths), so the activation
    # meets every value a rounded gate can take, infinities and NaNs included; up holds random patterns.
    # Observed: the same bits everywhere (a NaN's sign aside, where gate and up are both NaN).
    gate = jnp.arange(65536, dtype=jnp.uint32).astype(jnp.uint16).reshape(1, 1, -1)
    up = jnp.asarray(np.random.default_rng(0).integers(0, 65536, gate.shape, np.uint16))
    x = jnp.ones((64, 1), jnp.bfloat16)
    assert matmul.gated_takes(x, gate, up)
    layer, act = jnp.int32(0), ACTIVATIONS[activation]
    _same_bits_or_both_nan(_gated(x, gate, layer, up, layer, act), _apart(x, gate, layer, up, layer, act))


# Rows at both ends of policy.BFLOAT16_PREFILL_ROWS and between them off a block of 32; K and N off the tiles'
# 32 (and under one tile); SmolLM2's gate and up (576 x 1536), whose x the tiles read in place.
@pytest.mark.parametrize("m,k,n", [(64, 576, 1536), (97, 100, 70), (4096, 33, 31)])
def test_the_gated_call_gives_the_bits_of_the_two_products_and_xlas_activation(m, k, n):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    gate, up = (lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((3, k, n)) * 0.3, jnp.bfloat16),
                                         jnp.uint16) for _ in range(2))
    gate_layer, up_layer = jnp.int32(2), jnp.int32(1)
    silu = ACTIVATIONS["silu"]
    ours = _gated(x, gate, gate_layer, up, up_layer, silu)
    np.testing.assert_array_equal(_bits(ours), _bits(_apart(x, gate, gate_layer, up, up_layer, silu)))
    assert ours.shape == (m, n) and ours.dtype == jnp.bfloat16


def test_the_gated_call_is_taken_only_where_both_products_run_in_the_amx_body():
    fewest, most = policy.BFLOAT16_PREFILL_ROWS
    stack = jnp.zeros((2, 64, 96), jnp.uint16)
    x = lambda rows: jnp.zeros((rows, 64), jnp.bfloat16)
    assert matmul.gated_takes(x(fewest), stack, stack, "auto")
    assert matmul.gated_takes(x(most), stack, stack, "exact")
    assert not matmul.gated_takes(x(fewest - 1), stack, stack, "auto")  # the few-rows kernel's
    assert not matmul.gated_takes(x(most + 1), stack, stack, "auto")
    assert not matmul.gated_takes(x(fewest), stack, stack, "xla")
    assert not matmul.gated_takes(x(fewest), stack, stack, "native")
    assert not matmul.gated_takes(x(fewest), stack, jnp.zeros((2, 64, 32), jnp.uint16), "auto")
    assert not matmul.gated_takes(x(fewest).astype(jnp.float32), stack.astype(jnp.float32),
                                  stack.astype(jnp.float32), "auto")
    with pytest.raises(ValueError, match="take two stacked_products"):
        matmul.stacked_gated_product(x(fewest - 1), stack, 0, stack, 0, ACTIVATIONS["silu"])
