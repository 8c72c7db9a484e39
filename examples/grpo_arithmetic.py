"""GRPO on a verifiable toy task: a small decoder learns single-digit sums from rewards alone, on the CPU.

    python examples/grpo_arithmetic.py
    python examples/grpo_arithmetic.py --temperature 0.7 --top-k 5

The vocabulary is the task's own: the digits 0-9, "+", "=" and an end token. A prompt is "a+b=" with a
and b in 0..4, and a completion is rewarded 1 when its first token is the digit of a + b. The decoder
starts from random weights, so at first it answers about one prompt in a dozen by chance; the reward
is the only signal it ever sees (there is no supervised step). Each round draws `--group` completions
of each of `--prompts` random prompts from one snapshot of the policy (`GRPOObjective.rollout`),
normalises the rewards within each prompt's group, and takes `--updates` optimizer steps on that
batch, the clipped ratio holding each step near the snapshot. The sampler may temper and filter
(`--temperature`, `--top-k`): the ratio then compares the sampler's own distribution, tempered and
renormalised over the ids it kept. The printed reward is each round's mean over its rollouts, before
its updates.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import optax

from dew import Trainer, models
from dew.objectives.grpo import GRPOObjective
from dew.sampling import Sampling
from dew.training.mesh import place_batch

PLUS, EQUALS, END = 10, 11, 12
VOCAB = 13


def prompt(a: int, b: int) -> list[int]:
    return [a, PLUS, b, EQUALS]


def reward(prompt_ids: list[int], completion: list[int]) -> float:
    """1 when the completion's first token is the sum's digit, else 0: checked, not judged."""
    return float(bool(completion) and completion[0] == prompt_ids[0] + prompt_ids[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help="rollouts, each followed by its updates")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a rollout draws")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps on each rollout")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampler's temperature (above 0)")
    parser.add_argument("--top-k", type=int, default=None, help="the sampler keeps the k likeliest ids")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = models.build("causal_transformer", vocab_size=VOCAB, emb_features=64, num_layers=2, num_heads=4,
                         mlp_features=128, max_seq_len=8)
    objective = GRPOObjective(model, seq_len=5, reward=reward, group_size=args.group, max_new_tokens=2,
                              sampling=Sampling(temperature=args.temperature, top_k=args.top_k, eos_token_ids=(END,),
                                                pad_id=END))
    trainer = Trainer(objective, optax.adam(args.lr), key=jax.random.key(args.seed))
    state = trainer.init_state()
    rng = np.random.default_rng(args.seed)
    started, history = time.perf_counter(), []
    for round_index in range(args.rounds):
        prompts = [prompt(*rng.integers(0, 5, 2)) for _ in range(args.prompts)]
        key = jax.random.fold_in(jax.random.key(args.seed + 1), round_index)
        host_batch, rewards = objective.rollout(state.params, prompts, key)
        objective.check_batch(host_batch)
        batch = place_batch(trainer.mesh, host_batch)
        # Compiled once per batch shape: a filtering sampler's supports may take another padded width.
        step_fn = trainer.compile_step(state, batch)
        for _ in range(args.updates):
            state, out = step_fn(state, batch)
        history.append(float(rewards.mean()))
        if round_index % 10 == 0 or round_index == args.rounds - 1:
            stats = objective.summarize(jax.device_get(out["stats"]))
            print(f"round {round_index:3d} | reward {history[-1]:.3f} | loss {stats['loss']:+.4f} | "
                  f"ratio {stats['ratio']:.4f} | clipped {stats['clipped']:.3f} | "
                  f"{time.perf_counter() - started:.1f} s")
    first, last = np.mean(history[:10]), np.mean(history[-10:])
    print(f"mean reward: first 10 rounds {first:.3f}, last 10 rounds {last:.3f}")


if __name__ == "__main__":
    main()
