"""Where a checkpoint's files are: a local directory, or a Hub repository fetched through huggingface_hub.

From the Hub the configs and the index come first, then only the weight files the index's
weight_map names (or model.safetensors when there is none); other copies in the repository stay
there. `repo@revision` pins a branch, tag or commit; the commit the Hub resolved is recorded.

A checkpoint with only PyTorch pickles loads from the safetensors pull request SFconvertbot opened
for that commit when the Hub has one, else from a safetensors copy Dew converts once and keeps
under `$XDG_CACHE_HOME/dew/converted/` (see `torch_files`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, OfflineModeIsEnabled
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import httpx

from dew.interop import torch_files
from dew.interop.safetensors_files import INDEX, SINGLE, read_index, weight_files
from dew.interop.torch_files import PICKLE, PICKLE_INDEX

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
CONVERSION_BOT = "SFconvertbot"

logger = logging.getLogger("dew.interop")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A checkpoint's files on this machine: `directory` holds config.json and the tokenizer files,
    `weights` the weight files to read (index-listed shards or model.safetensors; for PyTorch pickles,
    their safetensors copy under dew/converted/), `index` the index.
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


def converted_directory(*paths: Path) -> Path:
    """Where files Dew derives from checkpoint files are kept: `$XDG_CACHE_HOME/dew/converted/` (or
    ~/.cache/dew/converted/), named after the first file and keyed by each file's resolved path, size and
    modification time, so a replaced source gets a fresh copy."""
    stats = [(path.resolve(), path.stat()) for path in paths]
    described = "\n".join(f"{resolved}:{stat.st_size}:{stat.st_mtime_ns}" for resolved, stat in stats)
    key = hashlib.sha256(described.encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "dew" / "converted" / f"{paths[0].stem}-{key}"


def _local(directory: Path) -> Snapshot:
    if not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: pass a transformers checkpoint directory")
    if (directory / INDEX).is_file() or (directory / SINGLE).is_file():
        return Snapshot(directory, *weight_files(directory), None)
    pickles = torch_files.pickle_files(directory)
    if pickles is None:
        raise FileNotFoundError(_no_weights_message(directory, sorted(p.name for p in directory.iterdir())))
    return Snapshot(directory, *_converted(*pickles), None)


def _converted(pickles: list[Path], index: Path | None) -> tuple[list[Path], Path | None]:
    """The safetensors copy of PyTorch pickles (and their index): weight files and index."""
    sources = [*pickles, index] if index is not None else pickles
    return torch_files.safetensors_copy(pickles, index, converted_directory(*sources))


def _no_weights_message(where, names: list[str]) -> str:
    ggufs = [name for name in names if name.endswith(".gguf")]
    if ggufs:
        return (f"{where} holds no safetensors weights but GGUF file(s) {ggufs}: load one with "
                f"load_pretrained(..., gguf_file={ggufs[0]!r})")
    pickles = [name for name in names if name.startswith("pytorch_model") and name.endswith(".bin")]
    if pickles:
        return (f"{where} holds PyTorch pickles {pickles} but neither {PICKLE} nor the {PICKLE_INDEX} that names "
                "the shards: fetch the index with them")
    return f"{where} holds neither {INDEX} nor {SINGLE}, nor {PICKLE} or {PICKLE_INDEX} (files: {names})"


def _fetch(repo: str, filename: str, revision: str | None) -> Path | None:
    """One file from the Hub (or the local cache when offline); None when the repository has no such file."""
    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except EntryNotFoundError:
        return None


def _hub(repo: str, revision: str | None, *, look_for_conversion: bool = True) -> Snapshot:
    config = _hub_config(repo, revision)
    commit = config.parent.name  # the cache keeps each file under snapshots/<commit>/
    for name in (GENERATION_CONFIG, *TOKENIZER_FILES):
        _fetch(repo, name, commit)
    safetensors = _hub_weights(repo, commit, INDEX, SINGLE)
    if safetensors is not None:
        return Snapshot(config.parent, *safetensors, commit)
    if look_for_conversion:
        pull_request = _conversion_pull_request(repo, commit)
        if pull_request is not None:
            logger.info("%s@%s holds PyTorch pickles only: loading %s's safetensors conversion, %s",
                        repo, commit, CONVERSION_BOT, pull_request)
            return _hub(repo, pull_request, look_for_conversion=False)
    pickles = _hub_weights(repo, commit, PICKLE_INDEX, PICKLE)
    if pickles is None:
        raise FileNotFoundError(_no_weights_message(f"Hub repository {repo}@{commit}", _repo_file_names(repo, commit)))
    return Snapshot(config.parent, *_converted(*pickles), commit)


def _hub_config(repo: str, revision: str | None) -> Path:
    """config.json of a Hub revision. Without it huggingface_hub's own error says whether the repository,
    the revision or (offline) the cached copy is missing, unless the repository holds GGUF files."""
    try:
        return Path(hf_hub_download(repo, CONFIG, revision=revision))
    except EntryNotFoundError:
        names = _repo_file_names(repo, revision)
        if any(name.endswith(".gguf") for name in names):
            raise FileNotFoundError(_no_weights_message(f"Hub repository {repo}", names)) from None
        raise


def _hub_weights(repo: str, commit: str, index_name: str, single_name: str) -> tuple[list[Path], Path | None] | None:
    """The files `index_name`'s weight_map names and the index, or `single_name` alone; None when the
    revision has neither. Other weight files in the repository are not fetched."""
    index = _fetch(repo, index_name, commit)
    if index is None:
        single = _fetch(repo, single_name, commit)
        return None if single is None else ([single], None)
    names = sorted(set(read_index(index).values()))
    weights = [_fetch(repo, name, commit) for name in names]
    missing = [name for name, path in zip(names, weights) if path is None]
    if missing:
        raise FileNotFoundError(f"{repo}@{commit}: {index_name} names shard(s) {missing} the repository does not hold")
    return weights, index


def _conversion_pull_request(repo: str, commit: str) -> str | None:
    """The revision (`refs/pr/N`) of an open SFconvertbot pull request whose parent is `commit`; None when
    there is none, or when the Hub cannot be asked (offline, unreachable)."""
    api = HfApi()
    try:
        for discussion in api.get_repo_discussions(repo, author=CONVERSION_BOT, discussion_type="pull_request",
                                                   discussion_status="open"):
            commits = api.list_repo_commits(repo, revision=discussion.git_reference)  # newest first
            if len(commits) > 1 and commits[1].commit_id == commit:
                return discussion.git_reference
    except (OfflineModeIsEnabled, httpx.HTTPError) as error:
        logger.debug("no lookup of %s pull requests on %s (%s): converting its PyTorch pickles instead",
                     CONVERSION_BOT, repo, error)
    return None


def _repo_file_names(repo: str, revision: str | None) -> list[str]:
    """The file names of a Hub revision; offline, those of its cached snapshot (the files fetched so far)."""
    if not constants.HF_HUB_OFFLINE:
        return sorted(HfApi().list_repo_files(repo, revision=revision))
    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    ref = folder / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        return []
    return sorted(path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*") if path.is_file())
