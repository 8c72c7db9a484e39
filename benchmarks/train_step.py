"""Train-step speed: Dew against transformers' LlamaForCausalLM in torch, same shape, batch and AdamW.

    python benchmarks/train_step.py [--vocab 256] [--steps 10] [--compile]

Prints tokens/s for Dew and torch in fp32 and bf16 (torch autocast), their ratio, and the achieved
FLOP/s beside this machine's own 2048-square matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import decoder_flops_per_token, machine, matmul_peak, timed
from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.objectives.lm import LMObjective
from dew.training.mesh import place_batch

SHAPE = dict(num_layers=4, emb_features=256, num_heads=4, num_kv_heads=4, mlp_features=1024)


def dew_step(vocab: int, seq: int, batch: int, dtype, steps: int) -> tuple[float, float]:
    """(seconds per step, seconds for the first step's trace and compile)."""
    model = models.build("causal_transformer", vocab_size=vocab, max_seq_len=seq, dtype=dtype, **SHAPE)
    objective = LMObjective(model, seq, ema_decay=None)
    trainer = Trainer(objective, optax.adamw(1e-3, weight_decay=0.1), key=jax.random.key(0))
    state = trainer.init_state()
    rows = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    placed = place_batch(trainer.mesh, {"text": rows})
    started = time.perf_counter()
    step = trainer.compile_step(state, placed)
    compile_seconds = time.perf_counter() - started
    holder = {"state": state}

    def run():
        holder["state"], out = step(holder["state"], placed)
        jax.block_until_ready(out)

    return timed(run, steps), compile_seconds


def torch_step(vocab: int, seq: int, batch: int, precision: str, steps: int, compiled: bool) -> float:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=SHAPE["emb_features"], intermediate_size=SHAPE["mlp_features"],
        num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"], max_position_embeddings=seq, attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)))
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def loss_fn():
        logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    forward = torch.compile(loss_fn) if compiled else loss_fn

    def run():
        optimizer.zero_grad(set_to_none=True)
        if precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = forward()
        else:
            loss = forward()
        loss.backward()
        optimizer.step()

    return timed(run, steps)


def torch_matmul_flops(dtype, size: int = 512) -> float:
    import torch

    a, b = torch.ones(size, size, dtype=dtype), torch.ones(size, size, dtype=dtype)
    return 2 * size**3 / timed(lambda: a @ b, repeats=3, warmup=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (slow to compile)")
    parser.add_argument("--torch-bf16", action="store_true",
                        help="time torch autocast bf16 even where torch's bf16 matmul is slow (no AVX512-BF16/AMX)")
    args = parser.parse_args()
    import torch

    tokens = args.batch * args.seq
    flops = decoder_flops_per_token(SHAPE["num_layers"], SHAPE["emb_features"], SHAPE["num_heads"],
                                    SHAPE["num_kv_heads"], SHAPE["mlp_features"], args.vocab, args.seq) * tokens
    peaks = {"fp32": matmul_peak(jnp.float32), "bf16": matmul_peak(jnp.bfloat16)}
    print(f"machine: {machine()}, torch {torch.__version__} with {torch.get_num_threads()} threads")
    print(f"shape: {SHAPE}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, AdamW")
    print(f"XLA matmul peak (2048^2): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    torch_bf16 = torch_matmul_flops(torch.bfloat16)
    print(f"torch matmul (512^2): fp32 {torch_matmul_flops(torch.float32) / 1e9:.0f} GFLOP/s, "
          f"bf16 {torch_bf16 / 1e9:.1f} GFLOP/s")
    for precision, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        ours, compile_seconds = dew_step(args.vocab, args.seq, args.batch, dtype, args.steps)
        line = (f"{precision}: dew {tokens / ours:,.0f} tokens/s ({flops / ours / 1e9:.0f} GFLOP/s, "
                f"{flops / ours / peaks[precision]:.0%} of peak, first step compiled in {compile_seconds:.1f} s)")
        if precision == "bf16" and torch_bf16 < 20e9 and not args.torch_bf16:
            print(f"{line} | torch autocast not run: its bf16 matmul runs at {torch_bf16 / 1e9:.1f} GFLOP/s "
                  "on this CPU (pass --torch-bf16 to time it anyway)")
            continue
        theirs = torch_step(args.vocab, args.seq, args.batch, precision, args.steps, compiled=False)
        label = "torch eager" if precision == "fp32" else "torch autocast"
        print(f"{line} | {label} {tokens / theirs:,.0f} tokens/s | ratio {theirs / ours:.2f}x")
        if args.compile:
            compiled = torch_step(args.vocab, args.seq, args.batch, precision, args.steps, compiled=True)
            print(f"{precision}: torch.compile {tokens / compiled:,.0f} tokens/s | ratio {compiled / ours:.2f}x")


if __name__ == "__main__":
    main()
