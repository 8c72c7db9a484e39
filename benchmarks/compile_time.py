"""Time to the first finished `Trainer.fit` step and the first `generate` call, by decoder depth.

    python benchmarks/compile_time.py [--layers 2 30] [--width 64] [--seq 64]

Each measurement runs in a fresh process with the persistent compilation cache off
(`DEW_COMPILATION_CACHE=0`), so it counts tracing and XLA compilation as a new run pays them. Also
prints the benchmark train step's compile time (`benchmarks/train_step.py`'s shape).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import machine

_CHILD = r"""
import json, sys, time
started = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np, optax
from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling, generate

what, layers, width, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
vocab = 256
model = models.build("causal_transformer", vocab_size=vocab, emb_features=width, num_layers=layers,
                     num_heads=4, max_seq_len=max(seq, 64) + 32)
imported = time.perf_counter()
if what == "fit":
    rows = np.random.default_rng(0).integers(0, vocab, (8, seq + 1)).astype(np.int32)
    data = Dataset(train=lambda partition: iter([{"text": rows}] * 10), val=None, records=8, batch=8)
    trainer = Trainer(LMObjective(model, seq, ema_decay=None), optax.adamw(1e-3), key=jax.random.key(0))
    trainer.fit(data, steps=1, log_every=1, verbose=False)
else:
    variables = jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))()
    jax.block_until_ready(variables)
    imported = time.perf_counter()
    generate(model, variables, [[1, 2, 3, 4, 5]], 16, key=jax.random.key(0), sampling=Sampling(temperature=0.0))
print(json.dumps({"seconds": time.perf_counter() - imported}))
"""

_STEP_CHILD = r"""
import json, time
import jax, jax.numpy as jnp
from benchmarks.train_step import dew_step
_, compile_seconds, _ = dew_step(256, 256, 16, jnp.float32, 1)
print(json.dumps({"seconds": compile_seconds}))
"""


def _run(code: str, *args: str) -> float:
    env = {**os.environ, "DEW_COMPILATION_CACHE": "0", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 30])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    print(machine())
    print(f"width {args.width}, seq {args.seq}, persistent compilation cache off")
    results = {}
    for what in ("fit", "generate"):
        for layers in args.layers:
            results[what, layers] = _run(_CHILD, what, str(layers), str(args.width), str(args.seq))
            label = "first Trainer.fit step" if what == "fit" else "first generate call"
            print(f"{label:>24} {layers:>3} layers: {results[what, layers]:6.2f} s")
    if len(args.layers) >= 2:
        low, high = min(args.layers), max(args.layers)
        for what in ("fit", "generate"):
            print(f"{what}: {high} layers / {low} layers = {results[what, high] / results[what, low]:.2f}x")
    print(f"benchmark train step (benchmarks/train_step.py shape) compiles in {_run(_STEP_CHILD):.2f} s")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s in all)")
