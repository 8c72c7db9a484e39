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

# exp, log, pow, rsqrt, tanh, sin and cos from two libraries (XLA's, torch's, numpy's libm), or one
# library's scalar and vector paths on different CPUs (AVX2, AVX-512), are each within about 2 ulps
# of the exact result, so up to 4 ulps apart; for sin and cos, 4 ulps of the angle as well, for the
# range reduction.
LIBRARY_ULPS = 4


def ulp_bound(ulps, magnitude=1.0, dtype=np.float32):
    """`ulps` ulps of `magnitude` (a number or an array) in `dtype`, one ulp being `eps * magnitude`.

    Worst case per rounding: each side rounds by at most half an ulp, so two evaluations that round
    differently drift at most one ulp apart per rounding. A sum of n terms in another order counts
    n - 1 roundings of the sum of the terms' magnitudes.
    """
    return ulps * float(jnp.finfo(dtype).eps) * magnitude


def decoder_ulps(*, layers: int, width: int, mlp_width: int, head_dim: int, seq_len: int,
                 libraries: int = 2) -> float:
    """Ulps of the logits' size by which two fp32 evaluations of one decoder (Dew and transformers, or
    Dew in two layouts) may differ.

    Along the chain from an embedding to a logit each layer rounds in two RMS norms (a `width`-term
    mean of squares, an rsqrt, two products), the query/key/value projections (`width` terms), rotary,
    the scores (`head_dim` terms), a softmax (a `seq_len`-term sum and a division), the weighted values
    (`seq_len` terms), the output, gate and up projections (`width` each), the activation, the down
    projection (`mlp_width`) and two residual adds; a final norm and the head (`width`) close it. Those
    roundings are unbiased and independent, so their difference walks randomly: six standard deviations,
    sqrt(6 N) ulps for N roundings of up to an ulp, is the bound. Two libraries' transcendentals may
    instead differ systematically, so they add up in full: per layer two rsqrts, the softmax's exp, the
    activation, a softcap's tanh, and cos and sin of angles up to `seq_len` radians whose inverse
    frequencies come from two pow functions (`LIBRARY_ULPS` of the angle, twice). `libraries=1` (the
    same library on both sides) drops that term.
    """
    per_layer = 2 * (width + 3) + width + head_dim + 2 * seq_len + 1 + 3 * width + 3 + mlp_width + 2
    roundings = layers * per_layer + (width + 3) + width
    library_ulps = 0 if libraries == 1 else LIBRARY_ULPS * (layers * (5 + 2 * seq_len) + 1)
    return library_ulps + math.sqrt(6 * roundings)


def assert_within(actual, desired, bound, what: str = "") -> None:
    """Assert |actual - desired| <= bound element by element (`bound` may be an array), naming the worst."""
    difference = np.abs(np.asarray(actual, np.float64) - np.asarray(desired, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), difference.shape)
    if (difference <= bound).all():
        return
    worst = np.unravel_index(np.argmax(difference - bound), difference.shape)
    raise AssertionError(f"{what}: {int((difference > bound).sum())} of {difference.size} differences exceed their "
                         f"bound; the worst is {difference[worst]:.3g} at {tuple(map(int, worst))}, against a bound of {bound[worst]:.3g}")
