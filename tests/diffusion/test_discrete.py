"""MDLM's process: the log-linear schedule, its NELBO weight, antithetic times and the corruption."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.diffusion.discrete import MDLM, DiscreteProcess, LogLinear
from dew.diffusion.unmask import Unmask, times
from tests.tolerances import ulp_bound


def test_mdlm_returns_the_log_linear_process_with_its_64_step_sampler():
    process = MDLM(mask_id=7)()
    assert process == DiscreteProcess(7, LogLinear(1e-3), Unmask(64))
    assert MDLM(mask_id=7, steps=16)().sampler.steps == 16
    np.testing.assert_allclose(times(4), [1.0, 0.75, 0.5, 0.25])


def test_the_weight_is_the_nelbo_weight_of_the_schedule():
    schedule = LogLinear(1e-3)
    alpha = lambda t: 1.0 - schedule.mask_probability(t)
    for t in (1e-3, 0.1, 0.5, 1.0):
        # -alpha'(t) / (1 - alpha(t)): the derivative by autodiff in float32 (1 - eps, one rounding), the rest
        # in Python's float64. The weight rounds t to float32 and divides once: 2.5 float32 roundings of
        # half an ulp apart at most, so 2 ulps.
        expected = -float(jax.grad(alpha)(t)) / (1.0 - alpha(t))
        np.testing.assert_allclose(schedule.weight(jnp.float32(t)), expected, rtol=ulp_bound(2), atol=0)
    assert float(schedule.weight(jnp.float32(0.0))) == 0.0


def test_antithetic_times_take_one_each_of_equal_strata():
    process = MDLM(mask_id=7)()
    eps = process.schedule.eps
    t = np.asarray(process.sample_times(jax.random.key(3), 8), np.float64)
    stratum = (1 - eps) / 8
    lower = eps + stratum * np.arange(8)
    assert ((t >= lower) & (t < lower + stratum)).all()
    # One uniform for the whole batch: every row sits at the same place in its stratum (float32 sums).
    np.testing.assert_allclose(np.diff(t), stratum, atol=4 * np.finfo(np.float32).eps)


def test_corruption_masks_real_tokens_at_the_schedule_rate_and_never_padding():
    process = MDLM(mask_id=7)()
    tokens = jnp.tile(jnp.arange(1000, dtype=jnp.int32) % 7, (100, 1))
    real = jnp.broadcast_to(jnp.arange(1000) < 900, tokens.shape)
    t = jnp.full((100,), 0.3, jnp.float32)
    noisy, masked = process.corrupt(jax.random.key(0), tokens, real, t)
    noisy, masked = np.asarray(noisy), np.asarray(masked)
    assert (noisy[masked] == 7).all() and (noisy[~masked] == np.asarray(tokens)[~masked]).all()
    assert not masked[:, 900:].any()
    # 90,000 Bernoulli draws at p = 0.2997: six standard deviations is 0.009.
    assert abs(masked[:, :900].mean() - 0.3 * (1 - 1e-3)) < 6 * np.sqrt(0.3 * 0.7 / 90_000)
    everything = np.asarray(process.corrupt(jax.random.key(1), tokens, real, jnp.ones((100,)))[1])
    assert not everything[:, 900:].any() and everything[:, :900].mean() > 0.99


@pytest.mark.parametrize("make, message", [
    (lambda: LogLinear(0.0), "LogLinear eps is 0.0; it must lie in"),
    (lambda: MDLM(mask_id=-1)(), "mask_id is -1"),
    (lambda: MDLM(mask_id=3, steps=0)(), "steps is 0; masked generation needs a whole number"),
])
def test_bad_settings_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()
