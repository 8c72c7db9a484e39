"""The train step under the allocators a user can preload, side by side: glibc as it is, glibc with its
transparent-huge-page tunable, jemalloc and tcmalloc (Debian's libjemalloc2 and libtcmalloc-minimal4).

    python -m benchmarks.allocators [--shape quickstart] [--dtype float32] [--accumulation 4] [--steps 8]
                                    [--rounds 6]

XLA's CPU runtime takes each execution's temporaries as one block of tens of MiB; glibc maps such a block
afresh and unmaps it on free, so each step faults it in and the kernel clears it again. Each allocator runs
the same compiled step in its own process (`dew launch --allocator ...`, the documented launcher); the
processes take turns for `--rounds` rounds of `--steps` steps, and each one reports its median seconds a
step with the page faults and system time a step took. The ratios are against glibc as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.common import machine

ALLOCATORS = ("glibc", "glibc-thp", "jemalloc", "tcmalloc")


def child(shape: str, dtype: str, accumulation: int, steps: int) -> None:
    """Run in the launched process: compile the step, then answer each round on stdin with its timings."""
    import jax.numpy as jnp

    from benchmarks.train_step import SHAPES, dew_runner

    layers, sizes = SHAPES[shape]
    run, _, _ = dew_runner(sizes["vocab"], sizes["seq"], sizes["batch"], jnp.dtype(dtype), accumulation, shape=layers)
    for _ in range(2):
        run()
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        seconds, before = [], resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(steps):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"seconds": statistics.median(seconds), "faults": (after.ru_minflt - before.ru_minflt) / steps,
                          "system_s": (after.ru_stime - before.ru_stime) / steps}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="quickstart")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches a step (the quick start's 4)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.shape, args.dtype, args.accumulation, args.steps)
        return 0
    dew = os.path.join(os.path.dirname(sys.executable), "dew")
    processes = {}
    for allocator in args.allocators.split(","):
        command = [dew, "launch", "--allocator", allocator.removesuffix("-thp"),
                   *(["--huge-pages"] if allocator.endswith("-thp") else []), "--", sys.executable, "-m",
                   "benchmarks.allocators", "--child", "--shape", args.shape, "--dtype", args.dtype,
                   "--accumulation", str(args.accumulation), "--steps", str(args.steps)]
        processes[allocator] = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(processes[allocator].stdout.readline())["ready"]
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f} at the start")
    print(f"shape {args.shape}, {args.dtype}, {args.accumulation} micro-batches, {args.rounds} rounds of {args.steps} "
          "steps, allocators in turn")
    results = {name: [] for name in processes}
    for _ in range(args.rounds):
        for name, process in processes.items():
            process.stdin.write("round\n")
            process.stdin.flush()
            results[name].append(json.loads(process.stdout.readline()))
    for process in processes.values():
        process.stdin.close()
        process.wait(timeout=60)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    base = [r["seconds"] for r in results["glibc"]] if "glibc" in results else None
    for name, rounds in results.items():
        seconds = [r["seconds"] for r in rounds]
        ratio = "" if base is None else (f", glibc's time over its own: median of rounds "
                                         f"{statistics.median(b / s for b, s in zip(base, seconds)):.3f}x")
        print(f"{name:<10} {statistics.median(seconds) * 1e3:7.1f} ms a step (rounds {min(seconds) * 1e3:.1f}-"
              f"{max(seconds) * 1e3:.1f}), {statistics.median(r['faults'] for r in rounds):8.0f} page faults and "
              f"{statistics.median(r['system_s'] for r in rounds) * 1e3:5.1f} ms system time a step{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
