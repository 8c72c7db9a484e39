"""PyTorch pickle checkpoints (pytorch_model.bin, or the shards pytorch_model.bin.index.json names),
converted once to safetensors so that every later load reads memory-mapped safetensors without torch.

The pickles are read with `torch.load(weights_only=True)`, which rebuilds tensors and plain containers
and runs no code from the file. The copy is written into a fresh directory that is renamed into place
only when whole, so a conversion stopped anywhere leaves no copy that a later load would read.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import secrets
import shutil
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from dew.interop.safetensors_files import (
    INDEX, SINGLE, fsync, indexed_files, os_errors, read_index, weight_files,
)

PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
INSTALL = "pip install 'dew-ml[torch]'"
CONVERT_SPACE = "https://huggingface.co/spaces/safetensors/convert"
# How torch's message begins when weights_only=True refused what a pickle holds.
_WEIGHTS_ONLY_REFUSAL = "Weights only load failed"

logger = logging.getLogger("dew.interop")


def pickle_files(directory: Path) -> tuple[list[Path], Path | None] | None:
    """The pickles `directory`'s pytorch_model.bin.index.json names (or pytorch_model.bin) and that index;
    None when it has neither."""
    return indexed_files(directory, PICKLE_INDEX, PICKLE)


def safetensors_copy(pickles: Sequence[Path], index: Path | None, destination: Path) -> tuple[list[Path], Path | None]:
    """The weight files and index of the safetensors copy of `pickles` kept in `destination`, converting
    them with torch only when no copy is there yet (reading a copy never imports torch)."""
    if not destination.is_dir():
        _convert(pickles, index, destination)
    return weight_files(destination)


def _convert(pickles: Sequence[Path], index: Path | None, destination: Path) -> None:
    """Write `pickles` as safetensors (one file per pickle, and an index when `index` is given) to `destination`."""
    torch = _import_torch(pickles)
    logger.info("converting PyTorch pickles %s to safetensors in %s (once; later loads read that copy)",
                [str(path) for path in pickles], destination)
    _remove_abandoned_staging(destination)
    staging = destination.with_name(f".{destination.name}.{secrets.token_hex(4)}.tmp")
    staging.mkdir(parents=True)
    try:
        if index is None:
            _convert_file(torch, pickles[0], staging / SINGLE)
        else:
            renamed = {path.name: f"{path.name.removesuffix('.bin')}.safetensors" for path in pickles}
            total = sum(_convert_file(torch, path, staging / renamed[path.name]) for path in pickles)
            weight_map = {name: renamed[file] for name, file in read_index(index).items()}
            text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
            (staging / INDEX).write_text(text + "\n", encoding="utf-8")
            fsync(staging / INDEX)
        try:
            os.rename(staging, destination)
        except OSError:
            if not destination.is_dir():
                raise
            # another process finished the same conversion first; its copy is as good as this one
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_abandoned_staging(destination: Path, age_seconds: float = 24 * 3600) -> None:
    """Delete staging directories of earlier conversions to `destination` that a killed process left,
    judged by age (a day untouched), so a conversion running now in another process keeps its own."""
    now = time.time()
    for staging in destination.parent.glob(f".{destination.name}.*.tmp"):
        try:
            if now - staging.stat().st_mtime > age_seconds:
                shutil.rmtree(staging, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process removed it first


def _import_torch(pickles: Sequence[Path]):
    try:
        import torch
    except ImportError:
        raise ImportError(f"{[str(path) for path in pickles]} are PyTorch pickles: Dew reads them once with "
                          f"torch.load(weights_only=True) and keeps a safetensors copy, which needs torch "
                          f"({INSTALL}); or convert them at {CONVERT_SPACE} and load the safetensors") from None
    return torch


def _convert_file(torch, source: Path, target: Path) -> int:
    """Write the tensors of the pickle `source` to the safetensors file `target`, in their own dtypes; returns bytes."""
    from safetensors.torch import save_file

    state = _load_pickle(torch, source)
    tensors, storages = {}, set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{source} holds {name!r} as a {type(tensor).__name__}, not a tensor: it is not a "
                             "transformers weights file")
        storage = tensor.untyped_storage().data_ptr()
        # torch stores tied weights once; safetensors refuses tensors that share memory, so each gets its own
        tensors[name] = tensor.clone() if storage in storages else tensor.contiguous()
        storages.add(storage)
    with os_errors(target):
        save_file(tensors, str(target), metadata={"format": "pt"})
    fsync(target)
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _load_pickle(torch, source: Path) -> dict:
    # only the zip format (torch >= 1.6) can be memory-mapped; older pickles are read whole
    try:
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(source))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        # torch's refusals under weights_only=True advise weights_only=False, which would run the file's code:
        # a file that asks to call something is refused as code, any other keeps only torch's reason
        reason = str(error)
        if reason.startswith(_WEIGHTS_ONLY_REFUSAL):
            called = re.search(r"GLOBAL ([\w.]+)", reason)
            if called:
                raise ValueError(f"{source} asks to call {called[1]} when it is unpickled: the file wants to run code, "
                                 "and Dew will not load it (it reads pickles with torch.load(weights_only=True), which "
                                 "runs none); load the model's safetensors weights instead") from None
            stated = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", reason, re.S)
            reason = stated[1] if stated else "it holds something other than tensors"
        raise ValueError(f"{source} is not a PyTorch weights file torch.load(weights_only=True) reads "
                         f"({' '.join(reason.split())}): it is truncated or corrupt, or pickles objects other than "
                         f"tensors; download it again, or convert it at {CONVERT_SPACE}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{source} holds a {type(state).__name__}, not a tensor-name-to-tensor mapping: it is not a "
                         "transformers weights file")
    return state
