"""The first step of a small Qwen3-shaped model per attention kernel: its loss against float32's, and how far its
final hidden states lie from the reference run's.

    python tools/reference_runs/step0_attention.py [--layers 2] [--hidden 64] [--batch 2] [--seq-len 64] ...

One model (transformers' `Qwen3ForCausalLM`, random weights drawn under `--seed`; `torch_lm.py` beside this file
builds it and has its size arguments) scores one batch of uniform token ids before any update:

- torch's scaled-dot-product kernels that run on this machine (flash, cuDNN, memory-efficient, math; one that
  does not run here is a line saying why), at Dew's rounding points (`torch_lm.py --precision
  autocast-bf16-residual`) and under plain autocast;
- Dew's kernels, `dew.interop.pretrained.ATTENTION_IMPLS`, each loading the same weights (saved once with
  `save_pretrained`) through `load_pretrained(..., attention_impl=name)` in bfloat16 compute over float32
  parameters, Dew's rounding points, and in float32; a kernel whose backend is absent here is a line saying why.

Each row gives the first-step loss (the mean next-token cross entropy, float32 from the logits) minus torch's
float32 loss (its math kernel), and the relative distance `|h - h_ref| / |h_ref|` (Frobenius, over every token)
of its final-normed hidden states from the reference run's: torch's first kernel that runs here, at Dew's
rounding points. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # torch_lm.py, beside this file
import torch_lm  # noqa: E402

# torch's kernels, in the order the reference is chosen from (the first that runs), by SDPBackend name
TORCH_KERNELS = (("flash", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION"),
                 ("memory-efficient", "EFFICIENT_ATTENTION"), ("math", "MATH"))


def torch_step(model, tokens: np.ndarray, backend: str, precision: str):
    """(first-step loss, final hidden states as float32 `[B, S, E]`) of torch's `backend` kernel at `precision`;
    raises RuntimeError, with torch's own reasons, where the kernel does not run here."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as reasons:
        warnings.simplefilter("always")
        try:
            with torch.no_grad(), sdpa_kernel([getattr(SDPBackend, backend)]), torch_lm.precision(model, precision):
                loss, hidden = torch_lm.forward(model, tokens)
        except RuntimeError as error:
            said = "; ".join(dict.fromkeys(str(reason.message).strip() for reason in reasons)) or str(error)
            raise RuntimeError(said) from None
    return float(loss), hidden.float().numpy()


def dew_step(directory: Path, tokens: np.ndarray, kernel: str, dtype: str):
    """(first-step loss, final hidden states as float32) of Dew's attention `kernel` over the checkpoint in
    `directory`, computing in `dtype` over float32 parameters; raises ValueError where `load_pretrained` refuses
    the kernel (its backend is absent here)."""
    import jax
    import jax.numpy as jnp

    from dew.interop import load_pretrained
    from dew.objectives.lm import LMObjective

    bundle = load_pretrained(directory, dtype=dtype, param_dtype="float32", attention_impl=kernel,
                             max_seq_len=tokens.shape[1])
    objective = LMObjective(bundle.model, tokens.shape[1] - 1, ema_decay=None)
    scores = jax.jit(objective.token_scores)(bundle.variables, jnp.asarray(tokens, jnp.int32))
    loss = float(jnp.sum(scores.losses * scores.weights) / jnp.sum(scores.weights))
    return loss, np.asarray(scores.states, np.float32)


def distance(hidden: np.ndarray, reference: np.ndarray) -> float:
    """`|hidden - reference| / |reference|`, Frobenius norms in float64."""
    hidden, reference = np.asarray(hidden, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(hidden - reference) / np.linalg.norm(reference))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    torch_lm.add_model_arguments(parser)
    args = parser.parse_args(argv)
    from dew.interop.pretrained import ATTENTION_IMPLS

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
    where = "a CUDA device" if torch.cuda.is_available() else "this machine, which torch sees without a CUDA device"
    tokens = torch_lm.token_batches(args, 1)[0]
    model = torch_lm.build_model(args).eval()
    float32_loss, _ = torch_step(model, tokens, "MATH", "float32")
    runs, skipped = [], []
    for precision in ("autocast-bf16-residual", "autocast"):
        for name, backend in TORCH_KERNELS:
            try:
                runs.append(("torch", precision, name, *torch_step(model, tokens, backend, precision)))
            except RuntimeError as error:
                if precision == "autocast":  # said once, for the first precision
                    continue
                skipped.append(f"torch {name}: does not run on {where} ({error})")
    if not runs:
        raise RuntimeError("none of torch's attention kernels runs here, so there is no reference run")
    reference = runs[0]
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        for kernel in ATTENTION_IMPLS:
            for dtype, precision in (("bfloat16", "bfloat16 compute"), ("float32", "float32")):
                try:
                    runs.append(("Dew", precision, kernel, *dew_step(Path(directory), tokens, kernel, dtype)))
                except ValueError as error:
                    skipped.append(f"Dew {kernel}: {error}")
                    break

    print(f"first step per attention kernel: {torch_lm.describe(args)}")
    print(f"float32 loss (torch, math kernel) {float32_loss:.6f}; reference run: torch {reference[2]}, "
          f"{reference[1]}")
    print("| run | precision | attention kernel | first-step loss minus float32 | final hidden states, relative "
          "distance from the reference |")
    print("|---|---|---|---:|---:|")
    rows = []
    for framework, precision, kernel, loss, hidden in runs:
        rows.append({"run": framework, "precision": precision, "kernel": kernel, "loss_delta": loss - float32_loss,
                     "distance": distance(hidden, reference[4])})
        print(f"| {framework} | {precision} | {kernel} | {loss - float32_loss:+.2e} | {rows[-1]['distance']:.2e} |")
    for line in skipped:
        print(f"skipped: {line}")
    return {"float32_loss": float32_loss, "rows": rows, "skipped": skipped}


if __name__ == "__main__":
    main()
