"""Transparent huge pages for XLA's CPU buffers, through glibc's malloc tunable.

XLA's CPU runtime allocates a compiled step's temporaries as one block per execution (67 MiB for the
quick start's step, 95-173 MiB at the train-step benchmark's shape), above glibc's largest mmap
threshold (32 MiB), so every step maps fresh memory and faults it in 4 KiB page by page. Where the
kernel hands out transparent huge pages on request (`/sys/kernel/mm/transparent_hugepage/enabled`
says `[madvise]`, the common default), `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc 2.35 and later)
makes malloc ask for them: measured on a 2-core Zen 4 EPYC, the quick start's float32 step ran 9-10%
faster and the benchmark's 3% (`docs/performance.md`).

glibc reads its tunables once, when the process starts, so a process can only get this by starting
again: `reexec()` replaces a process that owns its command line (`dew train`, the quick-start
example, the train-step benchmark) with itself under the tunable, before any work. A library call
never does. `DEW_HUGEPAGES=0` keeps the process as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_AGAIN = "DEW_HUGEPAGES_STARTED_AGAIN"


def environment(environ: dict[str, str], thp_mode: str | None, libc: tuple[str, str]) -> dict[str, str] | None:
    """The environment to start again with, or None where the tunable is set already, asked off
    (`DEW_HUGEPAGES=0`), or would change nothing (not glibc 2.35+, or the kernel's mode is not
    `madvise`: `always` gives huge pages anyway, `never` refuses them).

    `thp_mode` is the bracketed word of the kernel's setting (None where it cannot be read);
    `libc` is `platform.libc_ver()`."""
    if environ.get("DEW_HUGEPAGES", "1") == "0" or _AGAIN in environ or thp_mode != "madvise":
        return None
    name, version = libc
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or (major, minor) < (2, 35):
        return None
    if tunable(environ) is not None:
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    # _AGAIN marks the started-again process: where something strips GLIBC_TUNABLES (a setuid
    # interpreter), it does not start again and again.
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1", _AGAIN: "1"}


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
    """Start this process again under `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` where that would give
    XLA's buffers huge pages (see `environment`); otherwise return and go on as it is. Call it first
    thing in a program's entry point, before threads or open work: the process is replaced."""
    if not sys.platform.startswith("linux") or not _owns_command_line():
        return
    wanted = environment(dict(os.environ), thp_mode(), platform.libc_ver())
    if wanted is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], wanted)
