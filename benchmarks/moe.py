"""Mixture-of-experts speed: Dew's train step against transformers' Qwen3-MoE in torch, and Dew's
dropless grouped dispatch against a dense product over every expert as the expert count grows.

    python -m benchmarks.moe [--steps 2] [--rounds 3] [--mixtures 8:2:512 64:8:128] [--experts 8 32 64]

1. The train step: 4 layers, width 256, 4 heads (Qwen3's per-head q/k norms), every layer a mixture
   of E experts of F hidden units, top-k (`--mixtures E:k:F`; both defaults have the active FLOPs of
   benchmarks/train_step.py's dense SwiGLU 1024: 8 experts of 512, top-2, and a fine-grained 64 of
   128, top-8), renormalised top-k, vocab 256, seq 256, batch 16, AdamW, fp32. Dew runs the batch
   whole and as 4 micro-batches (`Trainer.compile_step`); transformers runs its experts in torch
   eager two ways: "eager" loops in Python over the experts that received tokens, "grouped_mm" runs
   one grouped matmul per projection where torch has the kernel.
2. One sparse layer's forward and backward over 2,048 tokens (width 256, 512 hidden units per
   expert, top-2) as the expert count grows: Dew's dispatch (slots sorted by expert, one grouped
   matmul per tile of an expert's rows) against the dense formulation (every token through every
   expert, the outputs weighted by a [tokens, experts] matrix zero outside the top-k), which costs
   E / k times the FLOPs.

Rounds alternate the variants, so a change in a shared machine's load falls on all of them alike;
each line gives the medians over rounds of the wall time and of the process's CPU time (all threads),
which other programs disturb less.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from benchmarks.common import machine
from benchmarks.diffusion import compiled_step, cpu_model, median, rounds_of
from dew import models
from dew.nn.mlp import ACTIVATIONS
from dew.nn.moe import Mixture, SparseMLP, SparseSpec
from dew.objectives.lm import LMObjective

SHAPE = dict(num_layers=4, emb_features=256, num_heads=4, num_kv_heads=4, head_dim=64, qk_norm=True)
TOP_K, FEATURES = 2, 512  # the dispatch comparison's


def dew_step(vocab: int, seq: int, batch: int, accumulation: int, experts: int, top_k: int, features: int):
    """A callable running one compiled AdamW step of Dew's mixture decoder (compiled here)."""
    model = models.build("causal_transformer", vocab_size=vocab, max_seq_len=seq, mlp_features=features,
                         mixture=dict(experts=experts, top_k=top_k), **SHAPE)
    rows = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return compiled_step(LMObjective(model, seq, ema_decay=None), rows, accumulation)


def torch_step(vocab: int, seq: int, batch: int, experts_implementation: str, experts: int, top_k: int,
               features: int):
    """A callable running one AdamW step of transformers' Qwen3-MoE with the same shape, fp32."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=SHAPE["emb_features"], moe_intermediate_size=features,
        intermediate_size=features, num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"], head_dim=SHAPE["head_dim"], num_experts=experts,
        num_experts_per_tok=top_k, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=seq,
        attn_implementation="sdpa", experts_implementation=experts_implementation)
    model = transformers.Qwen3MoeForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)))
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def run():
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1)).backward()
        optimizer.step()

    run()  # the first step allocates the optimizer's moments
    return run


def dense_mixture(variables, x_BSD, mixture: Mixture):
    """The baseline: the same router, then every token through every expert, weighted by a
    `[tokens, experts]` matrix holding the top-k weights (zero elsewhere)."""
    params = variables["params"]
    B, S, D = x_BSD.shape
    x_ND = x_BSD.reshape(-1, D)
    logits_NE = x_ND @ params["gate"]["kernel"]
    scores_NE = jax.nn.softmax(logits_NE, axis=-1)
    top_NK, experts_NK = jax.lax.top_k(scores_NE, mixture.top_k)
    weights_NK = top_NK / jnp.sum(top_NK, axis=-1, keepdims=True)
    combine_NE = jnp.zeros_like(scores_NE).at[jnp.arange(x_ND.shape[0])[:, None], experts_NK].add(weights_NK)
    experts = params["experts"]
    gate_ENF = jnp.einsum("nd,edf->enf", x_ND, experts["gate_proj"]["kernel"])
    up_ENF = jnp.einsum("nd,edf->enf", x_ND, experts["up_proj"]["kernel"])
    y_END = jnp.einsum("enf,efd->end", ACTIVATIONS["silu"](gate_ENF) * up_ENF, experts["down_proj"]["kernel"])
    return jnp.einsum("end,ne->nd", y_END, combine_NE).reshape(B, S, D)


def layer_steps(experts: int, tokens: int) -> dict:
    """Callables running one sparse layer's forward and backward (gradients of every parameter and the
    input), Dew's dispatch and the dense baseline, over the same weights and tokens (compiled here)."""
    mixture = Mixture(experts, TOP_K)
    block = SparseMLP(SparseSpec(mixture, FEATURES))
    x_BSD = jax.random.normal(jax.random.key(0), (tokens // 256, 256, SHAPE["emb_features"]))
    variables = nn.meta.unbox(block.init(jax.random.key(1), x_BSD))
    cotangent = jax.random.normal(jax.random.key(2), x_BSD.shape)
    forms = {"grouped dispatch": lambda v, x: block.apply(v, x)[0],
             "dense product over every expert": lambda v, x: dense_mixture(v, x, mixture)}
    runs = {}
    for name, form in forms.items():
        step = jax.jit(jax.grad(lambda v, x, form=form: jnp.sum(form(v, x) * cotangent), argnums=(0, 1)))
        runs[name] = lambda step=step: jax.block_until_ready(step(variables, x_BSD))
        runs[name]()  # compile
    return runs


def train_step_table(args, mixture: tuple[int, int, int]) -> None:
    experts, top_k, features = mixture
    tokens = args.batch * args.seq
    print(f"\ntrain step: {SHAPE}, {experts} experts of {features}, top-{top_k}, vocab {args.vocab}, seq {args.seq}, "
          f"batch {args.batch}, AdamW, fp32")
    runs = {f"dew, {n} micro-batch(es)": dew_step(args.vocab, args.seq, args.batch, n, *mixture)
            for n in sorted({1, args.accumulation})}
    for implementation in ("eager", "grouped_mm"):
        try:
            runs[f"transformers, experts_implementation={implementation!r}"] = torch_step(
                args.vocab, args.seq, args.batch, implementation, *mixture)
        except (RuntimeError, ValueError, NotImplementedError) as error:
            print(f"transformers, experts_implementation={implementation!r}: unavailable ({error})")
    costs = {label: median(rounds) for label, rounds in rounds_of(runs, args.rounds, args.steps).items()}
    dew_best = min((cost for label, cost in costs.items() if label.startswith("dew")), key=lambda cost: cost[0])
    print("| step | tokens/s (wall) | CPU s a step | Dew's best against it: wall / CPU |\n| --- | --- | --- | --- |")
    for label, (wall, cpu) in costs.items():
        print(f"| {label} | {tokens / wall:,.0f} | {cpu:.2f} | {wall / dew_best[0]:.2f}x / {cpu / dew_best[1]:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="steps a variant runs in each round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--mixtures", nargs="+", default=["8:2:512", "64:8:128"],
                        help="the train step's mixtures, experts:top_k:hidden units per expert")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--layer-tokens", type=int, default=2048)
    parser.add_argument("--skip-step", action="store_true", help="only the dispatch comparison")
    args = parser.parse_args()
    import torch

    print(f"machine: {machine()}, {cpu_model()}, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"transformers {__import__('transformers').__version__}")
    for spelled in [] if args.skip_step else args.mixtures:
        train_step_table(args, tuple(int(part) for part in spelled.split(":")))
    print(f"\none sparse layer, forward and backward, {args.layer_tokens} tokens, width {SHAPE['emb_features']}, "
          f"{FEATURES} hidden units per expert, top-{TOP_K}:")
    print("| experts | grouped dispatch: ms (CPU ms) | dense product: ms (CPU ms) | grouped faster: wall / CPU |\n"
          "| --- | --- | --- | --- |")
    for experts in args.experts:
        costs = {label: median(rounds) for label, rounds in
                 rounds_of(layer_steps(experts, args.layer_tokens), args.rounds, args.steps).items()}
        (grouped_wall, grouped_cpu), (dense_wall, dense_cpu) = costs.values()
        print(f"| {experts} | {grouped_wall * 1e3:.1f} ({grouped_cpu * 1e3:.0f}) | {dense_wall * 1e3:.1f} "
              f"({dense_cpu * 1e3:.0f}) | {dense_wall / grouped_wall:.2f}x / {dense_cpu / grouped_cpu:.2f}x |")


if __name__ == "__main__":
    main()
