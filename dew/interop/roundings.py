"""How far apart two float32 evaluations of one decoder may land, counted in ulps from the computation.

Two evaluations that round in another order, or call a transcendental function from another library,
land a bounded number of ulps of the magnitudes involved apart. The tests' tolerances
(tests/tolerances.py) and tier 2's bound on a verified mapping (`dew.interop.verify`) both count them
here; an ulp of a magnitude m is `eps * m` (float32's eps is 2 ** -23).
"""

from __future__ import annotations

import math

# exp, log, pow, rsqrt, tanh, sin and cos from two libraries (XLA's, torch's, numpy's libm), or one
# library's scalar and vector paths on different CPUs (AVX2, AVX-512), are each within about 2 ulps
# of the exact result, so up to 4 ulps apart; for sin and cos, 4 ulps of the angle as well, for the
# range reduction.
LIBRARY_ULPS = 4


# float32 roundings each side takes after `theta ** (2i / head_dim)` (an exponent division, then the
# scaling's formula), each of which may break differently once two pow functions disagree.
_FREQUENCY_ROUNDINGS = {"default": 2, "linear": 3, "llama3": 14, "yarn": 7, "proportional": 3}


def rotary_frequency_ulps(kind: str = "default", factor: float = 1.0, low_freq_factor: float | None = None,
                          high_freq_factor: float | None = None) -> float:
    """Relative ulps between two libraries' float32 rotary inverse frequencies under a scaling of `kind`
    (transformers' `rope_type`): two pow functions (`LIBRARY_ULPS`) and the scaling's roundings, times
    the formula's gain on a relative error. The gain is 1, but Llama 3's blend weighs x / factor and x by
    a weight made from x itself, which multiplies it by 1 + max((f - 1) low / span, (f - 1) high / (f span))."""
    gain = 1.0
    if kind == "llama3":
        f, low, high = factor, low_freq_factor, high_freq_factor
        gain += max((f - 1) * low / (high - low), (f - 1) * high / (f * (high - low)))
    return gain * (LIBRARY_ULPS + _FREQUENCY_ROUNDINGS[kind])


def decoder_ulps(*, layers: int, width: int, mlp_width: int, heads: int, head_dim: int, seq_len: int,
                 libraries: int = 2, frequency_ulps: float | None = None) -> float:
    """Ulps of the logits' size by which two fp32 evaluations of one decoder may differ: Dew against
    transformers (`libraries=2`), or Dew against itself in another layout or order (`libraries=1`).

    Along the chain from an embedding to a logit each layer rounds in two RMS norms (a `width`-term
    mean of squares, an rsqrt, two products), the query/key/value projections (`width` terms), the
    rotation (3), the scores (`head_dim` terms), a softmax (a `seq_len`-term sum, a division), the
    weighted values (`seq_len` terms), the output projection (`heads * head_dim`), gate and up (`width`
    each), the activation (3), down (`mlp_width`) and two residual adds; a final norm and the head
    (`width`) close it. Rounding errors are unbiased and independent, so their difference walks
    randomly: six standard deviations, sqrt(6 N) ulps for N roundings of up to an ulp, bounds it.
    Two libraries' transcendentals may instead differ systematically, so they add up in full: per
    layer two rsqrts, the softmax's exp, the activation and a softcap's tanh (`LIBRARY_ULPS` each), and
    the rotation of queries and keys, whose angles reach `seq_len` radians and carry their inverse
    frequencies' error (`frequency_ulps`, by default `rotary_frequency_ulps()`), their own rounding and
    cos and sin's `LIBRARY_ULPS` of the angle.
    """
    per_layer = (2 * (width + 3) + width + 3 + head_dim + 2 * seq_len + 1 + heads * head_dim + 2 * width + 3
                 + mlp_width + 2)
    roundings = layers * per_layer + (width + 3) + width
    random_walk = math.sqrt(6 * roundings)
    if libraries == 1:
        return random_walk
    if frequency_ulps is None:
        frequency_ulps = rotary_frequency_ulps()
    rotation = (frequency_ulps + 1 + LIBRARY_ULPS) * seq_len + LIBRARY_ULPS
    return random_walk + LIBRARY_ULPS * (5 * layers + 1) + 2 * layers * rotation


def transformers_decoder_ulps(config, seq_len: int) -> float:
    """`decoder_ulps` for Dew against transformers' decoder with `config` over `seq_len` tokens, its rotary
    scalings' frequency error included (the largest, where layer types carry their own)."""
    heads = config.num_attention_heads
    rope = config.rope_parameters
    ropes = [rope] if "rope_type" in rope else list(rope.values())
    frequency = max(rotary_frequency_ulps(r["rope_type"], r.get("factor", 1.0), r.get("low_freq_factor"),
                                          r.get("high_freq_factor")) for r in ropes)
    return decoder_ulps(layers=config.num_hidden_layers, width=config.hidden_size, mlp_width=config.intermediate_size,
                        heads=heads, head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                        seq_len=seq_len, frequency_ulps=frequency)
