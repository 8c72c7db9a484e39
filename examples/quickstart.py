"""The guide's quick start on the corpus this repository ships: train a small decoder on the King
James Bible with GPT-2's tokenizer, on the CPU, then continue a prompt greedily.

    make quickstart            # tokenizes data/kjv.txt.xz first, then runs this file
    python examples/quickstart.py --data data/kjv-gpt2 --tokenizer gpt2 --steps 250

The code below is the guide's "Train a decoder on TinyStories" with sizes a 2-core CPU trains in a
few minutes: 128-token windows and a batch of 8 instead of 256 and 32, and float32 compute, because
this project's CPUs (AVX2, no bf16 instructions) run a bf16 step slower than a float32 one (0.79 s
against 0.62 s for the vocab-256 step in docs/performance.md).
"""

from __future__ import annotations

import argparse
import time

import jax
import optax

from dew import Trainer, metrics, models
from dew.data import HFTokenizer, Loading, TokenWindows
from dew.objectives.lm import LMObjective, Samples
from dew.sampling import Sampling, generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/kjv-gpt2", help="directory tools/tokenize_text.py wrote")
    parser.add_argument("--tokenizer", default="gpt2", help="the tokenizer the token files were written with")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--prompt", default="And God said")
    args = parser.parse_args()

    tokenizer = HFTokenizer(args.tokenizer)
    data = TokenWindows(path=args.data, seq_len=args.seq_len, tokenizer=tokenizer.name,
                        loading=Loading(workers=0)).load(batch=args.batch)
    model = models.build("causal_transformer", vocab_size=tokenizer.vocab_size,
                         emb_features=256, num_layers=4, num_heads=4, max_seq_len=args.seq_len,
                         dtype=args.dtype)
    # A short run: an EMA of 0.99 averages the last ~100 steps, so validation reads settled weights.
    samples = Samples(prompt=tokenizer.encode(args.prompt), max_new_tokens=24,
                      sampling=Sampling(temperature=0.8, top_k=40), decode=tokenizer.decode)
    objective = LMObjective(model, seq_len=args.seq_len, ema_decay=0.99, samples=samples)
    started = time.perf_counter()
    lm_state = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0)).fit(
        data, steps=args.steps, log_every=25, eval_every=args.steps // 2, metrics=(metrics.perplexity(),))
    print(f"trained {args.steps} steps in {time.perf_counter() - started:.0f} s")
    continuation = generate(model, lm_state.averaged, [tokenizer.encode(args.prompt)],
                            max_new_tokens=40, key=jax.random.key(1), sampling=Sampling(temperature=0.0))
    print(tokenizer.decode(continuation.tokens[0]))


if __name__ == "__main__":
    main()
