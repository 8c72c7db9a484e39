"""Floating-point tolerances reasoned from the computation, so that a comparison holds on any x86-64 CPU.

Two evaluations of one value that round in another order, or call a transcendental function from
another library, land a bounded number of ulps of the magnitudes involved apart. A test counts those
ulps from its computation and says where they come from; these functions turn the count into a
tolerance. The largest difference observed stays in the test's comment, as a record, not a reason.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dew.interop.roundings import (  # noqa: F401  (re-exported: the tests count ulps with them)
    LIBRARY_ULPS, decoder_ulps, rotary_frequency_ulps, transformers_decoder_ulps,
)


def ulp_bound(ulps, magnitude=1.0, dtype=np.float32):
    """`ulps` ulps of `magnitude` (a number or an array) in `dtype`, one ulp being `eps * magnitude`.

    Worst case per rounding: each side rounds by at most half an ulp, so two evaluations that round
    differently drift at most one ulp apart per rounding. A sum of n terms in another order counts
    n - 1 roundings of the sum of the terms' magnitudes.
    """
    return ulps * float(jnp.finfo(dtype).eps) * magnitude


def assert_within(actual, desired, bound, what: str = "") -> None:
    """Assert |actual - desired| <= bound element by element (`bound` may be an array), naming the worst."""
    difference = np.abs(np.asarray(actual, np.float64) - np.asarray(desired, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), difference.shape)
    if (difference <= bound).all():
        return
    worst = np.unravel_index(np.argmax(difference - bound), difference.shape)
    raise AssertionError(f"{what}: {int((difference > bound).sum())} of {difference.size} differences exceed their "
                         f"bound; the worst is {difference[worst]:.3g} at {tuple(map(int, worst))}, against a "
                         f"bound of {bound[worst]:.3g}")


def vision_tower_ulps(*, layers: int, width: int, mlp_width: int, heads: int, patches: int, patch_inputs: int) -> float:
    """Ulps of the outputs' size by which Dew's and transformers' fp32 evaluations of a pre-norm vision
    transformer (SigLIP) may differ.

    The patch embedding (`patch_inputs` terms, a bias, a position vector) opens the chain and a LayerNorm
    closes it; each layer rounds in two LayerNorms (a `width`-term mean, a `width`-term variance, an rsqrt,
    a subtraction, two products and a bias), the query/key/value projections (`width` terms and a bias),
    the scores (`width / heads` terms and the scale), a softmax over every patch (a `patches`-term sum, a
    division), the weighted values (`patches` terms), the output projection, fc1 (`width` terms and a
    bias each), the activation (3), fc2 (`mlp_width` terms and a bias) and two residual adds. As in
    `decoder_ulps`, the rounding errors walk randomly (six standard deviations), and the libraries'
    transcendentals (per layer two rsqrts, the exp and the activation's tanh or erf, and the last norm's
    rsqrt) add up in full.
    """
    norm = 2 * width + 4
    per_layer = (2 * norm + (width + 1) + (width // heads + 1) + (patches + 1) + patches + 2 * (width + 1) + 3
                 + (mlp_width + 1) + 2)
    roundings = (patch_inputs + 2) + layers * per_layer + norm
    return math.sqrt(6 * roundings) + LIBRARY_ULPS * (4 * layers + 1)
