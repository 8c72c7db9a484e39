"""A persistent XLA compilation cache, so a second process skips compiles the first one paid for.

Dew's own commands (`dew ...`, the quick start) turn it on where they start; `import dew` changes no JAX
setting, so a program that embeds Dew decides for itself (calling `configure()` is one way)."""

from __future__ import annotations

import os


def configure(directory: str | os.PathLike | None = None) -> None:
    """Point JAX's cache at `directory`, or by default at `$XDG_CACHE_HOME/dew/jax` (`~/.cache/dew/jax`).
    Call it before the process compiles anything: JAX opens its cache at the first compile.

    Without `directory`, a cache directory the user already configured (`JAX_COMPILATION_CACHE_DIR`
    or `jax.config.update`) is left alone, and `DEW_COMPILATION_CACHE=0` turns this off.
    """
    import jax  # here, so that a command that never compiles does not import it for this

    if directory is None:
        if os.environ.get("DEW_COMPILATION_CACHE", "1") == "0" or jax.config.jax_compilation_cache_dir:
            return
        root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(root, "dew", "jax")
    jax.config.update("jax_compilation_cache_dir", os.fspath(directory))
    # Cache every executable that took half a second or more to build (the train step takes seconds).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
