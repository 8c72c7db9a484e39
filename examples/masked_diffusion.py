"""The guide's masked-diffusion example on the corpus this repository ships: train a small bidirectional
decoder as an MDLM on the King James Bible on the CPU, then unmask a continuation of a prompt.

    make -o .venv/.installed-stamp data/kjv-bpe/meta.json    # the quick start's token files, if missing
    python examples/masked_diffusion.py --data data/kjv-bpe --tokenizer kjv-bpe

The code below is the guide's "Diffusion language models" example at the quick start's CPU sizes
(examples/quickstart.py says why: the 4,096-id BPE trained on the corpus, width 128, warmup and
cosine decay, four micro-batches a step, float32). As the guide says, windows of seq_len=127 hold 128
ids each and feed a 128-token objective, and the mask takes the id after the tokenizer's last. The
validation perplexity it prints is exp of the negative ELBO, an upper bound on the model's own, not
comparable with the autoregressive quick start's.
"""

from __future__ import annotations

import argparse
import time

import jax
import optax

from dew import Trainer, metrics, models
from dew.data import HFTokenizer, Loading, TokenWindows
from dew.diffusion.discrete import MDLM
from dew.objectives.diffusion import MaskedDiffusionObjective


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/kjv-bpe", help="directory tools/tokenize_text.py wrote")
    parser.add_argument("--tokenizer", default="kjv-bpe", help="the tokenizer the token files were written with")
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches a step")
    parser.add_argument("--seq-len", type=int, default=128, help="ids a row holds, the objective's seq_len")
    parser.add_argument("--width", type=int, default=128, help="emb_features; heads are 64 wide")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="steps of linear warmup")
    parser.add_argument("--ema", type=float, default=0.99, help="EMA decay of the weights validation reads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt", default="And God said")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()

    tokenizer = HFTokenizer(args.tokenizer)
    masked_data = TokenWindows(path=args.data, seq_len=args.seq_len - 1, tokenizer=tokenizer.name,
                               loading=Loading(workers=0)).load(batch=args.batch)
    mask_id = tokenizer.vocab_size
    process = MDLM(mask_id=mask_id)()
    masked_model = models.build("causal_transformer", vocab_size=mask_id + 1, emb_features=args.width,
                                num_layers=args.layers, num_heads=args.width // 64, max_seq_len=args.seq_len,
                                causal=False, dtype=args.dtype)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, decay_steps=args.steps,
                                                  end_value=args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    masked_objective = MaskedDiffusionObjective(masked_model, process, seq_len=args.seq_len, ema_decay=args.ema)
    trainer = Trainer(masked_objective, optimizer, key=jax.random.key(4))
    started = time.perf_counter()
    masked_state = trainer.fit(masked_data, steps=args.steps, log_every=50, eval_every=args.steps // 2,
                               metrics=(metrics.perplexity(),), accumulation=args.accumulation)
    print(f"trained {args.steps} steps in {time.perf_counter() - started:.0f} s")
    perplexity = [row["val/perplexity"] for row in trainer.history if "val/perplexity" in row][-1]
    print(f"validation perplexity bound {perplexity:.1f} (exp of the negative ELBO, {tokenizer.vocab_size}-id "
          "vocabulary)")

    started = time.perf_counter()
    drawn = process.generate(masked_model, masked_state.averaged, [tokenizer.encode(args.prompt)], args.new_tokens,
                             key=jax.random.key(5))
    seconds = time.perf_counter() - started
    print(f"\nunmasked {args.new_tokens} tokens in {int(drawn.refinements[0])} model evaluations "
          f"({seconds:.1f} s, compilation included):\n{tokenizer.decode(drawn.tokens[0])}")


if __name__ == "__main__":
    main()
