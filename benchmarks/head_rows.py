"""A decode step's logits product against SmolLM2's tied head (49,152 x 576): Dew's head kernel
(`dew.kernels.head_rows`) against the product it replaced, in alternating rounds.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python -m benchmarks.head_rows [--rows 1 8 32] [--rounds 40]

The product it replaced: XLA's dot for a float32 head, oneDNN's gemm (`dew.kernels.matmul.dot` under the
`auto` policy) for a bfloat16 one. Prints each side's median and fastest milliseconds over rounds in which
both run back to back, the ratio of the medians, the head's bytes a millisecond at the kernel's median,
and the load average.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import alternating, compared, machine
from dew.kernels import head_rows
from dew.kernels.matmul import dot
from dew.kernels.policy import using

VOCAB, WIDTH = 49152, 576


def replaced(hidden_NE, weight_VE):
    """The product a tied head ran before the kernel."""
    if hidden_NE.dtype == jnp.bfloat16:
        with using("auto"):
            return dot(hidden_NE, weight_VE, transpose_b=True)
    return jax.lax.dot_general(hidden_NE, weight_VE, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    print(machine())
    print(f"head kernel: {head_rows.status('auto')[1]}")
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        weight = jnp.asarray(rng.standard_normal((VOCAB, WIDTH), np.float32) * 0.05, dtype)
        for rows in args.rows:
            hidden = jnp.asarray(rng.standard_normal((rows, WIDTH), np.float32), dtype)
            if not head_rows.takes(hidden, weight, True, "auto"):
                print(f"{jnp.dtype(dtype).name} {rows:2d} rows: the kernel does not take this head here")
                continue
            sides = {"before": jax.jit(replaced),
                     "kernel": jax.jit(lambda h, w: head_rows.head_logits(h, w, True))}
            times = alternating({name: lambda run=run: jax.block_until_ready(run(hidden, weight))
                                 for name, run in sides.items()}, args.rounds)
            print(f"{jnp.dtype(dtype).name:8s} {rows:2d} rows: {compared(times, 'ms', weight.nbytes, 'GB/s')}",
                  flush=True)


if __name__ == "__main__":
    main()
