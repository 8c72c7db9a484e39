"""The first step of a small Qwen3-shaped model per attention kernel: its loss against float32's, and how far its
final hidden states lie from the reference run's and from float32's.

    python tools/reference_runs/step0_attention.py [--interpret] [--layers 2] [--hidden 64] [--batch 2] ...

One model (transformers' `Qwen3ForCausalLM`, random weights drawn under `--seed`; `torch_lm.py` beside this file
builds it and has its size arguments) scores one batch of uniform token ids before any update:

- torch's scaled-dot-product kernels that run on this machine (flash, cuDNN, memory-efficient, math; one that
  does not run here is a line saying why), at Dew's rounding points (`torch_lm.py --precision
  autocast-bf16-residual`) and under plain autocast;
- Dew's kernels for this process's JAX backend (`dew.kernels.accelerator_attention`): "xla" everywhere, "splash"
  on a TPU, "cudnn" on a GPU; with `--interpret`, splash also off a TPU, through Pallas's interpreter (labelled
  so). Each loads the same weights (saved once with `save_pretrained`) through `load_pretrained(...,
  attention_impl=name)` in bfloat16 compute over float32 parameters, Dew's rounding points, and in float32.
  "auto" is not a row of its own: it runs one of these. The "ran in" column is the attention kernel Dew recorded
  while tracing (`dew.kernels.policy.recording`): "dew" is Dew's fused CPU attention (`dew.kernels.softmax`).

Each row gives the first-step loss (the mean next-token cross entropy, float32 from the logits) minus torch's
float32 loss (its math kernel), and the relative distance `|h - h_ref| / |h_ref|` (Frobenius, over every token)
of its final-normed hidden states from the reference run's (torch's first kernel that runs here, at Dew's
rounding points) and from torch's float32 run's. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
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


def dew_kernels(backend: str, interpret: bool) -> tuple[list[tuple[str, str, bool]], list[str]]:
    """Dew's attention kernels to run on the JAX `backend` ("cpu", "gpu", "tpu"), "xla" first: (the row's label,
    the `attention_impl`, whether through Pallas's interpreter) each; and a line per kernel left out, saying why."""
    from dew.kernels.accelerator_attention import BACKENDS

    runs, skipped = [("xla", "xla", False)], []
    for kernel, home in BACKENDS.items():
        if backend == home:
            runs.append((kernel, kernel, False))
        elif kernel == "splash" and interpret:
            runs.append(("splash (Pallas interpreter)", kernel, True))
        else:
            hint = " (--interpret runs it through Pallas's interpreter)" if kernel == "splash" else ""
            skipped.append(f"Dew {kernel}: runs on a {home.upper()}, and this process's backend is {backend}{hint}")
    return runs, skipped


def dew_step(directory: Path, tokens: np.ndarray, kernel: str, dtype: str, interpret: bool = False):
    """(first-step loss, final hidden states as float32, the attention kernel that ran) of Dew's attention `kernel`
    over the checkpoint in `directory`, computing in `dtype` over float32 parameters, with `interpret` through
    Pallas's interpreter; raises ValueError where `load_pretrained` refuses the kernel here."""
    import jax
    import jax.numpy as jnp

    from dew.interop import load_pretrained
    from dew.kernels import accelerator_attention, policy
    from dew.objectives.lm import LMObjective

    where = accelerator_attention.interpreting() if interpret else contextlib.nullcontext()
    with where, policy.recording() as choices:
        bundle = load_pretrained(directory, dtype=dtype, param_dtype="float32", attention_impl=kernel,
                                 max_seq_len=tokens.shape[1])
        objective = LMObjective(bundle.model, tokens.shape[1] - 1, ema_decay=None)
        scores = jax.jit(objective.token_scores)(bundle.variables, jnp.asarray(tokens, jnp.int32))
    loss = float(jnp.sum(scores.losses * scores.weights) / jnp.sum(scores.weights))
    ran = ", ".join(sorted({choice for key, choice in choices.items() if key.startswith("attention/")}))
    return loss, np.asarray(scores.states, np.float32), ran


def distance(hidden: np.ndarray, reference: np.ndarray) -> float:
    """`|hidden - reference| / |reference|`, Frobenius norms in float64."""
    hidden, reference = np.asarray(hidden, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(hidden - reference) / np.linalg.norm(reference))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="off a TPU, run Dew's splash kernel too, through "
                        "Pallas's interpreter on this backend")
    torch_lm.add_model_arguments(parser)
    args = parser.parse_args(argv)
    import jax
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
    where = "a CUDA device" if torch.cuda.is_available() else "this machine, which torch sees without a CUDA device"
    tokens = torch_lm.token_batches(args, 1)[0]
    model = torch_lm.build_model(args).eval()
    float32_loss, float32_hidden = torch_step(model, tokens, "MATH", "float32")
    runs, skipped = [], []  # runs: (framework, precision, kernel, the kernel that ran, loss, hidden states)
    for precision in ("autocast-bf16-residual", "autocast"):
        for name, backend in TORCH_KERNELS:
            try:
                runs.append(("torch", precision, name, backend, *torch_step(model, tokens, backend, precision)))
            except RuntimeError as error:
                if precision == "autocast":  # said once, for the first precision
                    continue
                skipped.append(f"torch {name}: does not run on {where} ({error})")
    if not runs:
        raise RuntimeError("none of torch's attention kernels runs here, so there is no reference run")
    reference = runs[0]
    kernels, left_out = dew_kernels(jax.default_backend(), args.interpret)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        for label, kernel, interpret in kernels:
            for dtype, precision in (("bfloat16", "bfloat16 compute"), ("float32", "float32")):
                try:
                    loss, hidden, ran = dew_step(Path(directory), tokens, kernel, dtype, interpret)
                except ValueError as error:
                    skipped.append(f"Dew {label}: {error}")
                    break
                runs.append(("Dew", precision, label, ran, loss, hidden))
    skipped += left_out

    print(f"first step per attention kernel: {torch_lm.describe(args)}; JAX backend {jax.default_backend()}")
    print(f"float32 loss (torch, math kernel) {float32_loss:.6f}; reference run: torch {reference[2]}, "
          f"{reference[1]}")
    print("| run | precision | attention kernel | ran in | first-step loss minus float32 | final hidden states, "
          "relative distance from the reference | from float32 |")
    print("|---|---|---|---|---:|---:|---:|")
    rows = []
    for framework, precision, kernel, ran, loss, hidden in runs:
        rows.append({"run": framework, "precision": precision, "kernel": kernel, "ran_in": ran,
                     "loss_delta": loss - float32_loss, "distance": distance(hidden, reference[5]),
                     "distance_float32": distance(hidden, float32_hidden)})
        row = rows[-1]
        print(f"| {framework} | {precision} | {kernel} | {ran} | {row['loss_delta']:+.2e} | {row['distance']:.2e} "
              f"| {row['distance_float32']:.2e} |")
    for line in skipped:
        print(f"skipped: {line}")
    return {"float32_loss": float32_loss, "rows": rows, "skipped": skipped}

if __name__ == "__main__":
    main()
