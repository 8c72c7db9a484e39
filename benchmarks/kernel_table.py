"""Measure the kernel table (`dew/kernels/table.json`) for this CPU's class: every product the train steps
of the given shapes run, timed in XLA and in oneDNN, and whether oneDNN wins.

    python -m benchmarks.kernel_table [--shapes quickstart,benchmark] [--dtypes float32,bfloat16]
                                      [--accumulation 1,4] [--rounds 9] [--out dew/kernels/table.json]

The kernel policy `auto` reads this table and never times anything itself, so the same model runs the same
kernels on every machine of a class. Run this on purpose, on a quiet machine, to re-measure a class (the
entry of this CPU's class is replaced; the others are kept); `--dry-run` prints the choices without writing.

Each product is timed as `--together` independent products of its shape in one compiled call, XLA's and
oneDNN's back to back in each of `--rounds` rounds, each side's fastest round kept: a product of a
millisecond timed alone mostly measures how fast XLA's sleeping threads wake, and other work on the
machine only ever adds time. oneDNN is chosen where it takes at most `--margin` of XLA's time (a tie keeps
XLA's fusions).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import cpu_model
from benchmarks.train_step import SHAPES
from dew import Trainer, kernels, models
from dew.files import write_atomically
from dew.kernels import matmul
from dew.kernels.loader import onednn_version
from dew.kernels.policy import TABLE, parse_key
from dew.objectives.lm import LMObjective
from dew.training.mesh import place_batch


def step_products(shape: str, dtype, accumulation: int) -> list[str]:
    """The product keys one train step of `shape` traces (every product recorded, whichever kernel)."""
    layers, sizes = SHAPES[shape]
    model = models.build("causal_transformer", vocab_size=sizes["vocab"], max_seq_len=sizes["seq"], dtype=dtype,
                         kernels="native", **layers)
    trainer = Trainer(LMObjective(model, sizes["seq"], ema_decay=None), optax.adamw(1e-3), key=jax.random.key(0))
    state = trainer.init_state()
    rows = np.zeros((sizes["batch"], sizes["seq"] + 1), np.int32)
    trainer.compile_step(state, place_batch(trainer.mesh, {"text": rows}), accumulation)
    return sorted(key for key in trainer.kernel_choices if key[0].isdigit())


def measure(key: str, rounds: int, together: int) -> tuple[float, float]:
    """(XLA's seconds, oneDNN's seconds) for one product of `key`: each side's fastest of `rounds` rounds."""
    (batch, m, k, n), kind = parse_key(key)
    dtype_name, ops, out_name = kind.split("/")
    dtype, out_dtype = jnp.dtype(dtype_name), jnp.dtype(out_name)
    transpose_a, transpose_b = ops[0] == "T", ops[1] == "T"
    lead = (batch,) if batch > 1 else ()
    shapes = ((*lead, k, m) if transpose_a else (*lead, m, k), (*lead, n, k) if transpose_b else (*lead, k, n))
    rng = np.random.default_rng(0)
    operands = [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(together) for shape in shapes]

    def batched(run):
        one = functools.partial(run, transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
        return jax.jit(lambda *xs: [one(a, b) for a, b in zip(xs[::2], xs[1::2])])

    runs = [batched(functools.partial(matmul.xla_product, cpu_layout=True)), batched(matmul.onednn_product)]
    for run in runs:
        jax.block_until_ready(run(*operands))
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for side, run in enumerate(runs):
            started = time.perf_counter()
            jax.block_until_ready(run(*operands))
            best[side] = min(best[side], (time.perf_counter() - started) / together)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="quickstart,benchmark", help=f"train-step shapes: {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--accumulation", default="1,4", help="micro-batch counts (each gives other row counts)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--together", type=int, default=4)
    parser.add_argument("--margin", type=float, default=0.97)
    parser.add_argument("--out", type=Path, default=TABLE)
    parser.add_argument("--dry-run", action="store_true", help="print the choices, write nothing")
    args = parser.parse_args(argv)
    for dtype_name in args.dtypes.split(","):
        available, why = matmul.status(jnp.dtype(dtype_name), policy="native")
        if not available:
            print(f"{dtype_name}: oneDNN is off here ({why}); its products stay XLA's and are not measured")
    dtypes = [jnp.dtype(name) for name in args.dtypes.split(",") if matmul.status(jnp.dtype(name), policy="native")[0]]
    keys = sorted({key for shape in args.shapes.split(",") for dtype in dtypes
                   for accumulation in (int(count) for count in args.accumulation.split(","))
                   for key in step_products(shape, dtype, accumulation)})
    cpu = kernels.cpu_class()
    print(f"CPU class {cpu} ({cpu_model()}), {len(os.sched_getaffinity(0))} cores, {len(keys)} products")
    products = {}
    for key in keys:
        xla_s, onednn_s = measure(key, args.rounds, args.together)
        products[key] = {"xla_s": round(xla_s, 7), "onednn_s": round(onednn_s, 7),
                         "onednn": onednn_s <= args.margin * xla_s}
        print(f"{key:<44} XLA {xla_s * 1e3:8.3f} ms  oneDNN {onednn_s * 1e3:8.3f} ms  "
              f"{'oneDNN' if products[key]['onednn'] else 'XLA'}")
    if args.dry_run:
        return 0
    table = json.loads(args.out.read_text()) if args.out.is_file() else {"format": 1, "classes": {}}
    table["classes"][cpu] = {
        "measured": {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "date": datetime.date.today().isoformat(),
                     "jax": jax.__version__, "onednn": onednn_version(), "rounds": args.rounds,
                     "together": args.together, "margin": args.margin,
                     "command": "python -m benchmarks.kernel_table " + " ".join(sys.argv[1:] if argv is None else argv)},
        "products": products,
    }
    write_atomically(args.out, json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {sum(entry['onednn'] for entry in products.values())} of {len(products)} products in "
          f"oneDNN for {cpu}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
