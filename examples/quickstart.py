"""The guide's quick start on the corpus this repository ships: train a small decoder on the King
James Bible on the CPU, then continue a prompt greedily and by sampling.

    make quickstart            # trains the BPE and tokenizes the corpus first, then runs this file
    python examples/quickstart.py --data data/kjv-bpe --tokenizer kjv-bpe

The code below is the guide's "Train a decoder on TinyStories" sized for a 2-core CPU (docs/performance.md,
"Quick start", times it). The tokenizer is a 4,096-id byte-level BPE trained on the corpus
(tools/train_tokenizer.py), not GPT-2's 50,257 ids, whose output head would cost several times the
rest of a step this narrow; `make quickstart-gpt2` runs this same file on GPT-2's tokenizer, the
guide's. The other choices, with their measurements in docs/performance.md: width 128 learns as much
per step as width 256 here at a fraction of the cost, so the budget goes to more steps; warmup and
cosine decay let a run this short use a high peak rate; four micro-batches a step keep the matmuls in
the CPU's cache (the same update as the whole batch); float32, because CPUs without bf16 instructions
(AVX2) run bf16 slower, while `--dtype bfloat16` trains faster where the CPU has them (AVX512-BF16, AMX).
A faster allocator is the launcher's to give, not this program's: `dew launch --allocator jemalloc --
python examples/quickstart.py` (docs/performance.md measures it).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import optax

from dew import Trainer, compilation_cache, metrics, models
from dew.data import HFTokenizer, Loading, TokenWindows
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling, generate

# A small model's argmax falls into a loop ("I will not be a man, and I will not be a man, ...").
# A repetition penalty (transformers' rule: the logits of tokens already in the row are divided by
# it) keeps the greedy line deterministic while steering it off the words it has used. Sampling stays
# below temperature 0.8, where this model coins words. docs/performance.md, "Quick start", has the
# values tried.
GREEDY = Sampling(temperature=0.0, repetition_penalty=1.3)
SAMPLED = Sampling(temperature=0.7, top_p=0.95)


def settings(sampling: Sampling) -> str:
    """The fields of `sampling` that differ from `Sampling()`, as name=value pairs."""
    default = Sampling()
    return ", ".join(f"{field.name}={getattr(sampling, field.name)}" for field in dataclasses.fields(sampling)
                     if getattr(sampling, field.name) != getattr(default, field.name))


def main():
    compilation_cache.configure()  # a second run skips the compiles the first paid for
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/kjv-bpe", help="directory tools/tokenize_text.py wrote")
    parser.add_argument("--tokenizer", default="kjv-bpe", help="the tokenizer the token files were written with")
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches a step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--width", type=int, default=128, help="emb_features; heads are 64 wide")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="steps of linear warmup")
    parser.add_argument("--ema", type=float, default=0.99, help="EMA decay of the weights validation reads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt", default="And God said")
    parser.add_argument("--new-tokens", type=int, default=60)
    args = parser.parse_args()

    tokenizer = HFTokenizer(args.tokenizer)
    data = TokenWindows(path=args.data, seq_len=args.seq_len, tokenizer=tokenizer.name,
                        loading=Loading(workers=0)).load(batch=args.batch)
    model = models.build("causal_transformer", vocab_size=tokenizer.vocab_size,
                         emb_features=args.width, num_layers=args.layers, num_heads=args.width // 64,
                         max_seq_len=args.seq_len, dtype=args.dtype)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, decay_steps=args.steps,
                                                  end_value=args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    # Validation and the continuations read an EMA of the weights (0.99: about the last 100 steps).
    objective = LMObjective(model, seq_len=args.seq_len, ema_decay=args.ema)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0))
    started = time.perf_counter()
    lm_state = trainer.fit(data, steps=args.steps, log_every=50, eval_every=args.steps // 2,
                           metrics=(metrics.perplexity(),), accumulation=args.accumulation)
    print(f"trained {args.steps} steps in {time.perf_counter() - started:.0f} s")
    perplexity = [row["val/perplexity"] for row in trainer.history if "val/perplexity" in row][-1]
    print(f"validation perplexity {perplexity:.1f} ({tokenizer.vocab_size}-id vocabulary)")

    prompt = tokenizer.encode(args.prompt)
    for label, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        continuation = generate(model, lm_state.averaged, [prompt], max_new_tokens=args.new_tokens,
                                key=jax.random.key(1), sampling=sampling)
        print(f"\n{label} ({settings(sampling)}):\n{tokenizer.decode(continuation.tokens[0])}")


if __name__ == "__main__":
    main()
