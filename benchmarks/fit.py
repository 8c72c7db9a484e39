"""What `Trainer.fit` costs beyond its compiled step: fit tokens/s against the bare step, same shape.

    python -m benchmarks.fit [--steps 20] [--rounds 3] [--seq 256] [--batch 16] [--bf16]

Both sides run train_step.py's model shape on byte token files cut from data/kjv.txt.xz, with
AdamW and an EMA of 0.999, through one `Trainer` (so one compiled step). The bare side dispatches
that step back to back on one placed batch and blocks once at the end. The fit side is the public
API (`TokenWindows`, `Trainer.fit`, log every 10): its per-step cost is the difference between a
fit of `steps + 2` steps and one of 2 steps, over `steps`, so the fixed costs of a call (the
initial state, the data iterator) drop out. Rounds alternate the two sides and the medians are
compared; on a shared machine the spread between rounds says how far to trust the ratio. Each
side's process CPU time a step is printed too: host work fit adds (reading, validating and placing
batches, reading outputs, logging) shows there even when other programs make the wall clock noisy.
"""

from __future__ import annotations

import argparse
import lzma
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import machine
from benchmarks.train_step import SHAPE
from dew import Trainer, models
from dew.data import Loading, TokenWindows
from dew.data.dataset import Partition
from dew.data.tokenize import tokenize_text
from dew.objectives.lm import LMObjective
from dew.training.mesh import place_batch

CORPUS = Path(__file__).resolve().parents[1] / "data" / "kjv.txt.xz"


def cpu_model() -> str:
    """lscpu's model name (what the ratio was measured on)."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    names = [line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def token_files(directory: Path, characters: int = 2_000_000) -> Path:
    """Byte token files of the corpus's first `characters` characters."""
    with lzma.open(CORPUS, "rt") as stream:
        (directory / "kjv.txt").write_text(stream.read(characters))
    tokenize_text(str(directory / "kjv.txt"), str(directory / "tokens"), "byte", val_fraction=0.01, workers=1,
                  progress=False)
    return directory / "tokens"


def bare_seconds(trainer: Trainer, data, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step of the compiled step dispatched back to back, blocking
    once at the end."""
    state = trainer.init_state()
    batch = place_batch(trainer.mesh, next(data.train(Partition(jax.process_index(), jax.process_count()))))
    step = trainer.compile_step(state, batch)
    state, out = step(state, batch)  # warm
    jax.block_until_ready(out)
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, out = step(state, batch)
    jax.block_until_ready((state, out))
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu) / steps


def fit_seconds(trainer: Trainer, data, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per step of `Trainer.fit`, its fixed per-call costs removed."""

    def cost(count):
        started, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(trainer.fit(data, steps=count, log_every=10, verbose=False).params)
        return time.perf_counter() - started, time.process_time() - cpu

    (long_wall, long_cpu), (short_wall, short_cpu) = cost(steps + 2), cost(2)
    return (long_wall - short_wall) / steps, (long_cpu - short_cpu) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="compute in bf16 (default fp32)")
    args = parser.parse_args()
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    with tempfile.TemporaryDirectory() as scratch:
        path = token_files(Path(scratch))
        data = TokenWindows(str(path), args.seq, loading=Loading()).load(batch=args.batch)
        model = models.build("causal_transformer", vocab_size=256, max_seq_len=args.seq, dtype=dtype, **SHAPE)
        trainer = Trainer(LMObjective(model, args.seq, ema_decay=0.999), optax.adamw(1e-3, weight_decay=0.1),
                          key=jax.random.key(0))
        trainer.fit(data, steps=2, log_every=10, verbose=False)  # compiles the step both sides share
        bare, fit = [], []
        for _ in range(args.rounds):
            bare.append(bare_seconds(trainer, data, args.steps))
            fit.append(fit_seconds(trainer, data, args.steps))
    tokens = args.batch * args.seq
    print(f"machine: {machine()}; CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"shape: {SHAPE}, vocab 256 (byte), seq {args.seq}, batch {args.batch}, "
          f"{'bf16' if args.bf16 else 'fp32'}, AdamW, EMA 0.999, fit logs every 10, {args.steps} steps a round")
    for name, costs in (("bare step", bare), ("Trainer.fit", fit)):
        rates = ", ".join(f"{tokens / wall:,.0f}" for wall, _ in costs)
        print(f"{name}: {tokens / statistics.median(w for w, _ in costs):,.0f} tokens/s (rounds: {rates}); "
              f"{statistics.median(c for _, c in costs):.3f} CPU s a step")
    wall = statistics.median(w for w, _ in bare) / statistics.median(w for w, _ in fit)
    cpu = statistics.median(c for _, c in fit) / statistics.median(c for _, c in bare)
    print(f"fit / bare step, tokens/s: {wall:.3f}; fit's CPU time a step over the bare step's: {cpu:.3f}")


if __name__ == "__main__":
    main()
