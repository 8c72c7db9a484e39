"""Single matrix products at the train step's shapes: XLA's, oneDNN's (dew.kernels.matmul) and torch's.

    python -m benchmarks.matmul [--rows 4096] [--width 256] [--mlp 1024] [--rounds 9]

For each product a linear layer runs in a step (forward `x W`, input gradient `dY W^T`, weight
gradient `x^T dY`) at `rows` tokens, in float32 and bfloat16 (float32 accumulation), prints GFLOP/s
of each side, the median of rounds in which the three run back to back, and the choice the kernel
policy `auto` makes for the shape on this CPU class (the kernel table, `benchmarks.kernel_table`).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import machine
from dew.kernels import matmul as fast_matmul
from dew.kernels.policy import choose_onednn


def seconds_of(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--mlp", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    import torch

    available, why = fast_matmul.status(policy="native")
    print(f"machine: {machine()}, torch {torch.__version__} with {torch.get_num_threads()} threads")
    print(f"oneDNN products: {why}")
    bfloat16, why_not = fast_matmul.status(jnp.bfloat16, policy="native")
    if not bfloat16:
        print(f"bfloat16: {why_not}")
    if not available:
        raise SystemExit("nothing to compare: oneDNN's path is off here")
    n, d, f = args.rows, args.width, args.mlp
    # (name, m, k, n, transpose_a, transpose_b): op(a) is m x k, op(b) is k x n.
    products = [("x W (up)", n, d, f, False, False), ("x W (down)", n, f, d, False, False),
                ("dY W^T (up)", n, f, d, False, True), ("dY W^T (down)", n, d, f, False, True),
                ("x^T dY (up)", d, n, f, True, False), ("x^T dY (down)", f, n, d, True, False)]
    rng = np.random.default_rng(0)
    print(f"{'product':<15} {'dtype':<9} {'shape (m x k x n)':<20} {'XLA':>6} {'oneDNN':>7} {'torch':>6}  auto picks")
    for dtype, torch_dtype in ((jnp.float32, torch.float32), (jnp.bfloat16, torch.bfloat16)):
        for name, m, k, cols, transpose_a, transpose_b in products:
            a_np = rng.standard_normal((k, m) if transpose_a else (m, k), np.float32)
            b_np = rng.standard_normal((cols, k) if transpose_b else (k, cols), np.float32)
            a, b = jnp.asarray(a_np, dtype), jnp.asarray(b_np, dtype)
            ta, tb = torch.from_numpy(a_np).to(torch_dtype), torch.from_numpy(b_np).to(torch_dtype)
            ta, tb = (ta.T if transpose_a else ta), (tb.T if transpose_b else tb)
            library = fast_matmul.status(dtype, policy="native")[0]
            sides = {side: jax.jit(functools.partial(run, transpose_a=transpose_a, transpose_b=transpose_b))
                     for side, run in (("xla", functools.partial(fast_matmul.xla_product, cpu_layout=True)),
                                       ("onednn", fast_matmul.onednn_product))
                     if library or side == "xla"}
            runs = {side: (lambda call=call: call(a, b).block_until_ready()) for side, call in sides.items()}
            runs["torch"] = lambda: ta @ tb
            for run in runs.values():
                run()
            samples = {side: [] for side in runs}
            for _ in range(args.rounds):
                for side, run in runs.items():
                    samples[side].append(seconds_of(run))
            rate = {side: 2 * m * k * cols / statistics.median(times) / 1e9 for side, times in samples.items()}
            picks = "oneDNN" if choose_onednn(1, m, k, cols, dtype, transpose_a, transpose_b, jnp.float32, "auto") else "XLA"
            onednn = f"{rate['onednn']:7.0f}" if "onednn" in rate else f"{'-':>7}"
            print(f"{name:<15} {jnp.dtype(dtype).name:<9} {f'{m} x {k} x {cols}':<20} {rate['xla']:6.0f} "
                  f"{onednn} {rate['torch']:6.0f}  {picks}")


if __name__ == "__main__":
    main()
