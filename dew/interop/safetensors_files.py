"""Safetensors checkpoints: one file or index-listed shards, read memory-mapped and written atomically.

Reading opens every file with `safe_open` (a memory map) and hands out one tensor at a time, so a
load never holds a second whole copy of the model on the host. Writing over an earlier export is one
step: shards take fresh names, `model.safetensors` is replaced by rename, the index is written last,
and only then are the files the previous export named removed. A save that stops anywhere before
the switch leaves the previous export whole; files no export wrote are never touched.

A save killed before its switch leaves its staging files behind (whole shards among them). Each save
holds a shared `flock` on the directory, so the next save, when it can take that lock exclusively (no
other save is live there), removes them: the `model-<8 hex>-NNNNN-of-NNNNN.safetensors` shards the
current index does not name, and the hidden `.<name>.<8 hex>.tmp` staging copies of the files a save
writes. Other files are never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path, PurePosixPath

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dew.files import fsync, staged_path, write_atomically
from dew.interop.progress import byte_progress

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The shards a save writes (named with its token) and the staging copy of any file it writes.
_SHARD = re.compile(r"model-[0-9a-f]{8}-\d{5}-of-\d{5}\.safetensors")
_STAGED = re.compile(r"\.(?P<name>.+?)(?P<token>\.[0-9a-f]{8})?\.tmp")
logger = logging.getLogger("dew.interop")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def weight_files(directory: Path) -> tuple[list[Path], Path | None]:
    """The weight files a checkpoint directory's index names (or `model.safetensors`), and the index."""
    found = indexed_files(directory, INDEX, SINGLE)
    if found is None:
        raise FileNotFoundError(f"{directory} holds neither {INDEX} nor {SINGLE}")
    return found


def indexed_files(directory: Path, index_name: str, single_name: str) -> tuple[list[Path], Path | None] | None:
    """The files the index `index_name` names, and that index; else `single_name` alone; None when the
    directory holds neither. An index naming a file the directory lacks is refused."""
    index = directory / index_name
    if index.is_file():
        names = sorted(set(read_index(index).values()))
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) {missing} that {directory} does not hold: the download "
                                    "stopped partway or the index belongs to another export; fetch the shards again")
        return [directory / name for name in names], index
    if (directory / single_name).is_file():
        return [directory / single_name], None
    return None


def read_index(index: Path) -> dict[str, str]:
    """An index's weight_map (tensor name to shard file name), refusing one it cannot read."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{index} is not a safetensors index with a weight_map ({error}); fetch it again") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map is a {type(weight_map).__name__}, not a tensor-to-file mapping")
    for tensor, name in weight_map.items():
        # lexical: a Hub snapshot's files are links into its blob store, so resolved paths leave the directory
        path = PurePosixPath(name) if isinstance(name, str) else None
        if path is None or path.is_absolute() or ".." in path.parts or "\\" in name:
            raise ValueError(f"{index} names {name!r} as the shard of tensor {tensor!r}: a shard is a file name "
                             f"inside {index.parent}, not an absolute path or one that climbs out of it; the index is "
                             "corrupt or made to reach other files, so nothing was opened: fetch it again from the "
                             "checkpoint's source")
    return weight_map


class SafetensorsReader:
    """The tensors of a checkpoint's files, each file memory-mapped; use as a context manager.

    Refuses a truncated or corrupt file, a tensor stored in two files, and an index whose weight_map
    disagrees with the shards, each by file and tensor name.
    """

    def __init__(self, files: Sequence[Path], index: Path | None = None):
        self.files, self.index = [Path(f) for f in files], index
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self.location: dict[str, Path] = {}

    def __enter__(self) -> "SafetensorsReader":
        for file in self.files:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="numpy"))
            except SafetensorError as error:
                self._stack.close()
                raise ValueError(f"{file} is not a readable safetensors file ({error}): it is truncated or corrupt; "
                                 "download or export it again") from None
            self._handles[file] = handle
            for name in handle.keys():
                if name in self.location:
                    self._stack.close()
                    raise ValueError(f"tensor {name!r} is stored in two shards, {self.location[name].name} and "
                                     f"{file.name}: the checkpoint mixes two exports; keep the files its index names")
                self.location[name] = file
        if self.index is not None:
            self._check_index()
        return self

    def __exit__(self, *exc_info):
        self._stack.close()

    def _check_index(self):
        weight_map = read_index(self.index)
        for name, file in self.location.items():
            listed = weight_map.get(name)
            if listed != file.name:
                where = "does not list it" if listed is None else f"lists it in {listed}"
                raise ValueError(f"tensor {name!r} is stored in {file.name} but {self.index.name} {where}: the index "
                                 "and the shards come from different exports; fetch them together")
        absent = sorted(set(weight_map) - set(self.location))
        if absent:
            raise ValueError(f"{self.index.name} lists tensor(s) {absent[:5]} that no shard holds: a shard is "
                             "truncated or from another export; fetch the shards again")

    def names(self) -> list[str]:
        return list(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.location[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors spells it: "BF16", "F16", "F32", ..."""
        return self._handles[self.location[name]].get_slice(name).get_dtype()

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """One tensor, or its region `index` (slices, step 1), copied out of the memory map: only the
        region's bytes are read."""
        handle = self._handles[self.location[name]]
        return handle.get_slice(name)[index] if index else handle.get_tensor(name)


def shard_size_bytes(max_shard_size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9) or "2GiB" (2^30), as transformers reads them."""
    if isinstance(max_shard_size, int):
        return max_shard_size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", max_shard_size.upper())
    if not match:
        raise ValueError(f"max_shard_size {max_shard_size!r} is not a size: give bytes, or a string like '5GB' or "
                         "'500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def write_checkpoint(directory: Path, tensors: Sequence[tuple[str, int, Callable[[], np.ndarray]]],
                     max_shard_size: int | str, before_switch: Callable[[], None] = lambda: None,
                     staged_names: Sequence[str] = ()) -> list[str]:
    """Write `(name, nbytes, build)` tensors as safetensors over whatever export `directory` holds.

    Each tensor is built only when its shard is written. `before_switch` runs once the new weights are
    on disk and before they replace the previous export (the caller writes its configs there, with
    `write_atomically`, under `staged_names`). First removes what a killed save left (see the module).
    On a terminal a bar counts the bytes built. Returns the weight file names written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    limit = shard_size_bytes(max_shard_size)
    shards: list[list[tuple[str, Callable[[], np.ndarray]]]] = [[]]
    size = 0
    with byte_progress(f"saving {directory}", sum(nbytes for _, nbytes, _ in tensors)) as advance:
        for name, nbytes, build in tensors:
            if shards[-1] and size + nbytes > limit:
                shards.append([])
                size = 0
            shards[-1].append((name, _counted(build, nbytes, advance)))
            size += nbytes
        return _write_shards(directory, shards, before_switch, staged_names)


def _counted(build: Callable[[], np.ndarray], nbytes: int, advance: Callable[[int], None]) -> Callable[[], np.ndarray]:
    """`build`, reporting `nbytes` done once it has run."""
    def counted_build() -> np.ndarray:
        array = build()
        advance(nbytes)
        return array

    return counted_build


def _write_shards(directory: Path, shards: list[list[tuple[str, Callable[[], np.ndarray]]]],
                  before_switch: Callable[[], None], staged_names: Sequence[str]) -> list[str]:
    """Write the shards (one becomes model.safetensors) and switch the directory's export to them."""
    with _save_lock(directory, staged_names):
        previous = _previous_files(directory)
        token = secrets.token_hex(4)
        if len(shards) == 1:
            staged = staged_path(directory / SINGLE, token)
            _write_shard(staged, shards[0])
            before_switch()
            os.replace(staged, directory / SINGLE)
            written = [SINGLE]
            stale = previous - {SINGLE}
        else:
            written = [f"model-{token}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map, total = {}, 0
            for file_name, shard in zip(written, shards):
                total += _write_shard(directory / file_name, shard, staged_path(directory / file_name, token))
                weight_map.update({name: file_name for name, _ in shard})
            before_switch()
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_atomically(directory / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
            stale = previous - {INDEX}
        for name in sorted(stale):
            (directory / name).unlink(missing_ok=True)
    return written


def _write_shard(path: Path, shard: list[tuple[str, Callable[[], np.ndarray]]], staging: Path | None = None) -> int:
    """Write one shard's tensors to `path`, through `staging` (renamed into place once flushed) when given;
    returns the tensors' bytes."""
    # asarray, not ascontiguousarray: that one widens a 0-d tensor (a clipping bound) to shape [1]
    arrays = {name: np.asarray(build(), order="C") for name, build in shard}
    target = staging or path
    with os_errors(path.parent):  # the directory, not the hidden staging name
        save_file(arrays, str(target), metadata={"format": "pt"})
    fsync(target)
    if staging is not None:
        os.replace(staging, path)
    return sum(array.nbytes for array in arrays.values())


@contextlib.contextmanager
def os_errors(path: Path) -> Iterator[None]:
    """Raise safetensors' error for a failed write (a full disk, a read-only one) as the OSError it wraps, for
    `path`: `SafetensorError` is no OSError, so a command would report it as a bug rather than a fault of the
    machine (`dew.errors`)."""
    try:
        yield
    except SafetensorError as error:
        failed = re.search(r"I/O error: (.+?) \(os error (\d+)\)", str(error))
        if failed is None:
            raise
        raise OSError(int(failed[2]), failed[1], str(path)) from None


@contextlib.contextmanager
def _save_lock(directory: Path, staged_names: Sequence[str]) -> Iterator[None]:
    """Hold a shared lock on `directory` for one save; a save that finds no other live (it gets the lock
    exclusively) first removes the files killed saves abandoned there."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another save into %s is running: its staging files stay", directory)
        except OSError as error:  # a file system without locks: no save can be proven dead
            logger.info("cannot lock %s (%s): staging files of earlier saves stay", directory, error)
        else:
            _remove_abandoned(directory, {SINGLE, INDEX, *staged_names})
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_SH)  # from exclusive after the removal, else beside the other saves
        yield
    finally:
        os.close(handle)  # releases the lock


def _remove_abandoned(directory: Path, written_names: set[str]) -> None:
    """Remove the shards and staging copies of saves that died in `directory` (no save is live there)."""
    try:
        current = set(read_index(directory / INDEX).values()) if (directory / INDEX).is_file() else set()
    except ValueError:
        current = None  # an unreadable index: which shards it names cannot be known, so they stay
    for path in directory.iterdir():
        staged = _STAGED.fullmatch(path.name)
        if staged is not None and ((staged["token"] and staged["name"] in written_names)
                                   or _SHARD.fullmatch(staged["name"])):  # earlier versions staged shards untokened
            abandoned = True
        else:
            abandoned = current is not None and bool(_SHARD.fullmatch(path.name)) and path.name not in current
        if abandoned and path.is_file():
            logger.info("removing %s, left by a save that was stopped before it finished", path)
            path.unlink(missing_ok=True)


def _previous_files(directory: Path) -> set[str]:
    """The weight files of the export `directory` holds now: its index and shards, or model.safetensors."""
    files = set()
    if (directory / INDEX).is_file():
        files.add(INDEX)
        try:
            files.update(read_index(directory / INDEX).values())
        except ValueError:
            pass  # an unreadable index is replaced; its shards cannot be known, so they stay
    if (directory / SINGLE).is_file():
        files.add(SINGLE)
    return files
