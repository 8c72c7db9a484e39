"""Decoding's attention kernel alone (`dew.kernels.decode_attention`) over a step's layers, against XLA's form.

    python -m benchmarks.decode_attention [--rows 1 8 32] [--filled 160 2048] [--dtypes float32 bfloat16]
        [--rounds 7] [--no-xla]

SmolLM2-135M's attention (30 layers, 9 query heads over 3 key/value heads of 64): a cache of
`[30, rows, 3, capacity, 64]` (capacity 1024, or the filled count rounded up to a power of two above it),
every row filled to `--filled` slots, read layer after layer in one compiled loop as a decode step reads
it (each layer's query depends on the previous layer's output, so the layers do not overlap). bfloat16
caches are held as uint16 bits, as `dew.nn.kv_cache` keeps them, and their queries are bfloat16 values,
as a bfloat16 model's are. The kernel and XLA's form (`attend` under the decode mask, the layer sliced
out of the cache) alternate rounds; the medians are printed with the rate the kernel reads the filled
keys and values at, and XLA's time over the kernel's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import machine
from dew.kernels import decode_attention as decode_kernel
from dew.nn.attention import attend

LAYERS, HEADS, KV_HEADS, WIDTH = 30, 9, 3, 64


def step_forms(rows: int, filled: int, dtype):
    """{name: compiled step over the layers}, and the step's arguments."""
    capacity = max(1024, 1 << (filled - 1).bit_length())
    shape = (LAYERS, rows, KV_HEADS, capacity, WIDTH)
    keys = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    values = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    q = jax.random.normal(jax.random.key(2), (rows, HEADS, WIDTH), jnp.float32)
    starts, ends = jnp.zeros((rows,), jnp.int32), jnp.full((rows,), filled, jnp.int32)
    stored = {jnp.dtype(jnp.bfloat16): jnp.uint16}.get(jnp.dtype(dtype), dtype)
    keys, values = (jax.lax.bitcast_convert_type(x, stored) for x in (keys, values))
    mask = (jnp.arange(capacity) < filled)[None, None].repeat(rows, 0)

    def kernel_layer(q, k, v, layer):
        return decode_kernel.decode_attention(q, k, v, layer, starts, ends, WIDTH**-0.5)

    def xla_layer(q, k, v, layer):
        k, v = (jax.lax.bitcast_convert_type(x[layer], dtype) for x in (k, v))
        return attend(q[:, None].astype(dtype), k, v, mask, scale=WIDTH**-0.5)[:, 0].astype(jnp.float32)

    def step(layer_form):
        def run(q, k, v):
            # the queries in the cache's dtype, as a model of that dtype makes them
            return jax.lax.fori_loop(0, LAYERS, lambda layer, q: (q + 1e-3 * layer_form(q, k, v, layer))
                                     .astype(dtype).astype(jnp.float32), q.astype(dtype).astype(jnp.float32))
        return jax.jit(run)

    return {"kernel": step(kernel_layer), "XLA": step(xla_layer)}, (q, keys, values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--filled", type=int, nargs="+", default=[160, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-xla", action="store_true", help="time the kernel only")
    args = parser.parse_args()
    os.environ.setdefault("DEW_KERNELS", "native")
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for dtype in args.dtypes:
        for filled in args.filled:
            for rows in args.rows:
                forms, arguments = step_forms(rows, filled, jnp.dtype(dtype))
                if args.no_xla:
                    forms.pop("XLA")
                times = {name: [] for name in forms}
                for form in forms.values():
                    form(*arguments).block_until_ready()
                for _ in range(args.rounds):
                    for name, form in forms.items():
                        started = time.perf_counter()
                        form(*arguments).block_until_ready()
                        times[name].append(time.perf_counter() - started)
                median = {name: statistics.median(values) for name, values in times.items()}
                read = 2 * LAYERS * rows * KV_HEADS * filled * WIDTH * jnp.dtype(dtype).itemsize
                line = f"{dtype} {rows:>2} rows x {filled:>5} slots: kernel {median['kernel'] * 1e3:7.2f} ms " \
                       f"({read / median['kernel'] / 1e9:5.1f} GB/s of keys and values)"
                if "XLA" in median:
                    line += f", XLA {median['XLA'] * 1e3:7.2f} ms, XLA / kernel {median['XLA'] / median['kernel']:.2f}"
                print(f"{line}; load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
