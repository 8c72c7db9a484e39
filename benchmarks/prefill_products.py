"""A bfloat16 prefill's linears against a scanned run's stacked weights (SmolLM2-135M's shapes, 30 layers):
each layer's weight read in place by Dew's kernel (`dew.kernels.matmul.stacked_product`, AMX's tiles) against
the path it replaced, XLA's copy of the layer out of the stack and the product after it, in alternating rounds.

    PYTHONPATH=. python -m benchmarks.prefill_products [--rows 64 128 512 1024] [--rounds 9] [--float32 | --gated]

`--float32` compares, for float32 products, the same copy and product against oneDNN's stacked gemm
reading the layer in place (`matmul.onednn_stacked_product`), which float32 prefills do not take yet.
`--gated` compares a gated feed-forward, `down(silu(x gate) * (x up))` (SmolLM2's shapes): the gate and up
products read in place and XLA's fusion of the activation after them (the "before" side) against the kernel's
one call (`matmul.stacked_gated_product`), the same bits; the down projection, the same on both sides, reads
the whole activation (XLA would otherwise compute only the element the scan keeps).

Each side runs one `lax.scan` over the 30 layers, as a scanned decoder's prefill does; the figures are per
layer. Prints each side's median and fastest microseconds over rounds in which both run back to back, the
ratio of the medians, the kernel's GFLOP/s at its median, and the load average.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import alternating, compared, machine
from dew.kernels import matmul
from dew.kernels.policy import FEW_ROWS

LAYERS = 30
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # [K, N]: q and o, k and v, gate and up, down


def scanned(product):
    """One product a layer over stacks `[LAYERS, K, N]` of uint16 bits, as a scanned prefill runs them."""
    def run(x, *stacks):
        def layer(total, index):
            return total + product(x, *stacks, index)[0, 0].astype(jnp.float32), None
        return lax.scan(layer, jnp.float32(0), jnp.arange(LAYERS))[0]
    return jax.jit(run)


def copied(x, stack, index):
    """The path the kernel replaced: the layer indexed out of the stack (XLA's copy), then `product`."""
    weight = stack[index]
    if weight.dtype == jnp.uint16:
        weight = lax.bitcast_convert_type(weight, jnp.bfloat16)
    return matmul.product(x, weight, out_dtype=x.dtype, policy="auto")


def in_place(x, stack, index):
    return matmul.stacked_product(x, stack, index, jnp.bfloat16, "auto")


def gated_apart(x, gate, up, down, index):
    """A gated feed-forward's path before the gated call: both products in place, XLA's activation after them,
    and the down projection (which reads every element of the activation, as a model's does)."""
    act = jax.nn.silu(in_place(x, gate, index).astype(jnp.float32)).astype(x.dtype)
    return in_place(act * in_place(x, up, index), down, index)


def gated(x, gate, up, down, index):
    return in_place(matmul.stacked_gated_product(x, gate, index, up, index, jax.nn.silu, "auto"), down, index)


def amx_body(x, stack, index):
    """The kernel's AMX body for more than `FEW_ROWS` rows whatever the policy's range: the call `in_place`
    makes within `policy.BFLOAT16_PREFILL_ROWS`."""
    return matmul.few_rows_product(x, stack, index, x.dtype)


def onednn_in_place(x, stack, index):
    return matmul.onednn_stacked_product(x, stack, index, x.dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 512, 1024])
    parser.add_argument("--rounds", type=int, default=9)
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--float32", action="store_true",
                        help="float32 products: the copy and product against oneDNN's stacked gemm in place")
    chosen.add_argument("--gated", action="store_true",
                        help="silu(x gate) * up: two products in place and XLA's activation against one call")
    args = parser.parse_args()
    print(machine())
    dtype = jnp.float32 if args.float32 else jnp.bfloat16
    reader = matmul.status(dtype, "auto") if args.float32 else matmul.few_rows_status("auto")
    print(f"{'oneDNN' if args.float32 else 'few-rows kernel'}: {reader[1]}")
    if not reader[0]:
        raise SystemExit("nothing to compare here")
    rng = np.random.default_rng(0)
    if args.gated:
        return compare_gated(args, rng)
    for k, n in SHAPES:
        weights = jnp.asarray(rng.standard_normal((LAYERS, k, n), np.float32) * 0.05, dtype)
        stack = weights if args.float32 else lax.bitcast_convert_type(weights, jnp.uint16)
        for rows in args.rows:
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), dtype)
            kernel, note = onednn_in_place if args.float32 else in_place, ""
            if not args.float32 and not matmul.stacked_takes(x, stack, "auto"):
                if not (rows > FEW_ROWS and matmul.few_rows_tiles()):
                    print(f"{k}x{n} {rows:4d} rows: the kernel does not read this layer in place here")
                    continue
                kernel, note = amx_body, " (the AMX body, outside the policy's rows)"
            sides = {"before": scanned(copied), "kernel": scanned(kernel)}
            times = alternating({name: lambda run=run: jax.block_until_ready(run(x, stack))
                                 for name, run in sides.items()}, args.rounds)
            times = {name: [seconds / LAYERS for seconds in samples] for name, samples in times.items()}
            print(f"{k}x{n} {rows:4d} rows{note}: {compared(times, 'us', 2 * rows * k * n, 'GFLOP/s')}", flush=True)


def compare_gated(args, rng):
    k, n = SHAPES[2]
    gate, up, down = (lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((LAYERS, *shape), np.float32) * 0.05,
                                                           jnp.bfloat16), jnp.uint16)
                      for shape in ((k, n), (k, n), (n, k)))
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
        if not matmul.gated_takes(x, gate, up, "auto"):
            print(f"gated {k}x{n} {rows:4d} rows: the kernel does not compute this gated product here")
            continue
        sides = {"before": scanned(gated_apart), "kernel": scanned(gated)}
        times = alternating({name: lambda run=run: jax.block_until_ready(run(x, gate, up, down))
                             for name, run in sides.items()}, args.rounds)
        times = {name: [seconds / LAYERS for seconds in samples] for name, samples in times.items()}
        print(f"gated MLP {k}x{n} {rows:4d} rows: {compared(times, 'us', 6 * rows * k * n, 'GFLOP/s')}", flush=True)


if __name__ == "__main__":
    main()
