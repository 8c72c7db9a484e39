"""A persistent XLA compilation cache, so a second process skips compiles the first one paid for, and what
tracing a model tells kept beside it (`kept_trace`), so a second process skips that too.

Dew's own commands (`dew ...`, the quick start) turn it on where they start; `import dew` changes no JAX
setting, so a program that embeds Dew decides for itself (calling `configure()` is one way).

A directory the caller names that cannot be one (a file is there, or above it) is refused; one Dew picks or
makes itself (the default cache, `dew-kept/` and `dew-programs/` inside any cache) is left out with one warning,
and the command goes on without it."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import stat
import sys
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


def configure(directory: str | os.PathLike | None = None) -> None:
    """Point JAX's cache at `directory`, or by default at `$XDG_CACHE_HOME/dew/jax` (`~/.cache/dew/jax`).
    Call it before the process compiles anything: JAX opens its cache at the first compile.

    Without `directory`, a cache directory the user already configured (`JAX_COMPILATION_CACHE_DIR`
    or `jax.config.update`) is left alone, and `DEW_COMPILATION_CACHE=0` turns this off. A `directory` that
    cannot be a directory (a file is there, or above it) is refused with NotADirectoryError; a default one
    is left out with a warning, and the process compiles without a persistent cache.
    """
    import jax  # here, so that a command that never compiles does not import it for this

    if directory is None:
        if os.environ.get("DEW_COMPILATION_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
            return
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        if not usable(os.path.join(root, "dew", "jax"), "compiled programs"):
            return
        directory = os.path.join(root, "dew", "jax")
    else:
        problem = not_a_directory(directory)
        if problem is not None:
            raise NotADirectoryError(f"the compilation cache {os.fspath(directory)} {problem}: give a directory "
                                     "(made where missing), or another path")
    for part, what in ((KEPT_DIRECTORY, "traces"), (PROGRAMS_DIRECTORY, "serving programs")):
        usable(os.path.join(directory, part), what)  # warned about now, once, rather than at each entry
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    # Cache every executable that took half a second or more to build (the train step takes seconds).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


KEPT_DIRECTORY = "dew-kept"  # inside JAX's cache directory: traces (`kept_trace`)
PROGRAMS_DIRECTORY = "dew-programs"  # inside JAX's cache directory: serving programs (`dew.serve.programs`)


def not_a_directory(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be a directory ("is a file, not a directory", "lies under the file F"), or None when
    it is one or can be made."""
    path = Path(path).absolute()
    for place in (path, *path.parents):
        try:
            if place.is_dir():
                return None
            if place.exists() or place.is_symlink():
                return "is a file, not a directory" if place == path else f"lies under the file {place}"
        except OSError:  # unreadable: the directory's own use will say what is wrong
            return None
    return None


def usable(path: str | os.PathLike, what: str) -> bool:
    """Whether the cache directory `path` (which keeps `what`) is a directory or can be made one; when not, a
    warning, once a process, that Dew keeps no `what` there (it compiles or traces each time instead)."""
    return _usable(os.path.abspath(path), what)


@functools.cache
def _usable(path: str, what: str) -> bool:
    problem = not_a_directory(path)
    if problem is not None:
        warnings.warn(f"the compilation cache {path} {problem}: Dew keeps no {what} there and goes on "
                      "without them (remove what is in the way, or choose another directory)", stacklevel=3)
    return problem is None


# ---- what a kept entry depends on, and traces kept beside JAX's entries ------------------------------------

_ENVIRONMENT_PREFIXES = ("XLA_", "JAX_", "DEW_", "TF_CPP_")
KEPT_FORMAT = "dew-kept 2"  # the layout of a kept trace; a new layout is a new key


@functools.cache
def environment() -> str:
    """What, besides a program or a model itself, decides what tracing and XLA make of it in this process: the
    versions of Python, jax, jaxlib, flax, numpy, ml_dtypes and oneDNN, the devices, the CPU's model and
    instruction set extensions, the environment variables that steer XLA, JAX and Dew, every JAX setting, and a
    digest of Dew's own code."""
    import jax

    device = jax.devices()[0]
    versions = [f"{name} {_version(name)}" for name in ("jax", "jaxlib", "flax", "numpy", "ml_dtypes",
                                                          "onednn-cpu-gomp")]
    variables = sorted(f"{name}={value}" for name, value in os.environ.items()
                       if name.startswith(_ENVIRONMENT_PREFIXES))
    settings = sorted(f"{name}={value!r}" for name, value in jax.config.values.items())
    return "\n".join([
        f"python {sys.version}", *versions,
        f"devices {device.platform} {device.client.platform_version} {device.device_kind} x{jax.device_count()} "
        f"of {jax.process_count()} processes",
        f"cpu {cpu_description()}", *variables, *settings, f"dew {dew_digest()}",
    ])


def cpu_description() -> str:
    """The CPU's model and instruction set extensions (Linux's /proc/cpuinfo; elsewhere what `platform` says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            lines = info.read().split("\n\n")[0].splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86's and Arm's names
    return "; ".join(line.strip() for line in lines if line.split(":")[0].strip() in wanted)


@functools.cache
def dew_digest() -> str:
    """A digest of Dew's source files, native kernels and kernel table, as this process imported them."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".so", ".json") and path.is_file() and "__pycache__" not in path.parts:
            digest.update(f"{path.relative_to(root)}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _root() -> str | None:
    """JAX's cache directory, where kept traces go (None when it is not set)."""
    import jax

    return jax.config.jax_compilation_cache_dir or None


def described(model) -> str | None:
    """What a trace of `model` is kept under (its `kept_description()`); None for a model that has none."""
    describe = getattr(model, "kept_description", None)
    return describe() if describe is not None else None


def kept_trace(kind: str, description: str, trace: Callable[[], T], encode: Callable[[T], Any],
               decode: Callable[[Any], T]) -> T:
    """`trace()` (what tracing a model tells, such as its variables' shapes), kept between processes as JSON in
    `dew-kept/` inside JAX's cache directory when one is set: a warm start reads it instead of tracing again.
    Its key is `kind`, `description` (what the trace is of: the model's class and config, say) and `environment()`,
    so a change to Dew, the software or the machine is another key. `encode` makes the value JSON (None: not
    kept); `decode` makes it back. An entry is `{"key": the whole key's digest, "value": ...}`: one that cannot be
    read, or holds another key's trace (renamed or copied over this one's name), is traced again and replaced."""
    root = _root()
    if not root or not usable(os.path.join(root, KEPT_DIRECTORY), "traces"):
        return trace()
    text = "\n".join([KEPT_FORMAT, kind, environment(), description])
    digest = hashlib.sha256(text.encode()).hexdigest()
    path = Path(root) / KEPT_DIRECTORY / f"{kind}-{digest[:32]}"
    try:
        entry = _read_kept(path)
        if not isinstance(entry, dict) or entry.get("key") != digest:
            raise ValueError("it holds the trace of another key (an entry renamed or copied over this one's name)")
        return decode(entry["value"])
    except FileNotFoundError:
        pass
    except Exception as error:  # noqa: BLE001 - a damaged entry is traced again and replaced
        logger.warning("could not read the kept trace %s (%s: %s); tracing again", path, type(error).__name__, error)
    value = trace()
    encoded = encode(value)
    if encoded is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # renamed whole, so a reader never sees half of it; one staged name per thread that writes it
            staged = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            staged.write_text(json.dumps({"key": digest, "value": encoded}), encoding="utf-8")
            os.replace(staged, path)
        except OSError as error:
            logger.warning("could not keep the trace %s (%s)", path, error)
    return value


def _read_kept(path: Path):
    """The JSON of the kept entry at `path`; a named pipe there is refused (ValueError) rather than waited on."""
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as entry:
        if not stat.S_ISREG(os.fstat(entry.fileno()).st_mode):
            raise ValueError("it is not a regular file")
        return json.loads(entry.read())
