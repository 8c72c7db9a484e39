"""XLA's CPU step buffers, the process side: transparent huge pages through glibc's malloc tunable, and
big freed buffers kept for the next step by a preloaded library.

XLA's CPU runtime allocates a compiled step's temporaries as one block per execution (67 MiB for the
quick start's step, 86-173 MiB at the train-step benchmark's shape), above glibc's largest mmap
threshold (32 MiB), so every step maps fresh memory, faults it in and has the kernel clear it.
- Where the kernel hands out transparent huge pages on request (`/sys/kernel/mm/transparent_hugepage/
  enabled` says `[madvise]`, the common default), `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc
  2.35 and later) makes malloc ask for them: the quick start's float32 step 9-10% faster on a 2-core
  Zen 4 EPYC, the benchmark's 3% (`docs/performance.md`).
- `LD_PRELOAD` of `dew._native_buffers` (native/buffers.c, built at install) keeps a freed block of
  32 MiB or more mapped and hands it to the next request of about its size, so a step's temporaries
  are faulted in and cleared once, not every step: a further 5-6% on the quick start's step there,
  2% at the benchmark's shape. `DEW_REUSE_BUFFERS=0` leaves it out.

glibc reads its tunables, and the loader `LD_PRELOAD`, once, when the process starts, so a process
can only get these by starting again: `reexec()` replaces a process that owns its command line
(`dew train`, the quick-start example, the train-step benchmark) with itself under them, before any
work. A library call never does. `DEW_HUGEPAGES=0` keeps the process as it is. The started-again
process takes the library out of its own `LD_PRELOAD` again, so that programs it starts do not load
it unless they start again themselves.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_AGAIN = "DEW_HUGEPAGES_STARTED_AGAIN"
_PRELOADED = "DEW_HUGEPAGES_PRELOADED"  # the library the started-again process takes out of LD_PRELOAD


def environment(environ: dict[str, str], thp_mode: str | None, libc: tuple[str, str],
                buffers: str | None = None) -> dict[str, str] | None:
    """The environment to start again with, or None where starting again would change nothing.

    It adds the huge-page tunable unless it is set already or would do nothing (not glibc 2.35+, or
    the kernel's mode is not `madvise`: `always` gives huge pages anyway, `never` refuses them), and
    the `buffers` library (a path, None where it did not build) to `LD_PRELOAD` under glibc unless
    `DEW_REUSE_BUFFERS=0` or it is there already. None for both where asked off (`DEW_HUGEPAGES=0`)
    or started again already.

    `thp_mode` is the bracketed word of the kernel's setting (None where it cannot be read);
    `libc` is `platform.libc_ver()`."""
    name, version = libc
    if environ.get("DEW_HUGEPAGES", "1") == "0" or _AGAIN in environ or name != "glibc":
        return None
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    wanted = dict(environ)
    if thp_mode == "madvise" and (major, minor) >= (2, 35) and tunable(environ) is None:
        tunables = environ.get("GLIBC_TUNABLES", "")
        wanted["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    preload = environ.get("LD_PRELOAD", "")
    if buffers and environ.get("DEW_REUSE_BUFFERS", "1") != "0" and buffers not in preload.replace(":", " ").split():
        wanted["LD_PRELOAD"] = f"{buffers} {preload}".strip()
        wanted[_PRELOADED] = buffers
    if wanted == environ:
        return None
    # _AGAIN marks the started-again process: where something strips GLIBC_TUNABLES or LD_PRELOAD (a
    # setuid interpreter), it does not start again and again.
    return {**wanted, _AGAIN: "1"}


def buffers_library() -> str | None:
    """The path of `dew._native_buffers` (native/buffers.c), None where it did not build."""
    try:
        spec = importlib.util.find_spec("dew._native_buffers")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


def buffers_loaded() -> bool:
    """Whether this process runs with `dew._native_buffers` preloaded (its big buffers reused)."""
    library = buffers_library()
    try:
        return library is not None and Path(library).resolve().as_posix() in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def forget_preload(environ: dict[str, str]) -> None:
    """Take the library `environment` added back out of `environ`'s `LD_PRELOAD` (this process keeps
    it loaded), so that the programs this process starts do not load it."""
    library = environ.pop(_PRELOADED, None)
    if library is None:
        return
    kept = [entry for entry in environ.get("LD_PRELOAD", "").replace(":", " ").split() if entry != library]
    if kept:
        environ["LD_PRELOAD"] = " ".join(kept)
    else:
        environ.pop("LD_PRELOAD", None)


def tunable(environ) -> str | None:
    """The value `GLIBC_TUNABLES` in `environ` gives `glibc.malloc.hugetlb`, None where it gives none."""
    entries = (entry.split("=", 1) for entry in environ.get("GLIBC_TUNABLES", "").split(":") if entry)
    return next((pair[1] if len(pair) == 2 else "" for pair in entries if pair[0] == TUNABLE), None)


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), None where unknown."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _owns_command_line() -> bool:
    """Whether this program is the one the interpreter was started to run, with these arguments: a
    program run inside another (runpy from a test, with its own `sys.argv`) must not replace it."""
    argv, original = sys.argv, sys.orig_argv
    if not argv or len(original) <= len(argv) or original[len(original) - len(argv) + 1:] != argv[1:]:
        return False
    program = original[len(original) - len(argv)]
    if program == argv[0]:  # a script, or a console script such as `dew`
        return True
    module = program.replace(".", "/")  # `python -m package.module`: argv[0] is its file
    flag = original[len(original) - len(argv) - 1]
    return flag == "-m" and argv[0].endswith((f"{module}.py", f"{module}/__main__.py"))


def reexec() -> None:
    """Start this process again under `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` and with
    `dew._native_buffers` preloaded where that would change how XLA's buffers are allocated (see
    `environment`); otherwise return and go on as it is. Call it first thing in a program's entry
    point, before threads or open work: the process is replaced."""
    if _AGAIN in os.environ:  # the started-again process: what it starts, starts as any other would
        forget_preload(os.environ)
        del os.environ[_AGAIN]
        return
    if not sys.platform.startswith("linux") or not _owns_command_line():
        return
    wanted = environment(dict(os.environ), thp_mode(), platform.libc_ver(), buffers_library())
    if wanted is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], wanted)
