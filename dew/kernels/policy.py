"""Which kernel runs each product: a pure function of the policy, the CPU's class, the shape and the dtype.

A policy is one of `POLICIES`:
- `auto` (the default): on the CPU, a product runs in oneDNN where the kernel table
  (`dew/kernels/table.json`, measured by `python -m benchmarks.kernel_table`) says oneDNN was faster for the
  nearest measured shape of this CPU class, dtype and transposes, and XLA's otherwise; a float32 product of
  at most `FEW_ROWS` rows (a decode step's linear) runs in Dew's few-rows kernel where the table's nearest
  entry says that was faster (`"few_rows": true`, measured by `python -m benchmarks.long_context
  --products`); a bfloat16 product of 2 to `BFLOAT16_FEW_ROWS` rows (1 to `FEW_ROWS` with AMX) runs in
  the few-rows kernel (`choose_bfloat16_few_rows`), any other of at most `FEW_ROWS` rows in oneDNN
  wherever its bfloat16 gemm runs; a bfloat16 product of a scanned layer read in place, of
  `BFLOAT16_PREFILL_ROWS` rows (a prefill's), runs in the kernel's AMX body where the CPU has AMX's tiles
  (`choose_bfloat16_prefill`); attention's softmax, the fused attention, decoding's attention and the int8
  decoding products run in Dew's own kernels wherever they can. A CPU class the table does not name, a
  product under `MIN_FLOPS` (oneDNN) or a shape far from every measured one stays XLA's.
- `native`: every product oneDNN can take runs there, whatever its size (what the kernels' tests use).
- `xla`: XLA's own `dot_general` for every product, with nothing around it: no custom call, no barrier.
- `exact`: as `auto`, except that no kernel rounds a product's operands: the GGUF blocks kernel
  multiplies x in float32 rather than rounding it to 8-bit integers (`dew.kernels.blocks`).

The policy is the model's (`DecoderConfig.kernels`), in force while the model traces (`using`); the
environment variable `DEW_KERNELS` overrides it for the whole process. Off the CPU backend every policy
is `xla`; a process that sees several devices keeps foreign calls out of its steps (GSPMD cannot partition
them) and runs XLA's products. Nothing is timed while tracing: the same model on the same machine runs the
same kernels, whatever the cache or the machine's load. `recording()` collects the choices a trace makes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import math
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp

POLICIES = ("auto", "native", "xla", "exact")
ENVIRONMENT = "DEW_KERNELS"
TABLE = Path(__file__).with_name("table.json")
MIN_FLOPS = 2**24  # below this a product stays XLA's under `auto`: a call's fixed cost outweighs any gain
# How far (a factor per dimension) the nearest measured shape may lie from a product for its choice to
# apply; a product farther from every measured shape keeps XLA's.
REACH = 2.0
FEW_ROWS = 32  # the most rows of a product Dew's few-rows kernel takes (a decode step's batch)
# The most rows of a bfloat16 product it takes under `auto`, without AMX's tiles and with them
# (choose_bfloat16_few_rows).
BFLOAT16_FEW_ROWS = 8
# The fewest and the most rows of a bfloat16 prefill product that reads its layer in place in the kernel's
# AMX body (choose_bfloat16_prefill).
BFLOAT16_PREFILL_ROWS = (64, 4096)
_RENAMED = {"DEW_FAST_MATMUL": "auto, native or xla", "DEW_INT8_KERNEL": "xla turns the int8 kernel off with the rest"}
_POLICY = contextvars.ContextVar("dew_kernels_policy", default="auto")
_RECORDERS: list[dict[str, str]] = []


def check(policy: str) -> str:
    """`policy` if it names a policy, else a ValueError naming the choices."""
    if policy not in POLICIES:
        raise ValueError(f"kernels={policy!r} is not a kernel policy: use one of {', '.join(POLICIES)}")
    return policy


def override() -> str | None:
    """The policy `DEW_KERNELS` sets for the whole process, None when it is unset."""
    for name, instead in _RENAMED.items():
        if name in os.environ:
            raise ValueError(f"{name} is no longer read: set {ENVIRONMENT} ({instead}), or the model's kernels= field")
    value = os.environ.get(ENVIRONMENT, "").strip().lower()
    if not value:
        return None
    if value not in POLICIES:
        raise ValueError(f"{ENVIRONMENT}={value!r} is not a kernel policy: use one of {', '.join(POLICIES)}")
    return value


@contextlib.contextmanager
def setting(variable: contextvars.ContextVar, value) -> Iterator[None]:
    """`variable` holds `value` inside the block (what a trace under a model's knob reads), and its own after."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def using(policy: str) -> contextlib.AbstractContextManager[None]:
    """Trace under `policy` (the model's): the products, softmaxes and int8 products traced inside take it."""
    return setting(_POLICY, check(policy))


def requested() -> str:
    """The policy asked for here: `DEW_KERNELS` where set, else the one `using` put in force (default auto)."""
    return override() or _POLICY.get()


def in_force(policy: str | None = None) -> str:
    """`policy` (default `requested()`) as it applies on this backend: `xla` off the CPU."""
    policy = requested() if policy is None else check(override() or policy)
    return policy if jax.default_backend() == "cpu" else "xla"


def cpu_tuned(policy: str | None = None) -> bool:
    """Whether a step traced under `policy` here may take the CPU backend's formulations (an array laid out
    for XLA's CPU matmul, a table held out of the fusions that would recompute it): not under `xla`."""
    return in_force(policy) != "xla"


def calls_refused(policy: str | None = None) -> str | None:
    """Why a foreign call (a native kernel) may not enter a step traced under `policy` here, or None."""
    policy = in_force(policy)
    if policy == "xla":
        where = f"the backend is {jax.default_backend()}" if jax.default_backend() != "cpu" else "the policy is xla"
        return f"{where}, so every product is XLA's own"
    if jax.device_count() > 1:
        return (f"this process sees {jax.device_count()} devices, and sharded steps keep XLA's products (GSPMD cannot "
                "partition a foreign call)")
    return None


@functools.cache
def cpu_class() -> str:
    """This CPU's class in the kernel table: the vendor and the widest vector instructions the kernels
    dispatch on (`GenuineIntel/avx512`, `AuthenticAMD/avx512_bf16`, `AuthenticAMD/avx2`, ...), with
    `/amx` where the CPU has AMX tiles."""
    vendor, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                vendor = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        isa = "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    elif {"avx2", "fma"} <= flags:
        isa = "avx2"
    else:
        isa = "baseline"
    return f"{vendor}/{isa}" + ("/amx" if "amx_tile" in flags else "")


def product_key(batch: int, m: int, k: int, n: int, dtype, transpose_a: bool, transpose_b: bool, out_dtype) -> str:
    """A product's key in the table and in recordings: `BxMxKxN/dtype/NT/out_dtype`, `batch` products of
    `[m, k] x [k, n]` (the transposes say how the operands are stored)."""
    ops = f"{'T' if transpose_a else 'N'}{'T' if transpose_b else 'N'}"
    return f"{batch}x{m}x{k}x{n}/{jnp.dtype(dtype).name}/{ops}/{jnp.dtype(out_dtype).name}"


@functools.cache
def table(path: Path = TABLE) -> dict:
    """The kernel table: `{"classes": {class: {"measured": {...provenance}, "products": {key: {"xla_s",
    "onednn_s", "onednn"}}}}}` ({} where the file is absent)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def table_digest(path: Path = TABLE) -> str | None:
    """The sha256 of the kernel table's bytes, None without one."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def parse_key(key: str) -> tuple[tuple[int, int, int, int], str]:
    """(the `(batch, m, k, n)` of a product key, the rest of it: `dtype/NT/out_dtype`)."""
    shape, rest = key.split("/", 1)
    return tuple(int(x) for x in shape.split("x")), rest


def nearest_measured(batch: int, m: int, k: int, n: int, dtype, transpose_a: bool, transpose_b: bool, out_dtype,
                     cpu: str | None = None, measured: dict | None = None) -> dict | None:
    """The table's entry for the measured product nearest `batch` products `[m, k] x [k, n]` among those of the
    same dtypes and transposes within a factor `REACH` in every dimension, on a CPU of class `cpu` (default this
    one's) by `measured` (default the shipped table's products of that class); None where there is none."""
    if measured is None:
        measured = table().get("classes", {}).get(cpu or cpu_class(), {}).get("products", {})
    wanted = parse_key(product_key(batch, m, k, n, dtype, transpose_a, transpose_b, out_dtype))[1]
    best, best_distance = None, math.inf
    for key, entry in sorted(measured.items()):
        shape, kind = parse_key(key)
        if kind != wanted:
            continue
        steps = [abs(math.log(a / b)) for a, b in zip(shape, (batch, m, k, n))]
        if max(steps) <= math.log(REACH) and sum(steps) < best_distance:
            best, best_distance = entry, sum(steps)
    return best


def choose_onednn(batch: int, m: int, k: int, n: int, dtype, transpose_a: bool, transpose_b: bool, out_dtype,
                  policy: str, cpu: str | None = None, measured: dict | None = None) -> bool:
    """Whether `batch` products `[m, k] x [k, n]` run in oneDNN under `policy` (`auto`, `exact` or
    `native`) on a CPU of class `cpu` (default this one's), by the table's `measured` products of that
    class (default the shipped table's): the choice of the nearest measured product (`nearest_measured`),
    XLA's elsewhere."""
    if policy == "native":
        return True
    # XLA's CPU dot of a few bfloat16 rows widens its operands to float32 at every call, the whole weight
    # included (docs/performance.md, "Serving in bfloat16"): 4-7x slower than oneDNN's bfloat16 gemm at one row.
    if jnp.dtype(dtype) == jnp.bfloat16 and not transpose_a and batch * m <= FEW_ROWS:
        return True
    if 2 * batch * m * k * n < MIN_FLOPS:
        return False
    best = nearest_measured(batch, m, k, n, dtype, transpose_a, transpose_b, out_dtype, cpu, measured)
    return bool(best and best["onednn"])


def choose_few_rows(m: int, k: int, n: int, policy: str, cpu: str | None = None, measured: dict | None = None) -> bool:
    """Whether the float32 product `[m, k] x [k, n]` (no transposes) runs in Dew's few-rows kernel
    (`dew.kernels.matmul`) under `policy` (`auto`, `exact` or `native`): under `auto` and `exact`, for `m` at
    most `FEW_ROWS`, where the table's nearest measured product (`nearest_measured`) says it was the fastest
    (`"few_rows": true`), however small (it is a decode step's whole linear); never under `native`, which
    sends every product to oneDNN."""
    if m > FEW_ROWS or policy not in ("auto", "exact"):
        return False
    best = nearest_measured(1, m, k, n, jnp.float32, False, False, jnp.float32, cpu, measured)
    return bool(best and best.get("few_rows"))


def choose_stacked_few_rows(m: int, k: int, n: int, policy: str) -> bool:
    """`choose_few_rows` for a product that reads its layer in place from a scanned run's stack: under
    `auto` and `exact`, 1 to `FEW_ROWS` rows take the few-rows kernel, which streams the weight once for
    all of them (oneDNN's gemm of a few rows, read in place, was slower than XLA's dot after its copy, and
    its one-row gemv slower than the kernel: docs/performance.md, "The served step's kernels")."""
    if policy in ("auto", "exact") and 1 <= m <= FEW_ROWS:
        return True
    return choose_few_rows(m, k, n, policy)


def choose_bfloat16_few_rows(m: int, k: int, n: int, policy: str, tiles: bool) -> bool:
    """Whether the bfloat16 product `[m, k] x [k, n]` (no transposes; a lone weight or a layer read in place
    from a stack) runs in Dew's few-rows kernel: under `auto` and `exact`, 1 to `FEW_ROWS` rows where the
    kernel multiplies them in AMX's tiles (`tiles`: the CPU has them and Linux granted them), else 2 to
    `BFLOAT16_FEW_ROWS`, whatever the shape. oneDNN's bfloat16 gemm of a few rows repacks the weight at every
    call; the kernel streams it once (with tiles, faster at every row count from 1 to 32 in a served step:
    docs/performance.md, "The served step's kernels"). Without tiles, one row stays with oneDNN's
    gemv, as fast, and more than `BFLOAT16_FEW_ROWS` with its gemm, as fast there (measured with oneDNN held
    to AVX-512's bfloat16 instructions). Never under `native`, which sends every product to oneDNN."""
    return policy in ("auto", "exact") and (1 if tiles else 2) <= m <= (FEW_ROWS if tiles else BFLOAT16_FEW_ROWS)


def choose_bfloat16_prefill(m: int, k: int, n: int, policy: str, tiles: bool) -> bool:
    """Whether the bfloat16 product `[m, k] x [k, n]` of a layer read in place from a scanned run's stack, past
    `FEW_ROWS` rows (a prefill's), runs in the kernel's AMX body: under `auto` and `exact`, where the kernel
    has AMX's tiles (`tiles`), for rows within `BFLOAT16_PREFILL_ROWS`. Otherwise XLA's CPU backend copies
    the layer's weight out of the stack before its dot, every product; the kernel reads it in place, and
    was faster than the copy and the dot together at those row counts, not measured beyond them, and even
    with them below (docs/performance.md, "Prefill's bfloat16 products read in place"). Without tiles the
    kernel's other bodies are slower than XLA's dot at these sizes. Never under `native`, which sends every
    product to oneDNN."""
    fewest, most = BFLOAT16_PREFILL_ROWS
    return policy in ("auto", "exact") and tiles and fewest <= m <= most


@contextlib.contextmanager
def recording() -> Iterator[dict[str, str]]:
    """Collect the choices made while tracing inside: `{product_key: "onednn" | "xla"}`, and for the
    other kernels `{"softmax/...": ...}`."""
    choices: dict[str, str] = {}
    _RECORDERS.append(choices)
    try:
        yield choices
    finally:
        _RECORDERS.remove(choices)


def note(key: str, choice: str) -> None:
    """Tell every open `recording()` that the product (or kernel) `key` took `choice`."""
    for choices in _RECORDERS:
        choices[key] = choice


def summary(choices: dict[str, str]) -> str:
    """A recording in a few words: "kernels: 6 of 20 products in oneDNN; Dew's attention, first_max", or off the
    CPU "kernels: XLA's products on tpu; attention in splash"."""
    products = [choice for key, choice in choices.items() if key[0].isdigit()]  # product keys start "BxMxKxN"
    native = sorted({key.split("/")[0] for key, choice in choices.items() if not key[0].isdigit() and choice == "dew"})
    attention = sorted({choice for key, choice in choices.items() if key.startswith("attention/")})
    if jax.default_backend() == "cpu":
        text = f"kernels: {products.count('onednn')} of {len(products)} products in oneDNN"
        if "dew" in products:
            text += f", {products.count('dew')} in Dew's few-rows kernel"
    else:
        text = f"kernels: XLA's products on {jax.default_backend()}"
    text += f"; Dew's {', '.join(native)}" if native else ""
    return text + (f"; attention in {', '.join(attention)}" if attention else "")


def describe(policy: str = "auto") -> dict:
    """What decides the kernels of a model whose policy is `policy`, for a run's record: the policy asked
    for, the override, the policy in force, the backend, the CPU class, whether the table has measured it,
    and the table's digest."""
    return {"policy": policy, "override": override(), "in_force": in_force(policy), "backend": jax.default_backend(),
            "cpu_class": cpu_class(), "measured_class": cpu_class() in table().get("classes", {}),
            "table_sha256": table_digest()}
