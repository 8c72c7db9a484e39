"""The rotation's half-turn off the CPU (`dew.nn.rotary._turned32`): one product with the signed permutation,
the same bits as slicing the halves, for both compute dtypes (checked here by running that branch on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import rotary


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_accelerators_half_turn_is_the_sliced_one(dtype, monkeypatch):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 3, 64)), dtype)
    sliced = rotary._turned32(x)
    monkeypatch.setattr(rotary.jax, "default_backend", lambda: "tpu")
    turned = rotary._turned32(x)
    assert turned.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(turned), np.asarray(sliced))
