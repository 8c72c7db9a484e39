"""Products with a weight kept in GGUF's quantized blocks, the layout llama.cpp's files hold: `x @ w.T`.

A blocks weight is a uint8 array `[F, K / E, B]`: each of its F rows (an output) is K / E blocks of B
bytes holding E consecutive inputs' values and their scales. The block's byte count names its kind
(`KINDS`): Q4_0 (18 bytes for 32 values, `d * (q - 8)`), Q4_1 (20 for 32, `d * q + m`), Q8_0 (34 for
32, `d * q`) and Q4_K (144 for 256: eight sub-blocks of 32 with 6-bit sub-scales and sub-mins, `d *
sc * q - dmin * m`). A 4-bit kind moves 4.5 or 5 bits a weight, a seventh or less of float32's bytes.

Decoding reads every weight once per token. Dew's kernel (`native/blocks.cc`, the extension
`dew._native_blocks`, called through `jax.ffi`) widens each sub-block's 32 values to float32 in
registers, sums their products with x in float32 and multiplies that sum by the sub-block's scale
(AVX-512, AVX2 or portable loops, chosen by what the CPU reports at run time, across XLA's intra-op
threads). XLA's form (`xla_product`) dequantizes the weight to float32 (`dequantize`, exactly what gguf's
own dequantization gives) and runs the linears' float32 product: it serves products of more than
`KERNEL_MAX_ROWS` rows (a prefill, arithmetic-bound) and every product where the kernel policy keeps
native kernels out of the step (`dew.kernels.policy`). Both accumulate in float32 and differ by the order
of their roundings.

Decoding-shaped products of every kind take the kernel's integer path under the kernel policies `auto`
(the default) and `native`: each block of 32 values of a row of x (a Q4_K sub-block's) is rounded to two
layers of 8-bit integers, `d = max|x| / 127`, `q1 = round(x / d)` (ties to even: llama.cpp's rounding of
activations) and `q2 = round((x / d - q1) * 254)`, x taken as `d q1 + d / 254 q2`, within 1/64,516 of
the block's largest |x| a value; the products with the weight's integers are exact in int32, then scaled
in float32: each layer's apart (AVX-512 VNNI loops), or the two joined into one int16 a value,
`254 q1 + q2`, scaled by `d / 254` (AVX2 and portable loops, by the CPU). That is the float32 product of
the dequantized weight with the rounded x, up to the order of float32 roundings.
(The first layer alone, llama.cpp's arithmetic, changed SmolLM2's greedy text from float32's after five
tokens; the second keeps it: docs/performance.md.) The policy `exact` (`DecoderConfig.kernels`,
`load_pretrained(..., kernels="exact")` or `DEW_KERNELS=exact`) keeps x in float32 in the kernel, the
exact path; products of more rows than `KERNEL_MAX_ROWS` and products XLA runs are exact under every
policy. `kernel_status()` says which path runs, and a `dew.kernels.policy.recording()` names
each rounded product `blocks-q8/...`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dew.kernels.loader import import_extension
from dew.kernels.matmul import dot, layer_index
from dew.kernels.policy import calls_refused, in_force, note

_TARGET = "dew_blocks_product"
_ROUNDED_TARGET = "dew_blocks_rounded_product"
ROUNDED_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")  # the kinds the integer path multiplies: all of them
ROUNDING_POLICIES = ("auto", "native")  # the kernel policies under which it runs
# Each kind by its block's bytes: (name, values per block).
KINDS = {18: ("Q4_0", 32), 20: ("Q4_1", 32), 34: ("Q8_0", 32), 144: ("Q4_K", 256)}
BYTES = {name: size for size, (name, _) in KINDS.items()}
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Rows of x up to which the kernel runs (decoding); more rows are arithmetic-bound, where XLA's float32
# product of the dequantized weight is faster.
KERNEL_MAX_ROWS = 32


def kind(w: jax.Array) -> tuple[str, int]:
    """(the kind's name, values per block) of a blocks weight `[..., F, blocks, bytes]`, or a clear error."""
    if w.dtype != jnp.uint8 or w.ndim < 3 or w.shape[-1] not in KINDS:
        known = ", ".join(f"{name} ({size} bytes)" for size, (name, _) in KINDS.items())
        raise ValueError(f"a blocks weight is uint8 [..., F, blocks, bytes] with blocks of {known}; got {w.dtype} "
                         f"{w.shape}: load the GGUF file's blocks (dew.interop.gguf_blocks)")
    return KINDS[w.shape[-1]]


def inputs(w: jax.Array) -> int:
    """K, the inputs of each row of a blocks weight."""
    return w.shape[-2] * kind(w)[1]


def _halves(b: jax.Array, at: int) -> jax.Array:
    """The float16 at byte `at` of every block, as float32 `[..., 1]`."""
    return lax.bitcast_convert_type(b[..., at:at + 2], jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(qs: jax.Array) -> jax.Array:
    """Bytes `[..., n]` as their low nibbles then their high ones, `[..., 2n]` int32."""
    qs = qs.astype(jnp.int32)
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def dequantize(w: jax.Array) -> jax.Array:
    """float32 `[..., F, K]` of a blocks weight `[..., F, K / E, B]`, as gguf's dequantization computes it
    (each value `d * q + m` rounded once in float32; Q4_K's `d * sc` and `dmin * m` rounded first)."""
    name, values = kind(w)
    if name == "Q4_0":
        blocks = _halves(w, 0) * (_nibbles(w[..., 2:]) - 8).astype(jnp.float32)
    elif name == "Q4_1":
        blocks = _halves(w, 0) * _nibbles(w[..., 4:]).astype(jnp.float32) + _halves(w, 2)
    elif name == "Q8_0":
        blocks = _halves(w, 0) * lax.bitcast_convert_type(w[..., 2:], jnp.int8).astype(jnp.float32)
    else:  # Q4_K: 12 bytes of eight 6-bit sub-scales and sub-mins, then 4 x 32 bytes of nibbles
        s = w[..., 4:16].astype(jnp.int32)
        scale = jnp.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        low = jnp.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = w[..., 16:].reshape(*w.shape[:-1], 4, 32).astype(jnp.int32)
        q = jnp.stack([qs & 15, qs >> 4], axis=-2).reshape(*w.shape[:-1], 8, 32).astype(jnp.float32)
        d = _halves(w, 0) * scale.astype(jnp.float32)
        m = _halves(w, 2) * low.astype(jnp.float32)
        blocks = (d[..., None] * q - m[..., None]).reshape(*w.shape[:-1], values)
    return blocks.reshape(*w.shape[:-2], w.shape[-2] * values)


@functools.cache
def _load():
    """(the extension, its kernels registered with XLA; "") or (None, why it did not load)."""
    native, why = import_extension("blocks")
    if native is None:
        return None, why
    handlers = native.handlers()
    jax.ffi.register_ffi_target(_TARGET, handlers["product"], platform="cpu")
    jax.ffi.register_ffi_target(_ROUNDED_TARGET, handlers["rounded_product"], platform="cpu")
    return native, ""


def kernel_status(policy: str | None = None) -> tuple[bool, str]:
    """(whether blocks products run in Dew's kernel under `policy` (default the one in force) in this
    process, which loops it runs and how it takes x, or why not)."""
    refused = calls_refused(policy)
    if refused:
        return False, refused
    native, why = _load()
    if native is None:
        return False, why
    loops = f"dew._native_blocks with {native.isa()} loops"
    if in_force(policy) not in ROUNDING_POLICIES:
        return True, f"{loops}, x in float32 (the exact path: the policy is {in_force(policy)})"
    return True, (f"{loops}; {', '.join(ROUNDED_KINDS)} round x to two 8-bit layers a block of 32 "
                  f"({native.rounded_isa()} integer loops)")


def rounds(w: jax.Array, policy: str | None = None) -> bool:
    """Whether the kernel's product with the blocks weight `w` rounds x under `policy` (default the one in
    force): `auto` or `native` (the integer path multiplies every kind)."""
    return in_force(policy) in ROUNDING_POLICIES and kind(w)[0] in ROUNDED_KINDS


def kernel_product(x_NK: jax.Array, w: jax.Array, rounded: bool = False, layer: jax.Array | None = None) -> jax.Array:
    """`x @ w.T` as float32 `[N, F]` in Dew's kernel: `x` float32 `[N, K]`, `w` a blocks weight
    `[F, K / E, B]`, or with `layer` (an int32 scalar) a stack of them `[L, F, K / E, B]` of which
    `w[layer]` is taken, read in place (a scanned decoder's stacked weights, which slicing would copy);
    with `rounded`, x rounded to two 8-bit layers a block first (the integer path). Raises where
    `kernel_status()` is off."""
    on, why = kernel_status()
    if not on:
        raise RuntimeError(f"the blocks kernel is off: {why}")
    stack = w if layer is not None else w[None]
    if x_NK.dtype != jnp.float32 or x_NK.ndim != 2 or stack.ndim != 4:
        raise ValueError(f"the blocks kernel takes float32 x [N, K] and w [F, K / E, B] (with a layer, [L, F, K / E, "
                         f"B]), not {x_NK.dtype} {x_NK.shape} and {w.shape}")
    if inputs(w) != x_NK.shape[1]:
        raise ValueError(f"x has {x_NK.shape[1]} inputs and the blocks weight {w.shape} holds {inputs(w)} a row")
    out = jax.ShapeDtypeStruct((x_NK.shape[0], stack.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(_ROUNDED_TARGET if rounded else _TARGET, out, vmap_method="sequential")
    return call(x_NK, stack, layer_index(layer))


def xla_product(x_NK: jax.Array, w: jax.Array, dtype, layer: jax.Array | None = None) -> jax.Array:
    """The other form of `blocks_product`: `w` (or `w[layer]`) dequantized to float32, then the linears'
    float32 product of `x` rounded to `dtype`."""
    w = w if layer is None else w[layer]
    return dot(x_NK.astype(dtype).astype(jnp.float32), dequantize(w), transpose_b=True)


def kernel_takes(x_NK: jax.Array, w: jax.Array, dtype, policy: str | None = None) -> bool:
    """Whether `blocks_product` of these operands runs in the kernel under `policy` here: a compute
    dtype float32 holds exactly, at most `KERNEL_MAX_ROWS` rows of x, and `kernel_status()` on."""
    taken = (jnp.dtype(dtype) in _KERNEL_DTYPES and x_NK.ndim == 2 and w.ndim == 3
             and x_NK.shape[0] <= KERNEL_MAX_ROWS and kernel_status(policy)[0])
    path = "blocks-q8" if taken and rounds(w, policy) else "blocks"
    note(f"{path}/{kind(w)[0]}/{x_NK.shape[0]}x{inputs(w)}x{w.shape[0]}", "dew" if taken else "xla")
    return taken


def blocks_product(x_NK: jax.Array, w: jax.Array, dtype, layer: jax.Array | None = None) -> jax.Array:
    """`x @ w.T` as float32 `[N, F]`, `x` in the compute `dtype`, `w` a blocks weight `[F, K / E, B]` (or
    with `layer`, an int32 scalar, a stack of them `[L, F, K / E, B]`, of which `w[layer]`): Dew's kernel
    where `kernel_takes` says so (rounding x where `rounds(w)`), else `xla_product`."""
    one = w if layer is None else jax.ShapeDtypeStruct(w.shape[1:], w.dtype)
    if kernel_takes(x_NK, one, dtype):
        return kernel_product(x_NK.astype(dtype).astype(jnp.float32), w, rounded=rounds(w), layer=layer)
    return xla_product(x_NK, w, dtype, layer)
