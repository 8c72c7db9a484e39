"""`dew.pipeline(source)`: a generation task from a run directory or a published checkpoint."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from dew import models
from dew.diffusion.block import BlockProcess
from dew.diffusion.discrete import DiscreteProcess
from dew.inference.block import BlockGeneration
from dew.inference.masked import MaskedGeneration
from dew.inference.text import TextGeneration
from dew.nn.lora import LoRA, LoRAModel
from dew.nn.quantize import WEIGHT_FORMATS, bfloat16_bits, quantize_int8, stacked_in_place
from dew.nn.transformer import CausalTransformer, as_dtype
from dew.runs.run_dir import RunDirectory, run_files_without_record
from dew.sampling import Sampling
from dew.sharding import with_names
from dew.training.mesh import Layout, MeshSpec
from dew.trees import overlay


def pipeline(source: str | os.PathLike, *, ema: bool = True, step: int | None = None, quantize: str | None = None,
             dtype: str | None = None, **load) -> TextGeneration | MaskedGeneration | BlockGeneration:
    """The decoder behind `source` as a `TextGeneration` task, with the source's sampling and budget
    (a `MaskedGeneration` for a masked-diffusion run, with native MDLM's default sampler; a
    `BlockGeneration` for a block-diffusion run, with its checkpoint's block sampler, EOS and budget).

    `source` is one of:
    - a run directory (it holds `run.json`): the recorded model and the run's own tokenizer, with
      the checkpoint at `step` (default the newest that reads): the averaged weights when `ema` is
      set and the run keeps them (its generation record's `ema`), else the live ones;
    - a run's checkpoint directory, RUN/checkpoints/STEP: that run at that step;
    - a GGUF file (`*.gguf`): `dew.interop.load_pretrained(its directory, gguf_file=its name, **load)`;
    - anything else, a published checkpoint for `dew.interop.load_pretrained(source, **load)`: a
      masked-diffusion family's (LLaDA, Dream) as a `MaskedGeneration` running native MDLM over its mask id.
    Either way the weights are placed once on the current device mesh, split as the Trainer splits
    them (`mesh=MeshSpec()`, `layout=Layout()` unless `load` names others; those two are the only
    options a run takes). `quantize="int8"` holds the weights as int8 for faster decoding on a CPU
    (`dew.nn.quantize`; autoregressive models on one device); `quantize="gguf"` keeps a GGUF file's own
    4-bit (or 8-bit) blocks and multiplies them as they are (`dew.interop.gguf_blocks`; GGUF files only).

    `dtype` is the compute dtype of a published checkpoint (default float32, `load_pretrained`'s).
    `dtype="bfloat16"` also holds the weights in bfloat16 unless `param_dtype` says otherwise (half
    float32's bytes; the products run in oneDNN's bfloat16 gemm where the CPU has it, and the KV cache is
    bfloat16), while norms, softmax and logits stay float32, as transformers runs a bfloat16 model.

    A causal decoder's scanned layers keep their linear weights stacked, read in place by decoding
    (`dew.nn.quantize.stacked_in_place`): `task.params` is for generation, not for training or saving
    (`model.unstack_variables` gives the per-layer tree).
    """
    return _in_place(_task(source, ema=ema, step=step, quantize=quantize, dtype=dtype, **load))


def _in_place(task):
    """`task` with a causal decoder's scanned float kernels held whole, read in place by decode steps."""
    if isinstance(task, TextGeneration) and isinstance(task.model, CausalTransformer):
        return dataclasses.replace(task, params=stacked_in_place(task.model, task.params))
    return task


def _task(source, *, ema: bool, step: int | None, quantize: str | None, dtype: str | None, **load):
    path = Path(source)
    run, run_step = run_of(path)
    if dtype is not None:
        load["dtype"] = dtype
    if run is not None:
        if step is not None and run_step is not None and step != run_step:
            raise ValueError(f"{source} is the checkpoint of step {run_step}, and step={step} asks for another: "
                             "pass the run directory with step=, or the checkpoint directory alone")
        unknown = sorted(set(load) - {"mesh", "layout"})
        if unknown:
            why = (f" (dtype={dtype!r}: a run generates in the dtype it recorded; export it with dew export and load "
                   "that directory to choose another)" if dtype is not None else "")
            raise TypeError(f"a run directory takes only the placement options mesh= and layout=; got {unknown}{why}")
        task = _from_run(run, ema=ema, step=run_step if step is None else step, mesh=load.get("mesh") or MeshSpec(),
                         layout=load.get("layout") or Layout())
        if quantize is None:
            return task
        _check_quantizable(task, quantize, source)
        if quantize == "gguf":
            raise ValueError(f"quantize='gguf' keeps a GGUF file's quantized blocks, and {source} is a run: use "
                             "quantize='int8', or export the run to GGUF and load that file")
        devices = (load.get("mesh") or MeshSpec()).build().devices.size
        if devices > 1:
            raise NotImplementedError(f"quantize={quantize!r} over a mesh of {devices} devices (int8 weights split over "
                                      "several devices) is not built in Dew yet: quantize on one device")
        return dataclasses.replace(task, params=quantize_int8(task.model, {"params": task.params}))
    found = [] if (path / "config.json").is_file() else run_files_without_record(path)
    if found:
        raise FileNotFoundError(f"{source} holds no run.json, though it holds a run's {', '.join(found)}: run.json "
                                "records the model its checkpoints are read into; restore it from a backup (the run "
                                "cannot be read without it), or pass a transformers checkpoint directory (with "
                                "config.json) or a GGUF file")
    from dew.interop import load_pretrained  # the checkpoint readers load when a published checkpoint is asked for

    if path.suffix == ".gguf" and path.is_file():
        load = {"gguf_file": path.name, **load}
        source = path.parent
    if quantize is not None:
        load["quantize"] = quantize
    bfloat16 = dtype is not None and as_dtype(dtype) == jnp.bfloat16
    if bfloat16:
        load.setdefault("param_dtype", "bfloat16")
    task = load_pretrained(source, **{"mesh": MeshSpec(), "layout": Layout(), **load}).text_generation()
    if quantize is not None:
        _check_quantizable(task, quantize, source)
    if bfloat16 and isinstance(task, TextGeneration) and isinstance(task.model, CausalTransformer):
        task = dataclasses.replace(task, params=bfloat16_bits(task.model, task.params))
    return task


def _check_quantizable(task, quantize: str, source) -> None:
    if quantize not in WEIGHT_FORMATS:
        raise ValueError(f"quantize={quantize!r} is not a weight format Dew builds: use one of {WEIGHT_FORMATS}, "
                         "or None")
    if isinstance(task, (MaskedGeneration, BlockGeneration)):
        kind = "masked" if isinstance(task, MaskedGeneration) else "block"
        raise NotImplementedError(f"{source} is a {kind}-diffusion model, and quantized weights are built for "
                                  "token-by-token decoding only: leave quantize unset")



def run_of(path: Path) -> tuple[Path | None, int | None]:
    """(the run directory, the checkpoint step) that `path` names: a run, RUN/checkpoints (its newest
    checkpoint) or RUN/checkpoints/STEP; (None, None) for anything else."""
    if (path / "run.json").is_file():
        return path, None
    if path.name == "checkpoints" and (path.parent / "run.json").is_file():
        return path.parent, None
    if path.name.isdigit() and path.parent.name == "checkpoints" and (path.parent.parent / "run.json").is_file():
        return path.parent.parent, int(path.name)
    return None, None


def _from_run(path: Path, *, ema: bool, step: int | None, mesh,
              layout) -> TextGeneration | MaskedGeneration | BlockGeneration:
    run = RunDirectory(path)
    record = run.record()
    generation = record.get("generation", {})
    block = generation.get("process") == "block"
    if block and "block_process" not in generation:
        raise ValueError(f"{path} is a block-diffusion run recorded before Dew kept its sampler in run.json: export "
                         "the trained weights with dataclasses.replace(bundle, model=objective.model).save(directory, "
                         "variables=state.params) and load that directory, or train the run again")
    model = models.build(record["model"]["name"], **record["model"]["config"])
    if not run.checkpoint_steps():
        raise FileNotFoundError(f"{path} has no checkpoint yet: train it first (its run.json holds the command)")
    from dew.training.checkpoints import Checkpoints  # Orbax loads when a run is read, not for a checkpoint file

    checkpoints = Checkpoints(run.checkpoints, keep=None)
    try:
        saved = checkpoints.restore_tree(step)
    finally:
        checkpoints.close()
    # A run whose EMA slot holds a frozen reference rather than an average (dpo, grpo) records "ema": false,
    # and generates from its live weights.
    use_ema = ema and generation.get("ema", True) and saved.get("ema") is not None
    # With frozen parameters (a LoRA run) the EMA holds only the trained part: laid over the rest.
    params = overlay(saved["params"], saved["ema"]) if use_ema else saved["params"]
    budget = generation.get("max_new_tokens") or None
    if block:
        # DiffusionGemma names no logical axes: placed by the layout's size rule, as the trainer placed it.
        params = jax.device_put(params, layout.shardings(mesh.build(), params))
        return BlockGeneration(model, params, BlockProcess(**generation["block_process"]), tokenizer=run.tokenizer(),
                               max_new_tokens=budget, eos_token_ids=generation["eos_token_ids"],
                               pad_id=generation["pad_id"])
    # In the model's own form (a run written before its layers were scanned holds them one by one),
    # placed by each parameter's logical names as the trainer places them.
    params = model.stack_variables(params)
    lora = (record.get("settings") or {}).get("lora")
    if lora:  # a LoRA run generates with its adapters folded into the kernels
        params = LoRAModel(model, LoRA(**lora)).merge(params)
    params = jax.device_put(params, layout.shardings(mesh.build(), with_names(params, model.logical_names())))
    if generation.get("process") == "mdlm":
        # Native MDLM with its default sampler (64 steps): a run records no sampler choice and no EOS.
        process = DiscreteProcess(generation["mask_id"], logits_shift=generation.get("logits_shift", 0))
        return MaskedGeneration(model, params, process, tokenizer=run.tokenizer(), max_new_tokens=budget)
    sampling = Sampling(**generation.get("sampling", {}))
    return TextGeneration(model, params, tokenizer=run.tokenizer(), sampling=sampling, max_new_tokens=budget)
