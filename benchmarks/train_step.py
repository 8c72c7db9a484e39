"""Train-step speed: Dew against transformers' LlamaForCausalLM in torch, same shape, batch and AdamW.

    python -m benchmarks.train_step [--shape benchmark|quickstart] [--vocab 256] [--steps 10]
                                    [--accumulation 4,8] [--compile] [--kernels auto,xla] [--torch-device cuda]

Prints tokens/s for Dew and torch in fp32 and bf16 (torch autocast), each with the batch whole and
split into micro-batches, the ratio of the best of each, and the achieved FLOP/s beside this
machine's own 2048-square matmul peak measured in the same run. Both sides run in this one process,
under whatever allocator it was started with (`dew launch --allocator ... -- python -m
benchmarks.train_step` chooses one; benchmarks.allocators compares them). Dew runs once per `--kernels`
policy (the model's `kernels`, dew.kernels.policy: `auto` the kernel table's choices, `xla` XLA's
products only, `native` oneDNN's for all), so the policies compare side by side. On a GPU machine
(`benchmarks/gpu_check.sh`) jax runs on its GPU backend and `--torch-device cuda` puts torch on the same
GPU; both sides wait for the device at the end of each step.
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import machine, timed
from dew import Trainer, kernels, models
from dew.objectives.lm import LMObjective
from dew.training.mesh import place_batch
from dew.training.utilization import flops_per_position, peak_flops

SHAPE = dict(num_layers=4, emb_features=256, num_heads=4, num_kv_heads=4, mlp_features=1024)
# `--shape quickstart`: examples/quickstart.py's model, sequence, batch and KJV BPE vocabulary.
QUICKSTART = dict(num_layers=4, emb_features=128, num_heads=2, num_kv_heads=2, mlp_features=512)
SHAPES = {"benchmark": (SHAPE, dict(vocab=256, seq=256, batch=16)),
          "quickstart": (QUICKSTART, dict(vocab=4096, seq=128, batch=16))}


def dew_step(vocab: int, seq: int, batch: int, dtype, steps: int, accumulation: int = 1,
             objective_class=LMObjective, policy: str | None = None, shape: dict = SHAPE) -> tuple[float, float, int]:
    """(seconds per step, seconds for the first step's trace and compile, the step's temporary bytes),
    the model's kernels under `policy` (None: the default, auto)."""
    run, compile_seconds, temp_bytes = dew_runner(vocab, seq, batch, dtype, accumulation, objective_class, policy,
                                                  shape)
    return timed(run, steps), compile_seconds, temp_bytes


def dew_runner(vocab: int, seq: int, batch: int, dtype, accumulation: int = 1, objective_class=LMObjective,
               policy: str | None = None, shape: dict = SHAPE):
    """(a function running one compiled step to completion, the compile seconds, the temporary bytes)."""
    model = models.build("causal_transformer", vocab_size=vocab, max_seq_len=seq, dtype=dtype,
                         kernels=policy or "auto", **shape)
    objective = objective_class(model, seq, ema_decay=None)
    trainer = Trainer(objective, optax.adamw(1e-3, weight_decay=0.1), key=jax.random.key(0))
    state = trainer.init_state()
    rows = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    placed = place_batch(trainer.mesh, {"text": rows})
    started = time.perf_counter()
    step = trainer.compile_step(state, placed, accumulation)
    compile_seconds = time.perf_counter() - started
    holder = {"state": state}

    def run():
        holder["state"], out = step(holder["state"], placed)
        jax.block_until_ready(out)

    return run, compile_seconds, step.memory_analysis().temp_size_in_bytes


def torch_step(vocab: int, seq: int, batch: int, precision: str, steps: int, compiled: bool,
               accumulation: int = 1, shape: dict = SHAPE, device: str = "cpu") -> float:
    """Seconds per AdamW step of transformers' Llama; with `accumulation`, the batch runs as that many
    micro-batches whose gradients add up (each loss scaled by its share), the same optimizer step."""
    return timed(torch_runner(vocab, seq, batch, precision, compiled, accumulation, shape, device), steps)


def torch_runner(vocab: int, seq: int, batch: int, precision: str, compiled: bool = False, accumulation: int = 1,
                 shape: dict = SHAPE, device: str = "cpu"):
    """A function running one AdamW step of transformers' Llama on `device` (see `torch_step`); on a GPU it
    waits for the device before returning, as Dew's runner does."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=shape["emb_features"], intermediate_size=shape["mlp_features"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], max_position_embeddings=seq, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1))).to(device)
    micro = [(part[:, :-1].contiguous(), part[:, 1:].contiguous()) for part in rows.chunk(accumulation)]

    def loss_fn(inputs, targets):
        logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    forward = torch.compile(loss_fn) if compiled else loss_fn

    def run():
        optimizer.zero_grad(set_to_none=True)
        for inputs, targets in micro:
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = forward(inputs, targets) / accumulation
            loss.backward()
        optimizer.step()
        if device != "cpu":
            torch.cuda.synchronize(device)

    return run


def interleaved(runs: dict, steps: int, rounds: int) -> dict:
    """Each run's per-round median seconds a step, timed in `rounds` rounds that take the runs in turn
    (`steps` steps each): a machine whose speed drifts over minutes slows every side of a round alike."""
    for run in runs.values():
        run()
    seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds[name].append(timed(run, steps, warmup=0))
    return seconds


def torch_matmul_flops(dtype, size: int = 512, device: str = "cpu") -> float:
    import torch

    a, b = (torch.ones(size, size, dtype=dtype, device=device) for _ in range(2))

    def product():
        a @ b
        if device != "cpu":
            torch.cuda.synchronize(device)

    return 2 * size**3 / timed(product, repeats=3, warmup=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="benchmark",
                        help="the model, sequence, batch and vocabulary (quickstart: examples/quickstart.py's)")
    parser.add_argument("--vocab", type=int, default=None, help="the shape's own unless given")
    parser.add_argument("--seq", type=int, default=None, help="the shape's own unless given")
    parser.add_argument("--batch", type=int, default=None, help="the shape's own unless given")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulation", default="4",
                        help="also time the batch as this many micro-batches (same optimizer step); "
                             "comma-separated counts time each")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (slow to compile)")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated kernel policies to run Dew under (default: auto,xla where oneDNN's "
                             "path is available, else xla)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="then time every micro-batch setting of Dew (under each --kernels policy) and of torch "
                             "in this many alternating rounds, the ratio of each side's fastest taken within each round "
                             "(robust to a machine whose speed drifts)")
    parser.add_argument("--torch-device", default="cpu",
                        help="where torch runs (`cuda` on a GPU machine, beside jax's GPU backend: "
                             "benchmarks/gpu_check.sh)")
    parser.add_argument("--torch-bf16", action="store_true",
                        help="time torch autocast bf16 even where torch's bf16 matmul is slow (no AVX512-BF16/AMX)")
    args = parser.parse_args()
    shape, sizes = SHAPES[args.shape]
    for name, value in sizes.items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    import torch

    from dew.kernels import matmul

    available, why = matmul.status(policy="native")
    policies = args.kernels.split(",") if args.kernels else (["auto", "xla"] if available else ["xla"])

    counts = sorted({1, *(int(count) for count in args.accumulation.split(","))})
    tokens = args.batch * args.seq
    # the trainer's own count and peak (its `mfu`): the model's training FLOPs from its shapes, the best
    # product rate of this machine in each dtype
    model = models.build("causal_transformer", vocab_size=args.vocab, max_seq_len=args.seq, **shape)
    flops = flops_per_position(model, args.seq) * tokens
    peaks = {"fp32": peak_flops(jnp.float32), "bf16": peak_flops(jnp.bfloat16)}
    where = (f"on {torch.cuda.get_device_name(args.torch_device)}" if args.torch_device != "cpu"
             else f"with {torch.get_num_threads()} threads")
    print(f"machine: {machine()}, torch {torch.__version__} {where}")
    print(f"shape: {args.shape} {shape}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, AdamW")
    print(f"oneDNN products: {why}; Dew runs under kernels={', '.join(policies)} (CPU class {kernels.cpu_class()})")
    print(f"peak (dew.training.utilization, the best of XLA's and the native product): fp32 "
          f"{peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    torch_bf16 = torch_matmul_flops(torch.bfloat16, device=args.torch_device)
    print(f"torch matmul (512^2): fp32 {torch_matmul_flops(torch.float32, device=args.torch_device) / 1e9:.0f} GFLOP/s, "
          f"bf16 {torch_bf16 / 1e9:.1f} GFLOP/s")
    print(f"Dew and torch run the {args.batch}-row batch whole and as {', '.join(map(str, counts[1:]))} micro-batches "
          "(gradients summed, one AdamW step): the same optimizer step either way")
    for precision, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        ours = {}
        for policy in policies:
            for accumulation in counts:
                seconds, compile_seconds, _ = dew_step(args.vocab, args.seq, args.batch, dtype, args.steps,
                                                       accumulation, policy=policy, shape=shape)
                ours[policy, accumulation] = seconds
                print(f"{precision}: dew ({policy}), {accumulation} micro-batch(es): {tokens / seconds:,.0f} tokens/s "
                      f"({flops / seconds / 1e9:.0f} GFLOP/s, MFU {flops / seconds / peaks[precision]:.0%}, "
                      f"first step compiled in {compile_seconds:.1f} s)")
        best = min(ours.values())
        if precision == "bf16" and torch_bf16 < 20e9 and not args.torch_bf16:
            print(f"{precision}: torch autocast not run: its bf16 matmul runs at {torch_bf16 / 1e9:.1f} GFLOP/s "
                  "on this CPU (pass --torch-bf16 to time it anyway)")
            continue
        label = "torch eager" if precision == "fp32" else "torch autocast"
        theirs = {accumulation: torch_step(args.vocab, args.seq, args.batch, precision, args.steps, False, accumulation,
                                           shape, args.torch_device)
                  for accumulation in counts}
        for accumulation, seconds in theirs.items():
            print(f"{precision}: {label}, {accumulation} micro-batch(es): {tokens / seconds:,.0f} tokens/s")
        torch_best = min(theirs.values())
        for policy in policies:
            mine = min(seconds for (name, _), seconds in ours.items() if name == policy)
            print(f"{precision}: ratio, dew ({policy}) best against {label}'s best: {torch_best / mine:.2f}x")
        if args.rounds:
            # Every setting of each side runs in every round, and each round compares each side's fastest
            # setting in it: a setting timed once above, during one of the machine's slow stretches, would
            # otherwise pick a side's setting for all the rounds.
            runs = {("dew", policy, count): dew_runner(args.vocab, args.seq, args.batch, dtype, count, policy=policy,
                                                       shape=shape)[0]
                    for policy in policies for count in counts}
            runs.update({("torch", None, count): torch_runner(args.vocab, args.seq, args.batch, precision,
                                                              accumulation=count, shape=shape,
                                                              device=args.torch_device) for count in counts})
            seconds = interleaved(runs, args.steps, args.rounds)

            def fastest(side, policy):
                """The side's seconds a step in each round, at its fastest micro-batch count in that round."""
                return [min(seconds[side, policy, count][r] for count in counts) for r in range(args.rounds)]

            def wins(side, policy):
                """How often each micro-batch count was the side's fastest in a round."""
                if len(counts) == 1:
                    return ""
                won = collections.Counter(min(counts, key=lambda count: seconds[side, policy, count][r])
                                          for r in range(args.rounds))
                return "; fastest " + ", ".join(f"{count} micro-batch(es) in {n}" for count, n in sorted(won.items()))

            torch_seconds = fastest("torch", None)
            print(f"{precision}: {args.rounds} alternating rounds, each side's fastest of its {len(counts)} "
                  f"micro-batch setting(s) in each round: {label} {tokens / np.median(torch_seconds):,.0f} "
                  f"tokens/s{wins('torch', None)}")
            for policy in policies:
                mine = fastest("dew", policy)
                ratios = sorted(t / d for d, t in zip(mine, torch_seconds))
                print(f"{precision}: {args.rounds} alternating rounds, dew ({policy}) {tokens / np.median(mine):,.0f} "
                      f"tokens/s{wins('dew', policy)}: ratio {np.median(ratios):.2f}x median of rounds "
                      f"({ratios[0]:.2f}-{ratios[-1]:.2f})")
        goal = 1.3 if precision == "fp32" else 1.2  # the train step's goals (docs/performance.md)
        print(f"{precision}: ratio, best against best: {torch_best / best:.2f}x; {goal}x torch would take "
              f"{goal * flops / torch_best / 1e9:.0f} GFLOP/s, {goal * flops / torch_best / peaks[precision]:.0%} "
              f"of the {peaks[precision] / 1e9:.0f} GFLOP/s peak")
        if args.compile:
            compiled = torch_step(args.vocab, args.seq, args.batch, precision, args.steps, compiled=True, shape=shape,
                                  device=args.torch_device)
            print(f"{precision}: torch.compile {tokens / compiled:,.0f} tokens/s | ratio {compiled / best:.2f}x")


if __name__ == "__main__":
    main()
