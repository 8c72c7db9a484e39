"""Masked diffusion's cost against the autoregressive decoder of the same shape.

    python -m benchmarks.diffusion [--steps 4] [--rounds 3] [--accumulation 4] [--new 64] [--evaluations 64]

Two measurements, each side by side in one process:
- The train step (fp32, AdamW, `Trainer.compile_step`): `LMObjective` on the causal decoder, the same
  loss on the decoder with bidirectional attention, and `MaskedDiffusionObjective` on that bidirectional
  decoder, all over `batch x seq` scored tokens. The causal pass skips the attention blocks above its
  diagonal (`dew.nn.attention.attend`'s `causal_blocks`); the bidirectional ones compute them, so the
  middle line separates what the attention costs from what the objective costs.
- Generation wall time per new token, greedy autoregressive decoding with its KV cache (`generate`)
  against MDLM's `Unmask` at `--evaluations` model evaluations over the same prompt and budget, at
  batch 1 and 8, compiled beforehand.
Rounds alternate the variants; each line gives the medians over rounds of the wall time and of the
process's CPU time, which other programs on a shared machine disturb less.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import machine
from dew import Trainer, models
from dew.diffusion.discrete import MDLM
from dew.objectives.diffusion import MaskedDiffusionObjective
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling, generate
from dew.training.mesh import place_batch

SHAPE = dict(num_layers=4, emb_features=256, num_heads=4, num_kv_heads=4, mlp_features=1024)


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (on Linux), and whether it has AVX-512."""
    try:
        info = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name}, {'with' if ' avx512f' in info else 'without'} AVX-512"


def cost(run, repeats: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one `run()` (which blocks until done), averaged over `repeats`."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def compiled_step(objective, rows: np.ndarray, accumulation: int):
    """A callable running one compiled train step of `objective` over `rows`, blocking until it is done."""
    trainer = Trainer(objective, optax.adamw(1e-3, weight_decay=0.1), key=jax.random.key(0))
    holder = {"state": trainer.init_state()}
    placed = place_batch(trainer.mesh, {"text": rows})
    step = trainer.compile_step(holder["state"], placed, accumulation)

    def run():
        holder["state"], out = step(holder["state"], placed)
        jax.block_until_ready(out)

    run()  # the first call allocates the donated buffers
    return run


def train_steps(vocab: int, seq: int, batch: int, accumulation: int):
    """The compiled steps: the autoregressive loss on causal and on bidirectional attention, and MDLM's."""
    causal = models.build("causal_transformer", vocab_size=vocab, max_seq_len=seq, **SHAPE)
    both_ways = models.build("causal_transformer", vocab_size=vocab, max_seq_len=seq, causal=False, **SHAPE)
    masked = models.build("causal_transformer", vocab_size=vocab + 1, max_seq_len=seq, causal=False, **SHAPE)
    shifted = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return {
        "autoregressive, causal attention": compiled_step(LMObjective(causal, seq, ema_decay=None), shifted,
                                                          accumulation),
        "autoregressive loss, bidirectional attention": compiled_step(LMObjective(both_ways, seq, ema_decay=None),
                                                                      shifted, accumulation),
        "MDLM": compiled_step(MaskedDiffusionObjective(masked, MDLM(mask_id=vocab)(), seq, ema_decay=None),
                              shifted[:, :seq], accumulation),
    }


def generations(vocab: int, prompt: int, new: int, rows: int, evaluations: int):
    """Callables writing `new` tokens after `rows` prompts: cached greedy decoding, and MDLM's unmasking."""
    length = prompt + new
    causal = models.build("causal_transformer", vocab_size=vocab, max_seq_len=length, **SHAPE)
    masked = models.build("causal_transformer", vocab_size=vocab + 1, max_seq_len=length, causal=False, **SHAPE)
    init = lambda model: jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False))()
    prompts = np.random.default_rng(1).integers(0, vocab, (rows, prompt)).tolist()
    causal_variables, masked_variables = init(causal), init(masked)
    process = MDLM(mask_id=vocab, steps=evaluations)()
    runs = {
        "autoregressive, KV cache": lambda: generate(causal, causal_variables, prompts, new, key=jax.random.key(0),
                                                     sampling=Sampling(temperature=0.0)),
        f"MDLM, {evaluations} evaluations": lambda: process.generate(masked, masked_variables, prompts, new,
                                                                    key=jax.random.key(0)),
    }
    for run in runs.values():
        run()  # compile
    return runs


def rounds_of(runs: dict, rounds: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Each run's (wall, CPU) seconds in every round; the runs alternate within a round, so a change in
    the machine's load falls on all of them alike."""
    costs = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            costs[label].append(cost(run, repeats))
    return costs


def median(costs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(wall for wall, _ in costs), statistics.median(cpu for _, cpu in costs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="train steps a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches a train step")
    parser.add_argument("--generation-vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--evaluations", type=int, default=64, help="MDLM's model evaluations (its default)")
    args = parser.parse_args()

    print(f"machine: {cpu_model()}; {machine()}; medians of {args.rounds} rounds, wall clock and process CPU time "
          "(both threads)")
    print(f"shape: {SHAPE}; train step fp32, AdamW, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, "
          f"{args.accumulation} micro-batches, {args.steps} steps a round")
    tokens = args.batch * args.seq
    costs = rounds_of(train_steps(args.vocab, args.seq, args.batch, args.accumulation), args.rounds, args.steps)
    reference = median(costs["autoregressive, causal attention"])
    for label, each in costs.items():
        wall, cpu = median(each)
        spread = ", ".join(f"{tokens / w:,.0f}" for w, _ in each)
        print(f"train step, {label}: {tokens / wall:,.0f} tokens/s (rounds: {spread}), {cpu:.2f} CPU s a step; "
              f"{reference[0] / wall:.2f}x the causal step's speed by the clock, {reference[1] / cpu:.2f}x by CPU time")
    print(f"generation: vocab {args.generation_vocab}, prompt {args.prompt}, {args.new} new tokens, greedy "
          "autoregressive decoding against MDLM's unmasking (random weights, EOS off)")
    for rows in (1, 8):
        costs = rounds_of(generations(args.generation_vocab, args.prompt, args.new, rows, args.evaluations),
                          args.rounds, 1)
        decode = median(costs["autoregressive, KV cache"])
        for label, each in costs.items():
            wall, cpu = median(each)
            print(f"generation, batch {rows}, {label}: {wall:.3f} s, {wall / args.new * 1e3:.2f} ms per token "
                  f"position ({rows * args.new / wall:,.0f} tokens/s), {cpu:.2f} CPU s; {wall / decode[0]:.1f}x "
                  f"the cached decode's wall time, {cpu / decode[1]:.1f}x its CPU time")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
