"""The serving engine's compiled programs kept between processes, so that a restarted server loads them
instead of tracing and lowering its model again.

JAX's persistent cache (`dew.compilation_cache`) skips XLA's compile, but finds its entry by the lowered
program, so every start still traces the model and lowers it (most of a warm start's program time).
`ProgramCache` keeps each program's executable (`jax.experimental.serialize_executable`) under a key
computed without tracing: everything the program is made of, which is
- the program (a step over so many rows, an admission of so many rows at a width) and its arguments'
  structure, shapes, dtypes and placements (the model's weights and the engine's slots among them);
- the model's class and config, and the engine's settings its programs close over;
- the machine and the software: jax, jaxlib and XLA's versions, the devices, the CPU's model and
  instruction set extensions, flax's, numpy's and oneDNN's versions, Python's, every JAX setting, the
  environment variables that steer XLA, JAX and Dew (`XLA_FLAGS`, `JAX_*`, `DEW_*`), and Dew's own
  code (a digest of its source files, native kernels and kernel table).
A change to any of these is another key, so a stale program is never found; entries of old keys stay
behind as JAX's own do. Entries live in `dew-programs/` inside JAX's cache directory, and only when one is
set (`dew serve` sets `~/.cache/dew/jax`, or `--compilation-cache`).

An entry is a line naming the layout, a JSON header (the whole key's digest, the program, its arguments'
shapes and dtypes) and JAX's serialized executable. JAX's serialization is a pickle and an executable is
machine code, so reading an entry can run what it holds: an entry is read only when this process's user owns
it and no other user can write it (ssh's rule for its keys), so whoever else can write `dew-programs/` cannot
have the server run what they wrote there. (JAX's own entries, in the directory above, are executables too, which
JAX loads without such a check: keep the cache directory writable by its user alone.) An entry that is not read
(another user's, not a regular file, cut short, written by another build, or of another key: renamed or copied
over another entry's name) is compiled again and rewritten, as is one whose loaded program takes other arguments
than the caller's; each such entry is logged.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import pickle
import random
import secrets
import stat
import threading
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from dew.compilation_cache import PROGRAMS_DIRECTORY, environment, usable
from dew.kernels.registry import register_targets

logger = logging.getLogger("dew.serve")

FORMAT = "dew-programs 2"  # the layout of an entry (its first line); a new layout is a new key


class Unread(Exception):
    """An entry that is not read: the reason follows its path in the log."""


class ProgramCache:
    """Compiled programs of one engine (`description` says what its programs close over) in `directory`."""

    def __init__(self, directory: str | os.PathLike, description: str, after: threading.Event | None = None):
        self.directory = Path(directory)
        self.description = description
        self.after = after  # compiles to keep start once it is set (an engine's `ready`: they wait for its first programs)
        self.loaded = 0  # programs read back, for a test and the log
        self.stored = 0
        self._lock = threading.Lock()
        self._waiting: list[tuple] = []  # (program, arguments, lowered) to compile and keep
        self._compiling = False  # the keeper is compiling one of them
        self._keeper: threading.Thread | None = None
        self._stopped_at_exit = False  # stop() registered to run at the process's exit
        self._stopping = False

    @classmethod
    def of(cls, engine, directory: str | os.PathLike | None = None) -> "ProgramCache | None":
        """The cache for `engine`'s programs in `directory`, by default `dew-programs/` inside JAX's cache
        directory; None when neither is set."""
        root = jax.config.jax_compilation_cache_dir
        if directory is None and not root:
            return None
        directory = Path(root) / PROGRAMS_DIRECTORY if directory is None else Path(directory)
        if not usable(directory, "serving programs"):  # a file there: served without kept programs, said once
            return None
        model = engine.model
        description = "\n".join([
            f"model {type(model).__module__}.{type(model).__qualname__} {model.config!r}",
            f"engine slots={engine.slots} capacity={engine.capacity} eos={engine.eos} pad_id={engine.pad_id} "
            f"top_k_bound={engine._top_k_bound} max_log_probs={engine.max_log_probs}",
        ])
        return cls(directory, description, engine.ready)

    def key(self, program: tuple, arguments) -> str:
        """The entry's name for `program` called with `arguments` (arrays or `jax.ShapeDtypeStruct`s)."""
        name = "-".join(str(part) for part in program)
        return f"{name}-{self._digest(program, arguments)[:32]}"

    def _digest(self, program: tuple, arguments) -> str:
        """The whole key: a digest of everything `program` called with `arguments` is made of."""
        leaves, structure = jax.tree_util.tree_flatten(arguments)
        described = [f"{tuple(leaf.shape)} {leaf.dtype} {getattr(leaf, 'weak_type', False)} "
                     f"{getattr(leaf, 'sharding', None)}" for leaf in leaves]
        text = "\n".join([FORMAT, environment(), self.description, f"program {program!r}", str(structure), *described])
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, program: tuple, arguments) -> jax.stages.Compiled | None:
        """The program stored under its key, loaded onto this process's devices; None when there is none
        (or it is not read, or takes other arguments, which is logged)."""
        path = self.directory / self.key(program, arguments)
        try:
            header, payload = _read_entry(path)
            if header.get("key") != self._digest(program, arguments):
                raise Unread(f"it holds the program {header.get('program')} of another key (an entry renamed or "
                             "copied over this one's name)")
            register_targets()  # the program calls Dew's kernels by name, which tracing would have registered
            executable, in_tree, out_tree = pickle.loads(payload)
            compiled = serialize_executable.deserialize_and_load(executable, in_tree, out_tree)
            _check_signature(compiled, arguments)
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001 - an entry not read is compiled again and replaced
            reason = str(error) if isinstance(error, Unread) else f"{type(error).__name__}: {error}"
            logger.warning("did not load the compiled program %s (%s); compiling it again", path, reason)
            return None
        self.loaded += 1
        return compiled

    def compile(self, program: tuple, arguments, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """`lowered` compiled (or found in JAX's cache) and kept under its key for the next start.

        An executable JAX's own cache gave back cannot be written out again (XLA keeps no code for its
        kernels then, and the copy fails when called), so only one this process compiled is kept as it
        is; for one JAX's cache gave, a compile of its own, which JAX's cache cannot answer, runs on a
        thread of its own (once, after Dew or the software changed) and is kept when it is done."""
        hits = _hits()
        compiled = lowered.compile()
        if _hits() == hits:
            self._store(program, arguments, compiled)
            return compiled
        with self._lock:
            self._waiting.append((program, arguments, lowered))
            if self._keeper is None:
                if not self._stopped_at_exit:
                    atexit.register(self.stop)
                    self._stopped_at_exit = True
                self._keeper = threading.Thread(target=self._keep, name="dew-serve-keep", daemon=True)
                self._keeper.start()
        return compiled

    def stop(self) -> None:
        """Compile no more programs to keep; return once the one being compiled (if any) is kept. Called at
        the process's exit, so that no compile is cut off (XLA aborts the process then)."""
        with self._lock:
            self._waiting.clear()
            self._stopping = True
            keeper = self._keeper
        if keeper is not None:
            keeper.join()

    def keeping(self) -> int:
        """How many programs are still to be compiled and kept (those JAX's cache gave): while any is, a
        thread compiles beside the serving."""
        with self._lock:
            return len(self._waiting) + self._compiling

    def wait(self) -> None:
        """Return once every program waiting to be compiled and kept is kept."""
        with self._lock:
            keeper = self._keeper
        if keeper is not None:
            keeper.join()

    def _keep(self) -> None:
        """Compile the waiting programs, one at a time beside the engine's own compiles, and keep them."""
        while self.after is not None and not self.after.wait(0.1):
            if self._stopping:
                break
        while True:
            with self._lock:
                if not self._waiting:
                    self._keeper = None
                    return
                program, arguments, lowered = self._waiting.pop(0)
                self._compiling = True
            try:
                compiled = lowered.compile(_uncached())
            except Exception as error:  # noqa: BLE001 - the served program is the one compiled already
                logger.warning("could not compile the program %s to keep it for the next start (%s: %s)", program,
                               type(error).__name__, error)
                continue
            else:
                self._store(program, arguments, compiled)
            finally:
                with self._lock:
                    self._compiling = False

    def _store(self, program: tuple, arguments, compiled: jax.stages.Compiled) -> None:
        """Keep `compiled` under its key (a program that cannot be serialized is left out, logged)."""
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
            header = {"key": self._digest(program, arguments), "program": list(program),
                      "arguments": _described(jax.tree_util.tree_leaves(arguments))}
            self.directory.mkdir(parents=True, exist_ok=True)
            _write_entry(self.directory / self.key(program, arguments),
                         f"{FORMAT}\n{json.dumps(header)}\n".encode() + payload)
        except (ValueError, NotImplementedError, OSError, pickle.PicklingError) as error:
            logger.warning("could not keep the compiled program %s for the next start (%s: %s)", program,
                           type(error).__name__, error)
            return
        self.stored += 1


def _read_entry(path: Path) -> tuple[dict, bytes]:
    """(header, payload) of the entry at `path`, read only when this user owns it and no other user can write it
    (`Unread` otherwise, or when its layout is not `FORMAT`'s)."""
    # a link is refused, not followed; a named pipe opens at once (to be refused below), not once a writer comes
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(descriptor, "rb") as entry:
        status = os.fstat(entry.fileno())  # of the file read, whatever the name points at meanwhile
        if hasattr(os, "geteuid") and status.st_uid != os.geteuid():  # the user a file this process writes gets
            raise Unread(f"it belongs to user {status.st_uid}, not to this process's user {os.geteuid()}, and "
                         "reading it would run what it holds")
        if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise Unread(f"other users may write it (mode {stat.filemode(status.st_mode)}), and reading it would run "
                         "what it holds")
        if not stat.S_ISREG(status.st_mode):
            raise Unread("it is not a regular file")
        content = entry.read()
    layout, _, rest = content.partition(b"\n")
    if layout != FORMAT.encode():
        raise Unread(f"its first line is {layout[:40]!r}, not {FORMAT!r}")
    header, _, payload = rest.partition(b"\n")
    try:
        return json.loads(header), payload
    except (ValueError, UnicodeDecodeError) as error:
        raise Unread(f"its header is not JSON ({error})") from None


def _write_entry(path: Path, content: bytes) -> None:
    """Replace `path` with `content` in one rename, flushed first, readable and writable by this user alone
    (`_read_entry` reads no other)."""
    staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as entry:
            entry.write(content)
            entry.flush()
            os.fsync(entry.fileno())
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def _described(leaves) -> list[str]:
    return [f"{tuple(leaf.shape)} {leaf.dtype}" for leaf in leaves]


def _check_signature(compiled: jax.stages.Compiled, arguments) -> None:
    """Refuse (`Unread`) a loaded program whose positional arguments' shapes and dtypes are not `arguments'`."""
    positional = compiled.args_info[0] if isinstance(compiled.args_info, tuple) else compiled.args_info
    takes, given = _described(jax.tree_util.tree_leaves(positional)), _described(jax.tree_util.tree_leaves(arguments))
    if takes != given:
        first = next((i for i, (a, b) in enumerate(zip(takes, given)) if a != b), min(len(takes), len(given)))
        raise Unread(f"its program takes {len(takes)} arguments, argument {first} of them "
                     f"{takes[first] if first < len(takes) else 'none'}, and the caller gives {len(given)}, "
                     f"argument {first} {given[first] if first < len(given) else 'none'}")


def _uncached() -> dict:
    """XLA options that JAX's cache has never seen, so that JAX compiles rather than gives back what it
    keeps: a debugging printout's length, which changes nothing XLA builds, drawn at random (JAX keeps
    this compile too, under a key no later compile asks for)."""
    return {"xla_debug_buffer_assignment_show_max": random.getrandbits(62)}


_COMPILATIONS = threading.local()  # JAX's cache hits on this thread


def _hits() -> int:
    _listen()
    return getattr(_COMPILATIONS, "hits", 0)


@functools.cache
def _listen() -> None:
    def count(event: str, **details) -> None:  # called on the thread that compiles
        if event == "/jax/compilation_cache/cache_hits":
            _COMPILATIONS.hits = getattr(_COMPILATIONS, "hits", 0) + 1

    jax.monitoring.register_event_listener(count)
