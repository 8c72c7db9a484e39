"""The shared config parts: the optimizer's schedule, decay mask and clipping; models; JSON records."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.run_config import ModelConfig, OptimConfig, to_json
from dew.sampling import Sampling
from tests.tolerances import LIBRARY_ULPS, ulp_bound


@pytest.mark.parametrize("schedule, last", [("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)])
def test_schedule_warms_up_then_decays_to_its_final_fraction(schedule, last):
    rates = OptimConfig(learning_rate=1.0, schedule=schedule, warmup_steps=4).learning_rates(20)
    # float32 rates of size at most 1: a few roundings, and the cosine's cos from XLA (LIBRARY_ULPS of
    # 1). Observed: warm-up exact, final rate 1.5e-9 off (0.1 in float32).
    rounding = ulp_bound(LIBRARY_ULPS + 2)
    np.testing.assert_allclose([float(rates(step)) for step in range(5)], [0.0, 0.25, 0.5, 0.75, 1.0],
                               atol=rounding, rtol=0)
    np.testing.assert_allclose(float(rates(20)), last, atol=rounding, rtol=0)
    assert all(float(rates(step)) >= float(rates(step + 1)) - rounding for step in range(4, 20))


def test_weight_decay_skips_norm_scales_and_clipping_bounds_the_update():
    params = {"kernel": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    decaying = OptimConfig(learning_rate=0.5, schedule="constant", weight_decay=0.1).build(10)
    updates, _ = decaying.update(zero, decaying.init(params), params)
    # -lr * wd * p: float32 0.1 and two products, 3 roundings. Observed: 1.5e-8 relative.
    np.testing.assert_allclose(updates["kernel"], -0.05 * np.ones((2, 2)), rtol=ulp_bound(3), atol=0)
    np.testing.assert_array_equal(updates["scale"], np.zeros(2))
    # With b1 = b2 = 0 and eps 1 Adam's step is g / (|g| + 1): near 1 for a huge g, 0.29 once g is
    # clipped to global norm 1 (each of the 6 entries 1/sqrt(6)).
    huge = jax.tree_util.tree_map(lambda p: 1e3 * p, params)
    steps = {}
    for clip in (None, 1.0):
        adam = OptimConfig(learning_rate=1.0, schedule="constant", clip_grads=clip, b1=0.0, b2=0.0, eps=1.0).build(10)
        steps[clip] = np.abs(adam.update(huge, adam.init(params), params)[0]["kernel"])
    # float32 against float64: Adam's sqrt, add and divide (3 roundings), and before them clipping's
    # 6 squares summed, sqrt and scale (7 more, in relative terms). Observed: 2.7e-8 and 1.8e-10 relative.
    np.testing.assert_allclose(steps[None], 1e3 / 1001, rtol=ulp_bound(3), atol=0)
    np.testing.assert_allclose(steps[1.0], (1 / 6**0.5) / (1 + 1 / 6**0.5), rtol=ulp_bound(10), atol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(learning_rate=0.0), "learning_rate is 0.0; it must be positive"),
    (dict(schedule="constant", final_fraction=0.0), "has no effect with the constant schedule"),
    (dict(clip_grads=-1.0), "clip_grads is -1.0"),
])
def test_optim_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_model_config_builds_with_defaults_it_does_not_override():
    model = ModelConfig("causal_transformer", {"emb_features": 32, "num_heads": 4, "vocab_size": 300}).build(
        vocab_size=256)
    assert model.config.vocab_size == 300 and model.config.emb_features == 32
    with pytest.raises(ValueError, match="model 'gpt' is not registered; registered models are"):
        ModelConfig("gpt")


def test_records_are_plain_json():
    record = to_json({"sampling": Sampling(temperature=0.5, eos_token_ids=(2,)), "dtype": jnp.bfloat16,
                      "width": np.int32(3), "dtypes": (np.dtype("float32"),)})
    assert record["sampling"]["eos_token_ids"] == [2] and record["sampling"]["temperature"] == 0.5
    assert record["dtype"] == "bfloat16" and record["width"] == 3 and record["dtypes"] == ["float32"]
    with pytest.raises(TypeError, match="has no JSON form"):
        to_json(object())
