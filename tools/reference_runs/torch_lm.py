"""The torch reference run: a few AdamW steps of a small Qwen3-shaped model at one of the guide's precisions.

    python tools/reference_runs/torch_lm.py --precision autocast-bf16-residual [--steps 8] [--layers 2] ...

The model is transformers' `Qwen3ForCausalLM` built locally from a `Qwen3Config` of the sizes given (random
weights drawn under `--seed`, float32 parameters, nothing downloaded); the batches are uniform token ids from
the same seed, `--batch` rows of `--seq-len + 1` ids a step. Each step scores the next-token cross entropy in
float32 from the logits and takes one AdamW step. The precisions:

- `float32`: everything in float32;
- `autocast`: `torch.autocast` in bfloat16, which rounds each matmul's inputs and keeps the residual stream and
  the norms in float32;
- `autocast-bf16-residual`: autocast with Dew's rounding points (the guide's "Loss, precision, and evaluation"):
  the embedding output and every RMSNorm output cast to bfloat16, so the residual stream and every norm and
  sublayer output are bfloat16, and the rotary table left in float32.

A run at another precision runs the float32 one beside it and prints, per step, its loss and gradient norm and
their differences from float32's. `tools/reference_runs/step0_attention.py` compares the first step across
attention kernels, Dew's included.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from collections.abc import Sequence

import numpy as np

PRECISIONS = ("float32", "autocast", "autocast-bf16-residual")
DEVICE = "cpu"  # the run's device: torch's CPU build is the one Dew installs (and the one a TPU machine takes)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's and the batch's sizes and the seed, shared with step0_attention.py."""
    sizes = parser.add_argument_group("model and batch")
    sizes.add_argument("--layers", type=int, default=2)
    sizes.add_argument("--hidden", type=int, default=64)
    sizes.add_argument("--heads", type=int, default=4)
    sizes.add_argument("--kv-heads", type=int, default=2)
    sizes.add_argument("--head-dim", type=int, default=16)
    sizes.add_argument("--intermediate", type=int, default=192)
    sizes.add_argument("--vocab", type=int, default=512)
    sizes.add_argument("--batch", type=int, default=2)
    sizes.add_argument("--seq-len", type=int, default=64, help="targets a row (each row holds one id more)")
    sizes.add_argument("--init-std", type=float, default=0.02, help="the weights' standard deviation "
                       "(transformers' initializer_range)")
    sizes.add_argument("--seed", type=int, default=0)


def qwen3_config(args: argparse.Namespace, attention: str = "sdpa"):
    """transformers' `Qwen3Config` of the arguments' sizes (tied embeddings, as Qwen3-0.6B's)."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max(args.seq_len + 1, 64), initializer_range=args.init_std,
        tie_word_embeddings=True, rms_norm_eps=1e-6, attn_implementation=attention, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)


def build_model(args: argparse.Namespace, attention: str = "sdpa"):
    """A float32 `Qwen3ForCausalLM` with the arguments' sizes, its weights drawn under `args.seed`."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    return transformers.Qwen3ForCausalLM(qwen3_config(args, attention)).to(DEVICE).train()


def token_batches(args: argparse.Namespace, steps: int) -> np.ndarray:
    """int64 `[steps, batch, seq_len + 1]` ids drawn uniformly under `args.seed`."""
    return np.random.default_rng(args.seed).integers(0, args.vocab, (steps, args.batch, args.seq_len + 1))


@contextlib.contextmanager
def precision(model, name: str):
    """Run `model` at precision `name` (see the module) inside the block."""
    import torch

    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r} is not one of {PRECISIONS}")
    if name == "float32":
        yield
        return
    hooks = []
    if name == "autocast-bf16-residual":
        to_bf16 = lambda module, inputs, output: output.to(torch.bfloat16)  # noqa: E731
        hooks.append(model.model.embed_tokens.register_forward_hook(to_bf16))
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                hooks.append(module.register_forward_hook(to_bf16))
        # the rotary table takes the dtype of the states it is handed: hand it float32 ones
        hooks.append(model.model.rotary_emb.register_forward_pre_hook(_float32_states, with_kwargs=True))
    try:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            yield
    finally:
        for hook in hooks:
            hook.remove()


def _float32_states(module, args, kwargs):
    import torch

    if args:
        return (args[0].to(torch.float32), *args[1:]), kwargs
    return args, {**kwargs, "x": kwargs["x"].to(torch.float32)}


def forward(model, tokens: np.ndarray):
    """(the mean next-token cross entropy, float32 from the logits; the final-normed hidden states `[B, S, E]`)
    of `tokens [B, S + 1]`."""
    import torch

    ids = torch.as_tensor(tokens, device=DEVICE)
    hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state
    logits = model.lm_head(hidden)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    return loss, hidden


def train(args: argparse.Namespace, name: str, batches: np.ndarray, learning_rate: float) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each step of AdamW at precision `name` over `batches`, from fresh weights."""
    import torch

    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    steps = []
    for tokens in batches:
        optimizer.zero_grad()
        with precision(model, name):
            loss, _ = forward(model, tokens)
        loss.backward()
        norm = torch.sqrt(sum(torch.sum(p.grad.float() ** 2) for p in model.parameters() if p.grad is not None))
        optimizer.step()
        steps.append((loss.item(), norm.item()))
    return steps


def describe(args: argparse.Namespace) -> str:
    """One line naming the model, the batch, the seed and the machine."""
    import torch
    import transformers

    return (f"Qwen3-shaped: {args.layers} layers, width {args.hidden}, {args.heads} heads ({args.kv_heads} key/value) "
            f"of {args.head_dim}, MLP {args.intermediate}, vocab {args.vocab}, init std {args.init_std}; batch "
            f"{args.batch} x {args.seq_len} tokens; seed {args.seed}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}, {_cpu()}")


def _cpu() -> str:
    """The CPU's model name where /proc/cpuinfo gives it, else the machine's architecture."""
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]} x {len(names)}" if names else platform.machine()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=PRECISIONS, default="autocast-bf16-residual")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    batches = token_batches(args, args.steps)
    run = train(args, args.precision, batches, args.learning_rate)
    reference = run if args.precision == "float32" else train(args, "float32", batches, args.learning_rate)
    print(f"torch reference run, precision {args.precision}, AdamW lr {args.learning_rate}: {describe(args)}")
    print("| step | loss | loss - float32 | grad norm | grad norm - float32 |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for step, ((loss, norm), (loss32, norm32)) in enumerate(zip(run, reference)):
        rows.append({"step": step, "loss": loss, "loss_delta": loss - loss32, "grad_norm": norm,
                     "grad_norm_delta": norm - norm32})
        print(f"| {step} | {loss:.6f} | {loss - loss32:+.2e} | {norm:.6f} | {norm - norm32:+.2e} |")
    return rows


if __name__ == "__main__":
    main()
