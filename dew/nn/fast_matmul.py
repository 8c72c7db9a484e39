"""Matrix products of the linears, run by oneDNN where a measurement on this machine finds it faster.

XLA's CPU backend runs a linear's products at 60-100% of what a tuned BLAS reaches on the same
shapes, and its bfloat16 products that contract the leading axis (a weight gradient `x^T dY`) at
30-40% of it. `product(a, b, transpose_a, transpose_b)` is the one entry of every linear's products
(forward, input gradient and weight gradient: `dot`, under `dew.nn.linear.matmul`) and of attention's
scores and weighted values (`dew.nn.attention.attend`): it emits either XLA's own `dot_general`
or a call through `jax.ffi` to oneDNN's row-major gemm (`dnnl_sgemm`, `dnnl_gemm_bf16bf16f32`; the
`onednn-cpu-gomp` wheel, loaded at run time by the extension `dew._native_gemm` that `pip install`
builds from `native/gemm.cc`). Both accumulate in float32 and return float32. oneDNN's bfloat16 gemm
needs AVX512-core or AVX2-VNNI-2: it is asked once (`status(jnp.bfloat16)`), and on other CPUs
(AVX2-only ones) bfloat16 products stay XLA's.

Which one runs is decided per product shape (rows, contraction, columns, dtype, transposes) by
timing both on this machine once (`measure`); the choice is kept in memory and in a JSON file under
`$XDG_CACHE_HOME/dew/matmul/` (default `~/.cache`), one file per CPU (its model name, the
instruction-set flags the kernel dispatch reads, the usable core count) and library version, so a
machine never reuses another's measurement. Products under 2^24 FLOPs stay XLA's without a
measurement (a call's fixed cost and lost fusions outweigh any gain; the test suite's tiny models
never leave XLA). `DEW_FAST_MATMUL` sets the policy:

- `auto` (the default): measured, as above;
- `on`: oneDNN for every product it can take, whatever the size (the tests of this path use it);
- `off`: XLA only.

The policy is read when a step is traced: a function already compiled keeps the products it chose.

The library path is off, with `status()` saying why, where the extension did not build, the wheel is
absent (not x86-64 Linux), the backend is not the CPU, or the process sees more than one device
(GSPMD cannot partition a foreign call, so sharded steps keep XLA's products).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dew.files import write_atomically
from dew.nn.native import import_extension, several_devices

MODES = ("auto", "on", "off")
MIN_FLOPS = 2**24  # below this a product stays XLA's in `auto`: a measured win there is noise
_DIST = "onednn-cpu-gomp"
_F32, _BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# (operands' dtype, result's dtype) -> the handler: bfloat16 results are rounded inside the call.
_TARGETS = {(_F32, _F32): "dew_gemm_f32", (_BF16, _F32): "dew_gemm_bf16", (_BF16, _BF16): "dew_gemm_bf16_to_bf16"}
# Part of the cache file's name: a change to how native/gemm.cc runs a product, or to how `measure`
# times one, invalidates old choices.
_KERNEL_VERSION = 6  # 6: wide lone products split by columns
_MARGIN = 0.97  # oneDNN must take at most 97% of XLA's time to be chosen: a tie keeps XLA's fusions


def mode() -> str:
    """The policy from `DEW_FAST_MATMUL` (`auto` when unset)."""
    value = os.environ.get("DEW_FAST_MATMUL", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"DEW_FAST_MATMUL={value!r} is not a policy: use one of {', '.join(MODES)}")
    return value


@functools.cache
def _load() -> tuple[bool, str]:
    """(whether oneDNN's products are registered with XLA, a sentence saying which library or why not)."""
    _native_gemm, why = import_extension("gemm")
    if _native_gemm is None:
        return False, why
    try:
        library, address = library_functions()
    except LookupError as error:
        return False, str(error)
    # Each piece of a product runs single-threaded on one of XLA's threads (native/gemm.cc); the
    # library's OpenMP runtime, found through its own dependencies, is told so per thread.
    _native_gemm.set_gemm(address["dnnl_sgemm"], address["dnnl_gemm_bf16bf16f32"], address["omp_set_num_threads"],
                          address["omp_get_max_threads"])
    for key, capsule in _native_gemm.handlers().items():
        jax.ffi.register_ffi_target(f"dew_gemm_{key}", capsule, platform="cpu")
    return True, f"oneDNN {metadata.version(_DIST)} ({library})"


@functools.cache
def library_functions() -> tuple[Path, dict[str, int]]:
    """(oneDNN's shared library, the addresses of its gemm entry points and of its OpenMP runtime's
    thread-count functions), which Dew's kernels call (native/gemm.cc's products, `dew.nn.fast_softmax`'s
    attention); LookupError saying why where it cannot load."""
    library = _library_path()
    try:
        dnnl = ctypes.CDLL(str(library))
    except OSError as error:
        raise LookupError(f"{library} did not load ({error})") from None
    names = ("dnnl_sgemm", "dnnl_gemm_bf16bf16f32", "omp_set_num_threads", "omp_get_max_threads")
    return library, {name: ctypes.cast(getattr(dnnl, name), ctypes.c_void_p).value for name in names}



def _library_path() -> Path:
    try:
        files = metadata.files(_DIST) or []
    except metadata.PackageNotFoundError:
        raise LookupError(f"the {_DIST} wheel is not installed (it exists for x86-64 Linux only)") from None
    for file in files:
        if file.name.startswith("libdnnl.so"):
            return Path(file.locate()).resolve()
    raise LookupError(f"the {_DIST} wheel holds no libdnnl.so")


def process_off() -> str | None:
    """Why this process keeps every native kernel out of its steps (`DEW_FAST_MATMUL=off`, several
    devices), or None; `dew.nn.fast_softmax` follows the same policy."""
    return "turned off by DEW_FAST_MATMUL=off" if mode() == "off" else several_devices()


def status(dtype=_F32) -> tuple[bool, str]:
    """(whether products of `dtype` operands may run in oneDNN in this process, why or why not)."""
    off = process_off()
    if off:
        return False, off
    available, why = _load()
    if available and jnp.dtype(dtype) == _BF16:
        return _bfloat16()
    return available, why


@functools.cache
def _bfloat16() -> tuple[bool, str]:
    """Whether oneDNN's bfloat16 gemm runs on this CPU: it needs AVX512-core (or AVX2-VNNI-2) and says
    `dnnl_unimplemented` elsewhere (AVX2-only CPUs), where bfloat16 products stay XLA's. Asked once,
    with a 1 x 1 x 1 product."""
    gemm = ctypes.CDLL(str(_library_path())).dnnl_gemm_bf16bf16f32
    gemm.restype = ctypes.c_int
    size, pointer, real = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    gemm.argtypes = [ctypes.c_char, ctypes.c_char, size, size, size, real, pointer, size, pointer, size, real,
                     pointer, size]
    one, two, out = np.array([0x3F80], np.uint16), np.array([0x4000], np.uint16), np.zeros(1, np.float32)
    code = gemm(b"N", b"N", 1, 1, 1, 1.0, one.ctypes.data, 1, two.ctypes.data, 1, 0.0, out.ctypes.data, 1)
    if code != 0 or out[0] != 2.0:
        return False, (f"oneDNN's bfloat16 gemm is unavailable on this CPU (status {code}: it needs AVX512-core "
                       "or AVX2-VNNI-2); bfloat16 products stay XLA's")
    return True, f"oneDNN {metadata.version(_DIST)} (bfloat16 gemm)"


def _xla(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool, out_dtype=_F32) -> jax.Array:
    if transpose_a:
        # `a^T` laid out as its own array: XLA's CPU backend sends a dot contracting the leading axis of
        # both operands to Eigen, and a plain one to its faster matmul. The barrier keeps XLA from
        # folding the transpose back into the dot.
        a = lax.optimization_barrier(jnp.swapaxes(a, -1, -2))
    contract_b = b.ndim - 1 if transpose_b else b.ndim - 2
    batch = tuple(range(a.ndim - 2))
    out = lax.dot_general(a, b, (((a.ndim - 1,), (contract_b,)), (batch, batch)), preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _library(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool, out_dtype=_F32) -> jax.Array:
    m = a.shape[-1] if transpose_a else a.shape[-2]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    returned = jnp.dtype(out_dtype) if (a.dtype, jnp.dtype(out_dtype)) in _TARGETS else _F32
    out = jax.ShapeDtypeStruct((*a.shape[:-2], m, n), returned)
    call = jax.ffi.ffi_call(_TARGETS[a.dtype, returned], out, vmap_method="broadcast_all")
    return call(a, b, transpose_a=transpose_a, transpose_b=transpose_b).astype(out_dtype)


def product(a: jax.Array, b: jax.Array, transpose_a: bool = False, transpose_b: bool = False,
            out_dtype=jnp.float32) -> jax.Array:
    """`op(a) @ op(b)` accumulated in float32 and returned as `out_dtype` (rounded once), `op`
    transposing the last two axes where asked; `a` and `b` share a dtype and any leading (batch)
    axes. oneDNN runs it where `choose` says so, else XLA."""
    if a.dtype != b.dtype:
        raise ValueError(f"product of {a.dtype} and {b.dtype}: cast the operands to one dtype first")
    k = a.shape[-2] if transpose_a else a.shape[-1]
    if k != (b.shape[-1] if transpose_b else b.shape[-2]):
        raise ValueError(f"product of {a.shape} and {b.shape} (transpose_a={transpose_a}, "
                         f"transpose_b={transpose_b}): the contracted axes differ")
    m = a.shape[-1] if transpose_a else a.shape[-2]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    batch = int(np.prod(a.shape[:-2], dtype=np.int64))
    if choose(batch * m, k, n, a.dtype, transpose_a, transpose_b, out_dtype):
        return _library(a, b, transpose_a, transpose_b, out_dtype)
    return _xla(a, b, transpose_a, transpose_b, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dot(a: jax.Array, b: jax.Array, transpose_b: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """`a @ op(b)` over the last two axes (leading axes batch), in the operands' dtype accumulated in
    float32, returned as `out_dtype` (float32 unless asked), with `op` transposing `b` where asked. Its
    gradients are the same kind of product, with the output gradient cast to the operands' dtype and
    each gradient rounded once to its operand's dtype, which autodiff of a mixed-precision
    `dot_general` does not give; every one goes through `product`."""
    return product(a, b, transpose_b=transpose_b, out_dtype=out_dtype)


def _dot_fwd(a, b, transpose_b, out_dtype):
    return dot(a, b, transpose_b, out_dtype), (a, b)


def _dot_bwd(transpose_b, out_dtype, residuals, g):
    a, b = residuals
    g = g.astype(a.dtype)
    if transpose_b:  # c = a b^T: da = g b, db = g^T a
        da = product(g, b, out_dtype=a.dtype)
        db = product(g, a, transpose_a=True, out_dtype=b.dtype)
    else:  # c = a b: da = g b^T, db = a^T g
        da = product(g, b, transpose_b=True, out_dtype=a.dtype)
        db = product(a, g, transpose_a=True, out_dtype=b.dtype)
    return da, db


dot.defvjp(_dot_fwd, _dot_bwd)


def choose(m: int, k: int, n: int, dtype, transpose_a: bool, transpose_b: bool, out_dtype=_F32) -> bool:
    """Whether an `[m, k] x [k, n]` product in `dtype` returning `out_dtype` runs in oneDNN (see the
    module's policy)."""
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
    if (dtype, _F32) not in _TARGETS or min(m, k, n) == 0 or not status(dtype)[0]:
        return False
    if mode() == "on":
        return True
    if 2 * m * k * n < MIN_FLOPS:
        return False
    key = f"{m}x{k}x{n}/{dtype.name}/{'T' if transpose_a else 'N'}{'T' if transpose_b else 'N'}"
    key += "" if out_dtype == _F32 else f"/{out_dtype.name}"
    table = _table()
    if key not in table:
        xla_seconds, library_seconds = measure(m, k, n, dtype, transpose_a, transpose_b, out_dtype=out_dtype)
        table[key] = {"xla_s": xla_seconds, "onednn_s": library_seconds,
                      "onednn": library_seconds < _MARGIN * xla_seconds}
        _save(table)
    return bool(table[key]["onednn"])


def measure(m: int, k: int, n: int, dtype, transpose_a: bool, transpose_b: bool,
            rounds: int = 9, out_dtype=_F32, together: int = 4) -> tuple[float, float]:
    """(XLA's seconds, oneDNN's seconds) for one product: each side's fastest of `rounds` rounds.

    A round times `together` independent products of the shape in one compiled call (per product),
    XLA's then oneDNN's back to back. Several at once, as a step's backward pass runs a linear's input
    and weight gradients side by side, keep XLA's threads awake and busy the way they are inside a
    step: timed alone, a product of a millisecond or less mostly measures how fast the sleeping
    threads wake, and its ratio swung between 0.5x and 1.8x from run to run on one machine. Other
    work on the machine only ever adds time, so each side's fastest round is its own speed."""
    available, reason = _load()
    if available and jnp.dtype(dtype) == _BF16:
        available, reason = _bfloat16()
    if not available:
        raise RuntimeError(f"oneDNN's products are off: {reason}")
    rng = np.random.default_rng(0)
    shapes = ((k, m) if transpose_a else (m, k), (n, k) if transpose_b else (k, n))
    operands = [rng.standard_normal(shape, np.float32) for _ in range(together) for shape in shapes]

    def batched(run):
        one = functools.partial(run, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
        return jax.jit(lambda *xs: [one(a, b) for a, b in zip(xs[::2], xs[1::2])])

    with jax.ensure_compile_time_eval():
        operands = [jnp.asarray(x, dtype) for x in operands]
        runs = [batched(run) for run in (_xla, _library)]
        for run in runs:
            jax.block_until_ready(run(*operands))
        best = [float("inf")] * len(runs)
        for _ in range(rounds):
            for side, run in enumerate(runs):
                started = time.perf_counter()
                jax.block_until_ready(run(*operands))
                best[side] = min(best[side], (time.perf_counter() - started) / together)
    return best[0], best[1]


def cache_file() -> Path:
    """This machine's file of measured choices (see the module docstring)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                flags += line.split(":", 1)[1].strip() + "\n"
            if line.startswith("flags"):
                break
    except OSError:
        flags = platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    signature = f"{flags}{cores}\n{jax.__version__}\n{metadata.version(_DIST)}\n{_KERNEL_VERSION}"
    digest = hashlib.sha256(signature.encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "dew" / "matmul" / f"{digest}.json"


@functools.cache
def _table() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _save(table: dict) -> None:
    """Write this process's choices, merged with what other processes wrote since it read the file."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            on_disk = json.loads(path.read_text())
        except (OSError, ValueError):
            on_disk = {}
        table.update({key: value for key, value in on_disk.items() if key not in table})
        write_atomically(path, json.dumps(table, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home: the choices stay in memory for this process
