"""The LM head at GPT-2's vocabulary: Dew's chunked head against the unchunked one, same train step.

    python benchmarks/large_vocab.py [--vocab 50257] [--chunks 4] [--steps 5]

The step is benchmarks/train_step.py's (4 x 256 decoder, seq 256, batch 16, AdamW, fp32) with a
50,257-token vocabulary, where the head is most of the work. "Unchunked" is the textbook head: the
whole `[N, V]` float32 logits, log-softmax, and autodiff's backward. Prints tokens/s and the step's
temporary memory (XLA's buffer assignment of the compiled step) for each, and their ratios; the
targets are at most 0.5x the memory at no more than 5% of the speed.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import decoder_flops_per_token, machine, matmul_peak
from benchmarks.train_step import SHAPE, dew_step
from dew.objectives.lm import LMObjective
from dew.nn.head import chunked_cross_entropy


class UnchunkedHead(LMObjective):
    """LMObjective with the head computed whole: `[N, V]` float32 logits and autodiff (the reference).

    It scores what LMObjective's tiled cross entropy scores (per-target losses, log-normalisers and
    whether the argmax was right), so the step reports the same statistics."""

    def _head_losses(self, hidden_NE, head, targets_N):
        logits_NV = head.logits(hidden_NE)
        lse = jax.nn.logsumexp(logits_NV, axis=-1)
        ce = lse - jnp.take_along_axis(logits_NV, targets_N[:, None], axis=-1)[:, 0]
        correct = (jnp.argmax(logits_NV, axis=-1) == targets_N).astype(jnp.float32) if self.token_accuracy else None
        return ce, lse, correct


def head_temporaries(vocab: int, rows: int, width: int, chunks: int) -> tuple[int, int]:
    """Temporary bytes of the head alone, loss and gradients from `[rows, width]` hidden states:
    (chunked, unchunked)."""
    hidden = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    weight = jax.ShapeDtypeStruct((width, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((rows,), jnp.int32)

    def chunked(h, w, t):
        return jnp.sum(chunked_cross_entropy(h, w, t, False, chunks, None)[0])

    def unchunked(h, w, t):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(h @ w, t))

    sizes = []
    for loss in (chunked, unchunked):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, weight, targets).compile()
        sizes.append(compiled.memory_analysis().temp_size_in_bytes)
    return sizes[0], sizes[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4, help="LMObjective(head_chunks=...)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    tokens = args.batch * args.seq
    flops = decoder_flops_per_token(SHAPE["num_layers"], SHAPE["emb_features"], SHAPE["num_heads"],
                                    SHAPE["num_kv_heads"], SHAPE["mlp_features"], args.vocab, args.seq) * tokens
    peak = matmul_peak(jnp.float32)
    print(f"machine: {machine()}; XLA matmul peak (2048^2, fp32) {peak / 1e9:.0f} GFLOP/s")
    print(f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, fp32, AdamW; logits [N, V] float32 = "
          f"{tokens * args.vocab * 4 / 2**20:,.0f} MiB")

    class Chunked(LMObjective):
        def __init__(self, model, seq_len, **kwargs):
            super().__init__(model, seq_len, head_chunks=args.chunks, **kwargs)

    chunked_head, plain_head = head_temporaries(args.vocab, tokens, 256, args.chunks)
    print(f"the head alone (loss and gradients from [{tokens}, 256] hidden states): chunked "
          f"{chunked_head / 2**20:,.0f} MiB, unchunked {plain_head / 2**20:,.0f} MiB of temporaries: "
          f"{chunked_head / plain_head:.2f}x")
    results = {}
    for name, objective in ((f"chunked ({args.chunks} pieces)", Chunked), ("unchunked", UnchunkedHead)):
        seconds, _, temp = dew_step(args.vocab, args.seq, args.batch, jnp.float32, args.steps,
                                    objective_class=objective)
        results[name] = (seconds, temp)
        print(f"{name}: {tokens / seconds:,.0f} tokens/s ({flops / seconds / 1e9:.0f} GFLOP/s, "
              f"{flops / seconds / peak:.0%} of peak), step temporaries {temp / 2**20:,.0f} MiB")
    (chunked_s, chunked_temp), (plain_s, plain_temp) = results.values()
    print(f"whole step, chunked / unchunked: memory {chunked_temp / plain_temp:.2f}x (target <= 0.5x), "
          f"speed {plain_s / chunked_s:.3f}x (target >= 0.95x)")


if __name__ == "__main__":
    main()
