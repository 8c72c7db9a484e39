"""Where a checkpoint's files are: a local directory, or a Hub repository fetched through huggingface_hub.

`locate` decides which a source is, for every entry point (`load_pretrained`, `dew.pipeline`, the
recipe's `--pretrained`, `dew generate`): a path that exists is local; `hf://owner/name` is the Hub;
a source that reads as a path is refused at once when it does not exist, naming the nearest entry
that does. The Hub is asked once, with no retries, whether it can be reached; when it cannot (or
`HF_HUB_OFFLINE` is set) only the local Hub cache is read.

From the Hub the configs and the index come first, then only the weight files the index's
weight_map names (or model.safetensors when there is none); other copies in the repository stay
there. `repo@revision` pins a branch, tag or commit; the commit the Hub resolved is recorded.

A checkpoint with only PyTorch pickles loads from the safetensors pull request SFconvertbot opened
for that commit when the Hub has one, else from a safetensors copy Dew converts once and keeps
under `$XDG_CACHE_HOME/dew/converted/` (see `torch_files`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# huggingface_hub and its utils import their names at first use: a local checkpoint reads none of its client,
# which imports httpx (0.09 s of a server's start), so every name below is read as the Hub is asked.
import huggingface_hub
from huggingface_hub import constants
from huggingface_hub import utils as hub_utils

from dew.interop import torch_files
from dew.interop.safetensors_files import INDEX, SINGLE, read_index, weight_files
from dew.interop.torch_files import PICKLE, PICKLE_INDEX

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
# A multimodal checkpoint's processor files beside the tokenizer's (image processor settings, placeholders).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
CONVERSION_BOT = "SFconvertbot"
HUB_PREFIX = "hf://"

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


@dataclasses.dataclass(frozen=True)
class HubSource:
    """A Hub repository `repo` at `revision` (None: the default branch)."""

    repo: str
    revision: str | None


def locate(source: str | os.PathLike) -> Path | HubSource:
    """Whether `source` is a local path or a Hub repository, refusing a local path that does not exist.

    The rule: a path that exists is local, and `hf://owner/name[@revision]` is always the Hub. Any other
    source is a local path (and, as it does not exist, refused at once with the nearest entry that
    does) when it is a `Path`, starts with `.`, `/` or `~`, holds a backslash, has more than two
    `/`-separated parts before any `@revision`, is not a valid Hub id, or its first part is a local
    directory (`runs/sigg` beside `runs/`). What remains, `name` or `owner/name` with an optional
    `@revision`, is a Hub repository.
    """
    text = os.fspath(source)
    if text.startswith(HUB_PREFIX):
        repo, _, revision = text.removeprefix(HUB_PREFIX).partition("@")
        try:
            hub_utils.validate_repo_id(repo)
        except hub_utils.HFValidationError as error:
            raise ValueError(f"{text} names no Hub repository: {error}") from None
        return HubSource(repo, revision or None)
    path = Path(text).expanduser()
    if path.exists():
        return path
    repo, _, revision = text.partition("@")
    why = _local_reason(source, text, repo)
    if why is not None:
        raise FileNotFoundError(f"{text} is neither a local directory nor a Hub repository id: {_nearest(path)}; "
                                f"it reads as a path because {why} (write {HUB_PREFIX}owner/name for a Hub repository)")
    return HubSource(repo, revision or None)


def _local_reason(source: str | os.PathLike, text: str, repo: str) -> str | None:
    """Why a source that does not exist is a local path rather than a Hub id; None for a Hub id."""
    if not isinstance(source, str):
        return "it was given as a Path"
    if text.startswith((".", "/", "~")):
        return f"it starts with {text[0]!r}"
    if "\\" in text or (os.sep != "/" and os.sep in text):
        return "it holds a backslash"
    parts = repo.split("/")
    if len(parts) > 2:
        return f"it has {len(parts)} parts where a Hub id has at most two, 'owner/name'"
    try:
        hub_utils.validate_repo_id(repo)
    except hub_utils.HFValidationError:
        return "it is not a valid Hub id"
    if len(parts) == 2 and Path(parts[0]).expanduser().is_dir():
        return f"{parts[0]}/ is a local directory"
    return None


def _nearest(path: Path) -> str:
    """What exists nearest `path`: its deepest existing parent, and the entry below it that each missing
    part's closest existing name leads to."""
    missing = []
    parent = path
    while not parent.exists():
        missing.insert(0, parent.name)
        parent = parent.parent
    shown = "the current directory" if parent == Path(".") else str(parent).rstrip("/") + "/"
    nearest = parent
    for name in missing:
        try:
            names = sorted(entry.name for entry in nearest.iterdir() if not entry.name.startswith("."))
        except OSError:
            break
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if not close:
            break
        nearest = nearest / close[0]
    if nearest != parent:
        return f"{shown} holds no {missing[0]!r}, the nearest is {nearest}"
    try:
        names = sorted(entry.name for entry in parent.iterdir() if not entry.name.startswith("."))
    except OSError:
        return f"{shown} holds no {missing[0]!r}"
    listed = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    return f"{shown} holds no {missing[0]!r} ({f'it holds {listed}' if names else 'it is empty'})"


def resolve(source: str | os.PathLike, read_config: Callable[[Path], Any] | None = None) -> Snapshot:
    """The files of `source`: a local checkpoint directory, a Hub id, or `repo@revision` (see `locate`).
    `read_config` is called with config.json's path before any weights are fetched (it may refuse)."""
    where = locate(source)
    if isinstance(where, Path):
        if where.is_dir():
            if read_config is not None and (where / CONFIG).is_file():
                read_config(where / CONFIG)
            return _local(where)
        raise ValueError(f"{where} is a file: pass the checkpoint directory that holds config.json and the weights")
    return _hub(_Hub.reach(where.repo, where.revision), where.revision, read_config=read_config)


def resolve_gguf(source: str | os.PathLike, gguf_file: str) -> Snapshot:
    """The GGUF file `gguf_file` of a local directory or Hub repository, with its tokenizer files if any."""
    where = locate(source)
    if isinstance(where, Path):
        if not (where / gguf_file).is_file():
            present = sorted(p.name for p in where.glob("*.gguf"))
            raise FileNotFoundError(f"{where} holds no {gguf_file}; its GGUF files are {present}")
        return Snapshot(where, [where / gguf_file], None, None)
    hub = _Hub.reach(where.repo, where.revision, gguf_file)
    weights = hub.require(gguf_file, where.revision)
    commit = weights.parent.name
    for name in (GENERATION_CONFIG, *TOKENIZER_FILES):
        hub.fetch(name, commit)
    return Snapshot(weights.parent, [weights], None, commit)


@dataclasses.dataclass(frozen=True)
class _Hub:
    """One Hub repository as this load reads it. `unreachable` (the Hub's error) when the Hub did not
    answer: then only the local cache is read and the Hub is asked nothing more. With HF_HUB_OFFLINE
    set, huggingface_hub itself reads only the cache."""

    repo: str
    unreachable: str | None = None

    @classmethod
    def reach(cls, repo: str, revision: str | None, first: str = CONFIG) -> "_Hub":
        """Ask the Hub once, without retries and within HF_HUB_ETAG_TIMEOUT seconds, for `first`'s metadata;
        any answer (even "no such repository") means it was reached."""
        if constants.HF_HUB_OFFLINE:
            return cls(repo)
        try:
            huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo, first, revision=revision),
                                                 timeout=constants.HF_HUB_ETAG_TIMEOUT)
        except _unreachable() as error:
            return cls(repo, unreachable=str(error) or type(error).__name__)
        except hub_utils.HfHubHTTPError:
            pass  # the Hub answered; the download says what it lacks
        return cls(repo)

    @property
    def cache_only(self) -> bool:
        return self.unreachable is not None or constants.HF_HUB_OFFLINE

    def download(self, filename: str, revision: str | None) -> Path:
        return Path(huggingface_hub.hf_hub_download(self.repo, filename, revision=revision,
                                                    local_files_only=self.unreachable is not None))

    def fetch(self, filename: str, revision: str | None) -> Path | None:
        """One file; None when the repository (or, reading only the cache, the cache) has no such file."""
        try:
            return self.download(filename, revision)
        except hub_utils.EntryNotFoundError:
            return None

    def require(self, filename: str, revision: str | None) -> Path:
        """The first file a load needs; reading only the cache, a miss says why the Hub was not asked."""
        try:
            path = self.download(filename, revision)
        except hub_utils.LocalEntryNotFoundError:
            if not self.cache_only:
                raise
            named = f"{self.repo}{'@' + revision if revision else ''}'s {filename}"
            if self.unreachable is None:
                raise hub_utils.LocalEntryNotFoundError(
                    f"HF_HUB_OFFLINE is set and {named} is not in the local cache {constants.HF_HUB_CACHE}: fetch it "
                    "once online (unset HF_HUB_OFFLINE), or pass a local checkpoint directory") from None
            raise ConnectionError(
                f"the Hugging Face Hub ({constants.ENDPOINT}) could not be reached ({self.unreachable}) and {named} is "
                f"not in the local cache {constants.HF_HUB_CACHE}: check the network (or HF_ENDPOINT), or work offline "
                "with a local checkpoint directory or a repository fetched before (HF_HUB_OFFLINE=1 reads only the "
                "cache)") from None
        if self.unreachable is not None:
            logger.warning("the Hub (%s) could not be reached (%s): reading %s from the local cache",
                           constants.ENDPOINT, self.unreachable, self.repo)
        return path


def _unreachable() -> tuple[type[Exception], ...]:
    """What a request that never reached the Hub raises (huggingface_hub retries these for a minute)."""
    httpx = hub_utils.httpx
    return httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError


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
        if (directory / "run.json").is_file():
            raise FileNotFoundError(f"{directory} is a Dew run directory (it holds run.json), not a transformers "
                                    f"checkpoint: dew.pipeline({str(directory)!r}) and `dew generate` read runs")
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


def _hub(hub: _Hub, revision: str | None, *, look_for_conversion: bool = True,
         read_config: Callable[[Path], Any] | None = None) -> Snapshot:
    config = _hub_config(hub, revision)
    if read_config is not None:
        read_config(config)
    commit = config.parent.name  # the cache keeps each file under snapshots/<commit>/
    for name in (GENERATION_CONFIG, *TOKENIZER_FILES, *PROCESSOR_FILES):
        hub.fetch(name, commit)
    safetensors = _hub_weights(hub, commit, INDEX, SINGLE)
    if safetensors is not None:
        return Snapshot(config.parent, *safetensors, commit)
    if look_for_conversion and hub.unreachable is None:
        pull_request = _conversion_pull_request(hub.repo, commit)
        if pull_request is not None:
            logger.info("%s@%s holds PyTorch pickles only: loading %s's safetensors conversion, %s",
                        hub.repo, commit, CONVERSION_BOT, pull_request)
            return _hub(hub, pull_request, look_for_conversion=False)
    pickles = _hub_weights(hub, commit, PICKLE_INDEX, PICKLE)
    if pickles is None:
        raise FileNotFoundError(_no_weights_message(f"Hub repository {hub.repo}@{commit}",
                                                    _repo_file_names(hub, commit)))
    return Snapshot(config.parent, *_converted(*pickles), commit)


def _hub_config(hub: _Hub, revision: str | None) -> Path:
    """config.json of a Hub revision. Without it huggingface_hub's own error says whether the repository
    or the revision is missing (`_Hub.require` whether the cached copy is), unless the repository holds
    GGUF files."""
    try:
        return hub.require(CONFIG, revision)
    except (hub_utils.EntryNotFoundError, ConnectionError):
        names = _repo_file_names(hub, revision)
        if any(name.endswith(".gguf") for name in names):
            raise FileNotFoundError(_no_weights_message(f"Hub repository {hub.repo}", names)) from None
        raise


def _hub_weights(hub: _Hub, commit: str, index_name: str, single_name: str) -> tuple[list[Path], Path | None] | None:
    """The files `index_name`'s weight_map names and the index, or `single_name` alone; None when the
    revision has neither. Other weight files in the repository are not fetched."""
    index = hub.fetch(index_name, commit)
    if index is None:
        single = hub.fetch(single_name, commit)
        return None if single is None else ([single], None)
    names = sorted(set(read_index(index).values()))
    weights = [hub.fetch(name, commit) for name in names]
    missing = [name for name, path in zip(names, weights) if path is None]
    if missing:
        held = "the local cache holds" if hub.cache_only else "the repository holds"
        raise FileNotFoundError(f"{hub.repo}@{commit}: {index_name} names shard(s) {missing} that {held} not")
    return weights, index


def _conversion_pull_request(repo: str, commit: str) -> str | None:
    """The revision (`refs/pr/N`) of an open SFconvertbot pull request whose parent is `commit`; None when
    there is none, or when the Hub cannot be asked (offline, unreachable)."""
    api = huggingface_hub.HfApi()
    try:
        for discussion in api.get_repo_discussions(repo, author=CONVERSION_BOT, discussion_type="pull_request",
                                                   discussion_status="open"):
            commits = api.list_repo_commits(repo, revision=discussion.git_reference)  # newest first
            if len(commits) > 1 and commits[1].commit_id == commit:
                return discussion.git_reference
    except (hub_utils.OfflineModeIsEnabled, hub_utils.httpx.HTTPError) as error:
        logger.debug("no lookup of %s pull requests on %s (%s): converting its PyTorch pickles instead",
                     CONVERSION_BOT, repo, error)
    return None


def _repo_file_names(hub: _Hub, revision: str | None) -> list[str]:
    """The file names of a Hub revision; from the cache, those of its cached snapshot (the files fetched so far)."""
    if not hub.cache_only:
        return sorted(huggingface_hub.HfApi().list_repo_files(hub.repo, revision=revision))
    file_download = importlib.import_module("huggingface_hub.file_download")
    folder = Path(constants.HF_HUB_CACHE) / file_download.repo_folder_name(repo_id=hub.repo, repo_type="model")
    ref = folder / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        return []
    return sorted(path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*") if path.is_file())
