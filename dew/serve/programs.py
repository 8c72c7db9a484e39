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
behind as JAX's own do. An entry that cannot be read (cut short, written by another build) is compiled
again and rewritten. Entries live in `dew-programs/` inside JAX's cache directory, and only when one is
set (`dew serve` sets `~/.cache/dew/jax`, or `--compilation-cache`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import pickle
import random
import threading
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from dew.compilation_cache import environment
from dew.files import write_atomically
from dew.kernels.registry import register_targets

logger = logging.getLogger("dew.serve")

FORMAT = "dew-programs 1"  # the layout of an entry; a new layout is a new key


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
        model = engine.model
        description = "\n".join([
            f"model {type(model).__module__}.{type(model).__qualname__} {model.config!r}",
            f"engine slots={engine.slots} capacity={engine.capacity} eos={engine.eos} pad_id={engine.pad_id} "
            f"top_k_bound={engine._top_k_bound} max_log_probs={engine.max_log_probs}",
        ])
        return cls(Path(root) / "dew-programs" if directory is None else directory, description, engine.ready)

    def key(self, program: tuple, arguments) -> str:
        """The entry's name for `program` called with `arguments` (arrays or `jax.ShapeDtypeStruct`s)."""
        leaves, structure = jax.tree_util.tree_flatten(arguments)
        described = [f"{tuple(leaf.shape)} {leaf.dtype} {getattr(leaf, 'weak_type', False)} "
                     f"{getattr(leaf, 'sharding', None)}" for leaf in leaves]
        text = "\n".join([FORMAT, environment(), self.description, f"program {program!r}", str(structure), *described])
        name = "-".join(str(part) for part in program)
        return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    def load(self, program: tuple, arguments) -> jax.stages.Compiled | None:
        """The program stored under its key, loaded onto this process's devices; None when there is none
        (or it cannot be read, which is logged)."""
        path = self.directory / self.key(program, arguments)
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            register_targets()  # the program calls Dew's kernels by name, which tracing would have registered
            executable, in_tree, out_tree = pickle.loads(payload)
            compiled = serialize_executable.deserialize_and_load(executable, in_tree, out_tree)
        except Exception as error:  # noqa: BLE001 - a damaged entry is compiled again and replaced
            logger.warning("could not load the compiled program %s (%s: %s); compiling it again", path,
                           type(error).__name__, error)
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
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(self.directory / self.key(program, arguments), payload)
        except (ValueError, NotImplementedError, OSError, pickle.PicklingError) as error:
            logger.warning("could not keep the compiled program %s for the next start (%s: %s)", program,
                           type(error).__name__, error)
            return
        self.stored += 1


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
