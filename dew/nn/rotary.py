"""Rotary position embeddings in the rotate-half layout transformers' Llama uses, with the frequency
scalings published checkpoints use (linear, Llama 3's, YaRN, Gemma 4's proportional), computed the way
transformers computes them."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dew.kernels.policy import cpu_tuned

# Each kind of scaling and the `RopeScaling` fields it reads.
SCALINGS = {
    "default": ("rotated_fraction",),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_seq_len", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_seq_len", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
    "proportional": ("factor", "rotated_fraction"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How a rotary embedding stretches its frequencies past the length it was trained at.

    `kind` is transformers' `rope_type`, and the fields its parameters:
    - "default": no scaling; with `rotated_fraction` below 1, only the first `rotated_fraction` of each
      head's features turn, as a rotary of that width (its frequencies from that width, rotate-half
      within it; transformers' `partial_rotary_factor` with the default rope type, Qwen3-Next's), the
      rest passed through.
    - "linear": every frequency divided by `factor`.
    - "llama3" (Llama 3.1/3.2): frequencies whose wavelength is above `original_max_seq_len / low_freq_factor`
      divided by `factor`, those below `original_max_seq_len / high_freq_factor` kept, a smooth blend between.
    - "yarn": the lowest frequencies divided by `factor` and the highest kept, blended over the dimensions
      that turn between `beta_slow` and `beta_fast` times in `original_max_seq_len` positions (the band
      widened to whole dimensions with `truncate`); cos and sin are multiplied by `attention_factor`,
      by default `0.1 * ln(factor) + 1`, or the ratio of that with `mscale` and with `mscale_all_dim`.
    - "proportional" (Gemma 4's full layers): only the first `rotated_fraction` of each head's feature pairs
      turn (transformers' `partial_rotary_factor`), at the frequencies of the whole head's width; the
      others keep frequency zero; every frequency is divided by `factor`.
    A field the kind does not read keeps its default.

    Every kind also reads the three-axis (multimodal) rotary of Qwen's vision-language models:
    `mrope_section` gives how many of the `rotated // 2` frequency slots follow each axis of
    `rotary_positions` `[B, S, 3]` (time, height, width); text slots have equal positions on all three,
    where the table is the one-axis one. `mrope_interleaved` picks the layout: interleaved (Qwen3-VL,
    Qwen 3.5: slot `j` follows height when `j % 3 == 1` and `j < 3 * section[1]`, width when
    `j % 3 == 2` and `j < 3 * section[2]`, time otherwise) or chunked (Qwen2-VL, Qwen2.5-VL: the first
    `section[0]` slots follow time, the next `section[1]` height, the last `section[2]` width).
    """

    kind: str = "default"
    factor: float = 1.0
    original_max_seq_len: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    rotated_fraction: float = 1.0
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    def __post_init__(self):
        if self.kind not in SCALINGS:
            raise ValueError(f"rope_type {self.kind!r} is not built; Dew builds {', '.join(SCALINGS)}")
        unread = [field.name for field in dataclasses.fields(self)
                  if field.name not in ("kind", *_EVERY_KIND) and field.name not in SCALINGS[self.kind]
                  and getattr(self, field.name) != field.default]
        if unread:
            raise ValueError(f"rope_type {self.kind!r} does not read {unread}; it reads {list(SCALINGS[self.kind])}")
        if self.factor <= 0:
            raise ValueError(f"rope_type {self.kind!r} has factor {self.factor}; it must be positive")
        if self.kind in ("llama3", "yarn") and (self.original_max_seq_len or 0) < 1:
            raise ValueError(f"rope_type {self.kind!r} has original_max_seq_len {self.original_max_seq_len}: give "
                             "the context length the model was pretrained at")
        if not 0 < self.rotated_fraction <= 1:
            raise ValueError(f"rope_type {self.kind!r} has rotated_fraction {self.rotated_fraction}; it is the share "
                             "of each head that turns, in (0, 1]")
        if self.mrope_section is not None:
            section = tuple(self.mrope_section)
            if len(section) != 3 or any(int(n) != n or n < 0 for n in section):
                raise ValueError(f"mrope_section is {self.mrope_section}; it gives three counts of frequency slots "
                                 "(time, height, width), as the checkpoint's rope_parameters name them")
            object.__setattr__(self, "mrope_section", tuple(int(n) for n in section))
        elif self.mrope_interleaved:
            raise ValueError("mrope_interleaved without mrope_section: give the three axes' slot counts too")
        if self.kind == "llama3":
            low, high = self.low_freq_factor, self.high_freq_factor
            if low is None or high is None or not 0 < low < high:
                raise ValueError(f"rope_type 'llama3' has low_freq_factor {low} and high_freq_factor {high}: both are "
                                 "needed, with 0 < low_freq_factor < high_freq_factor (Llama 3.1 uses 1 and 4)")


# The fields every kind reads besides its own.
_EVERY_KIND = ("mrope_section", "mrope_interleaved")


def rotated_width(head_dim: int, scaling: RopeScaling) -> int:
    """The features of a head a rotary table of `scaling` turns, the first ones: all of them but under the
    default kind with a `rotated_fraction` (transformers' `int(head_dim * partial_rotary_factor)`)."""
    return int(head_dim * scaling.rotated_fraction) if scaling.kind == "default" else head_dim


def rotary_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> tuple[np.ndarray, float]:
    """The inverse frequencies, float32 `[head_dim // 2]`, and the factor cos and sin are multiplied by.

    Computed on the host in float32, one rounding per step in transformers' order, so the tables agree
    with its own up to its float32 power function's last bit.
    """
    f32 = np.float32
    exponents_F = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    powers_F = f32(theta) ** exponents_F
    inv_freq_F = f32(1) / powers_F
    s = scaling
    if s.kind == "default":
        return inv_freq_F, 1.0
    if s.kind == "linear":
        return inv_freq_F / f32(s.factor), 1.0
    if s.kind == "proportional":
        rotated = int(s.rotated_fraction * head_dim // 2)
        inv_freq_F = np.where(np.arange(head_dim // 2) < rotated, inv_freq_F, f32(0))
        return (inv_freq_F / f32(s.factor)).astype(f32), 1.0
    if s.kind == "llama3":
        # torch divides a scalar by a tensor as reciprocal-then-multiply; so does this.
        wavelen_F = (f32(1) / inv_freq_F) * f32(2 * math.pi)
        long_wavelen = s.original_max_seq_len / s.low_freq_factor
        short_wavelen = s.original_max_seq_len / s.high_freq_factor
        scaled_F = np.where(wavelen_F > f32(long_wavelen), inv_freq_F / f32(s.factor), inv_freq_F)
        span = f32(s.high_freq_factor - s.low_freq_factor)
        smooth_F = ((f32(1) / wavelen_F) * f32(s.original_max_seq_len) - f32(s.low_freq_factor)) / span
        blended_F = (f32(1) - smooth_F) * scaled_F / f32(s.factor) + smooth_F * scaled_F
        between = ~(wavelen_F < f32(short_wavelen)) & ~(wavelen_F > f32(long_wavelen))
        return np.where(between, blended_F, scaled_F).astype(f32), 1.0
    return _yarn_frequencies(head_dim, theta, s, powers_F)


def _yarn_frequencies(head_dim: int, theta: float, s: RopeScaling, powers_F: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN's frequencies from the unscaled `theta ** (2i / head_dim)`, and its attention factor."""
    f32 = np.float32

    def magnitude(factor: float, mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = magnitude(s.factor, s.mscale) / magnitude(s.factor, s.mscale_all_dim)
        else:
            attention_factor = magnitude(s.factor)

    def dimension_turning(turns: float) -> float:
        """The (fractional) dimension whose frequency turns `turns` times in `original_max_seq_len` positions."""
        return head_dim * math.log(s.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(s.beta_fast), dimension_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp_F = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    kept_F = f32(1) - ramp_F  # 1 where a frequency is kept, 0 where it is divided by factor
    divided_F = f32(1) / (f32(s.factor) * powers_F)
    inv_freq_F = divided_F * (f32(1) - kept_F) + (f32(1) / powers_F) * kept_F
    return inv_freq_F.astype(f32), float(attention_factor)


def axis_of_slots(slots: int, scaling: RopeScaling) -> np.ndarray:
    """Which axis of three-axis positions (0 time, 1 height, 2 width) each of `slots` frequency slots
    follows under `scaling`'s `mrope_section` (see `RopeScaling`), int `[slots]`."""
    section = scaling.mrope_section
    j = np.arange(slots)
    if scaling.mrope_interleaved:
        return np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))
    if sum(section) != slots:
        raise ValueError(f"mrope_section {list(section)} covers {sum(section)} frequency slots, and the rotary has "
                         f"{slots} (half its rotated width): the chunked layout splits them all among the three axes")
    return np.repeat(np.arange(3), section)


def rotary_angles(positions_BS: jax.Array, head_dim: int, theta: float | None,
                  scaling: RopeScaling = RopeScaling()) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables, float32 `[B, S, head_dim]`, for integer positions `[B, S]` (or, where
    `scaling` has an `mrope_section`, three-axis positions `[B, S, 3]`); `theta` None
    gives the identity (cos 1, sin 0: a layer without rotary positions, SmolLM3's NoPE layers).

    Each frequency's cos and sin are computed once, on `[B, S, head_dim // 2]`, and the halves
    repeated; on the CPU (unless the kernel policy is `xla`) the tables are then held as arrays (an
    optimization barrier): left as expressions, XLA's CPU backend fuses them into every consumer, so each
    layer's query and key rotations, forward and backward, evaluate libm's scalar `sincosf` again. The
    values are the same either way (the same angles, the same functions)."""
    three_axis = scaling.mrope_section is not None and positions_BS.ndim == 3
    shape_BS = positions_BS.shape[:2]
    if theta is None:
        return jnp.ones((*shape_BS, head_dim), jnp.float32), jnp.zeros((*shape_BS, head_dim), jnp.float32)
    inv_freq_F, attention_factor = rotary_frequencies(head_dim, theta, scaling)
    if three_axis:
        # each slot's angle from its own axis: [B, S, 3, F] -> [B, S, F]
        freqs_BS3F = positions_BS.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
        axis_F = axis_of_slots(inv_freq_F.shape[0], scaling)
        freqs_BSF = jnp.take_along_axis(freqs_BS3F, jnp.asarray(axis_F)[None, None, None, :], axis=2)[:, :, 0]
    else:
        freqs_BSF = positions_BS.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_F)
    cos_BSF, sin_BSF = jnp.cos(freqs_BSF), jnp.sin(freqs_BSF)
    if attention_factor != 1.0:
        factor = jnp.float32(attention_factor)
        cos_BSF, sin_BSF = cos_BSF * factor, sin_BSF * factor
    cos_BSD = jnp.concatenate([cos_BSF, cos_BSF], axis=-1)
    sin_BSD = jnp.concatenate([sin_BSF, sin_BSF], axis=-1)
    return lax.optimization_barrier((cos_BSD, sin_BSD)) if cpu_tuned() else (cos_BSD, sin_BSD)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _turned32(x: jax.Array) -> jax.Array:
    """`_rotate_half(x)` in float32. Off the CPU it is one product with the signed permutation: slicing a head's
    features in halves splits each vector's lanes, which an accelerator's tiled layout pads and shuffles, where
    its matrix unit multiplies them whole. Exact either way: each output is one input, negated or not (a
    float32 input is multiplied at the highest precision, a bfloat16 one exactly in one pass)."""
    if jax.default_backend() == "cpu":
        return _rotate_half(x.astype(jnp.float32))
    width, half = x.shape[-1], x.shape[-1] // 2
    turn = np.zeros((width, width), np.float32)
    turn[np.arange(half) + half, np.arange(half)] = -1.0  # output j < half reads -x[j + half]
    turn[np.arange(half), np.arange(half) + half] = 1.0  # output j >= half reads x[j - half]
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    return jnp.matmul(x, jnp.asarray(turn, x.dtype), precision=precision, preferred_element_type=jnp.float32)


def _rotate(x, cos_BSD: jax.Array, sin_BSD: jax.Array, heads_axis: int = 2) -> jax.Array:
    x32 = x.astype(jnp.float32)
    cos, sin = jnp.expand_dims(cos_BSD, heads_axis), jnp.expand_dims(sin_BSD, heads_axis)
    return (x32 * cos + _turned32(x) * sin).astype(x.dtype)


def apply_partial_rotary(x: jax.Array, cos_BSW: jax.Array, sin_BSW: jax.Array, heads_axis: int = 2) -> jax.Array:
    """`apply_rotary` on the first `W` features of each head (the tables' width), the others as they are."""
    width = cos_BSW.shape[-1]
    if width == x.shape[-1]:
        return apply_rotary(x, cos_BSW, sin_BSW, heads_axis)
    return jnp.concatenate([apply_rotary(x[..., :width], cos_BSW, sin_BSW, heads_axis), x[..., width:]], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def apply_rotary(x: jax.Array, cos_BSD: jax.Array, sin_BSD: jax.Array, heads_axis: int = 2) -> jax.Array:
    """Rotate `x` `[B, S, H, D]` (or, with `heads_axis` 1, heads-major `[B, H, S, D]`) by the tables
    `[B, S, D]` in float32 and round back to `x`'s dtype.

    The backward pass rotates the cotangent back (the same tables, `sin` negated: the rotation's
    transpose is its inverse) in one elementwise pass. Differentiated as written, the slices, pads
    and sums of `rotate_half`'s transpose fused with the attention's head transpose into a loop
    XLA's CPU backend runs slowly in bfloat16 (docs/performance.md).
    """
    return _rotate(x, cos_BSD, sin_BSD, heads_axis)


def _apply_rotary_forward(x, cos_BSD, sin_BSD, heads_axis):
    return _rotate(x, cos_BSD, sin_BSD, heads_axis), (x, cos_BSD, sin_BSD)


def _apply_rotary_backward(heads_axis, saved, g):
    x, cos_BSD, sin_BSD = saved
    g32 = g.astype(jnp.float32)
    cos, sin = jnp.expand_dims(cos_BSD, heads_axis), jnp.expand_dims(sin_BSD, heads_axis)
    dx = (g32 * cos - _turned32(g) * sin).astype(x.dtype)
    # The tables' own cotangents, summed over heads (unused, and so never computed, when the tables
    # come from integer positions).
    x32 = x.astype(jnp.float32)
    dcos_BSD = jnp.sum(g32 * x32, axis=heads_axis).astype(cos_BSD.dtype)
    dsin_BSD = jnp.sum(g32 * _turned32(x), axis=heads_axis).astype(sin_BSD.dtype)
    return dx, dcos_BSD, dsin_BSD


apply_rotary.defvjp(_apply_rotary_forward, _apply_rotary_backward)
