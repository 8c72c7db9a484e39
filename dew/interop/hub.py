"""Where a checkpoint's files are: a local directory, or a Hub repository fetched through huggingface_hub.

From the Hub the configs and the index come first, then only the weight files the index's
weight_map names (or model.safetensors when there is none); other copies in the repository stay
there. `repo@revision` pins a branch, tag or commit; the commit the Hub resolved is recorded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError

from dew.interop.safetensors_files import INDEX, SINGLE, read_index, weight_files

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A checkpoint's files on this machine: `directory` holds config.json and the tokenizer files,
    `weights` the weight files to read (index-listed shards or model.safetensors), `index` the index.
    `revision` is the Hub commit, None for a local directory."""

    directory: Path
    weights: list[Path]
    index: Path | None
    revision: str | None


def resolve(source: str | Path) -> Snapshot:
    """The files of `source`: a local checkpoint directory, a Hub id, or `repo@revision`."""
    path = Path(source)
    if path.is_dir():
        return _local(path)
    if path.exists():
        raise ValueError(f"{path} is a file: pass the checkpoint directory that holds config.json and the weights")
    repo, _, revision = str(source).partition("@")
    try:
        return _hub(repo, revision or None)
    except HFValidationError:
        raise FileNotFoundError(f"{source!r} is neither a local directory nor a Hub repository id "
                                "('org/name' or 'org/name@revision')") from None


def resolve_gguf(source: str | Path, gguf_file: str) -> Snapshot:
    """The GGUF file `gguf_file` of a local directory or Hub repository, with its tokenizer files if any."""
    path = Path(source)
    if path.is_dir():
        if not (path / gguf_file).is_file():
            present = sorted(p.name for p in path.glob("*.gguf"))
            raise FileNotFoundError(f"{path} holds no {gguf_file}; its GGUF files are {present}")
        return Snapshot(path, [path / gguf_file], None, None)
    repo, _, revision = str(source).partition("@")
    weights = Path(hf_hub_download(repo, gguf_file, revision=revision or None))
    commit = weights.parent.name
    for name in (GENERATION_CONFIG, *TOKENIZER_FILES):
        _fetch(repo, name, commit)
    return Snapshot(weights.parent, [weights], None, commit)


def _local(directory: Path) -> Snapshot:
    if not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: pass a transformers checkpoint directory")
    if not (directory / INDEX).is_file() and not (directory / SINGLE).is_file():
        raise FileNotFoundError(_no_weights_message(directory, sorted(p.name for p in directory.iterdir())))
    files, index = weight_files(directory)
    return Snapshot(directory, files, index, None)


def _no_weights_message(where, names: list[str]) -> str:
    ggufs = [name for name in names if name.endswith(".gguf")]
    if ggufs:
        return (f"{where} holds no safetensors weights but GGUF file(s) {ggufs}: load one with "
                f"load_pretrained(..., gguf_file={ggufs[0]!r})")
    pickles = [name for name in names if name.startswith("pytorch_model") and name.endswith((".bin", ".json"))]
    if pickles:
        return (f"{where} holds only PyTorch pickles {pickles}: reading them is not built in Dew yet; convert them to "
                "safetensors (https://huggingface.co/spaces/safetensors/convert) and load that")
    return f"{where} holds neither {INDEX} nor {SINGLE} (files: {names})"


def _fetch(repo: str, filename: str, revision: str | None) -> Path | None:
    """One file from the Hub (or the local cache when offline); None when the repository has no such file."""
    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except EntryNotFoundError:
        return None


def _hub(repo: str, revision: str | None) -> Snapshot:
    # config.json must exist: huggingface_hub's own error says whether the repository, the revision
    # or (offline) the cached copy is what is missing.
    config = Path(hf_hub_download(repo, CONFIG, revision=revision))
    commit = config.parent.name  # the cache keeps each file under snapshots/<commit>/
    for name in (GENERATION_CONFIG, *TOKENIZER_FILES):
        _fetch(repo, name, commit)
    index = _fetch(repo, INDEX, commit)
    if index is not None:
        names = sorted(set(read_index(index).values()))
        weights = [_fetch(repo, name, commit) for name in names]
        missing = [name for name, path in zip(names, weights) if path is None]
        if missing:
            raise FileNotFoundError(f"{repo}@{commit}: {INDEX} names shard(s) {missing} the repository does not hold")
    else:
        single = _fetch(repo, SINGLE, commit)
        if single is None:
            raise FileNotFoundError(f"Hub repository {repo}@{commit} has neither {INDEX} nor {SINGLE}: Dew loads "
                                    "safetensors weights (a GGUF file loads with gguf_file=)")
        weights = [single]
    return Snapshot(config.parent, weights, index, commit)
