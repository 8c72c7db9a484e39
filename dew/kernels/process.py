"""Process tuning a user asks for, never applied by Dew on its own: a well-kept allocator preloaded, and
glibc's transparent-huge-page tunable. `dew launch` starts a command under them.

XLA's CPU runtime takes each execution's temporaries as one block of tens of MiB (a train step's
activations and gradients). glibc maps a block that large afresh and unmaps it on free, so every step
faults the block in again and the kernel clears its pages. tcmalloc keeps freed blocks for the next
request; so does jemalloc once told not to purge its oversize blocks at once (`oversize_threshold:0`,
which the launcher sets); glibc's `glibc.malloc.hugetlb=1` tunable (glibc 2.35 and later, where the
kernel gives transparent huge pages on request) makes each fault map 2 MiB instead of 4 KiB.
docs/performance.md measures each (`python -m benchmarks.allocators`). Allocators and tunables are read
once, when a process starts, so they can only be given to a new process: `launch_environment` builds its
environment.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
# jemalloc's settings under the launcher: keep blocks of any size for reuse (by default it purges those
# of 8 MiB and more at once), and with huge pages, back its memory with them.
JEMALLOC = {"oversize_threshold": "0"}
JEMALLOC_HUGE_PAGES = {"thp": "always", "metadata_thp": "auto"}
# Each allocator: (its library's file name, the Debian package that installs it).
ALLOCATORS = {"glibc": None, "jemalloc": ("libjemalloc.so.2", "libjemalloc2"),
              "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc-minimal4")}
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_LIBRARY_DIRECTORIES = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                        "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/lib", "/usr/local/lib")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), None where unknown."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def tunable(environ) -> str | None:
    """The value `GLIBC_TUNABLES` in `environ` gives `glibc.malloc.hugetlb`, None where it gives none."""
    entries = (entry.split("=", 1) for entry in environ.get("GLIBC_TUNABLES", "").split(":") if entry)
    return next((pair[1] if len(pair) == 2 else "" for pair in entries if pair[0] == TUNABLE), None)


def find_allocator(name: str, directories=None) -> Path:
    """The shared library of allocator `name` (a key of `ALLOCATORS` but glibc), FileNotFoundError naming
    the package that installs it where it is absent."""
    library, package = ALLOCATORS[name]
    search = [*os.environ.get("LD_LIBRARY_PATH", "").split(":"), *(directories or _LIBRARY_DIRECTORIES)]
    for directory in filter(None, search):
        if (Path(directory) / library).is_file():
            return Path(directory) / library
    raise FileNotFoundError(f"{name} is not installed here ({library} is in none of {', '.join(filter(None, search))}): "
                            f"install it (Debian and Ubuntu: apt install {package}), or launch with --allocator glibc")


def launch_environment(environ: dict[str, str], allocator: str = "glibc", huge_pages: bool = False,
                       libc: tuple[str, str] | None = None, thp: str | None = None, library: Path | None = None
                       ) -> dict[str, str]:
    """`environ` with `allocator` preloaded (`LD_PRELOAD`, in front of what is there) and, with
    `huge_pages`, glibc's huge-page tunable; ValueError naming what cannot apply here.

    `libc` (`platform.libc_ver()`), `thp` (`thp_mode()`) and `library` (`find_allocator`) default to this
    machine's."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r} is not one Dew launches: use one of {', '.join(ALLOCATORS)}")
    wanted = dict(environ)
    if allocator != "glibc":
        path = str(library or find_allocator(allocator))
        preload = [entry for entry in environ.get("LD_PRELOAD", "").replace(":", " ").split() if entry != path]
        wanted["LD_PRELOAD"] = " ".join([path, *preload])
    if allocator == "jemalloc":
        given = dict(entry.split(":", 1) for entry in environ.get("MALLOC_CONF", "").split(",") if ":" in entry)
        settings = {**JEMALLOC, **(JEMALLOC_HUGE_PAGES if huge_pages else {}), **given}  # the user's own win
        wanted["MALLOC_CONF"] = ",".join(f"{key}:{value}" for key, value in settings.items())
    elif huge_pages and allocator != "glibc":
        raise ValueError(f"--huge-pages has no setting in {allocator} (gperftools' tcmalloc keeps no huge pages): "
                         "leave it out, or launch glibc or jemalloc with it")
    elif huge_pages:
        name, version = libc or platform.libc_ver()
        try:
            recent = name == "glibc" and tuple(int(part) for part in version.split(".")[:2]) >= (2, 35)
        except ValueError:
            recent = False
        if not recent:
            raise ValueError(f"--huge-pages needs glibc 2.35 or later, and this is {name or 'not glibc'} {version}")
        mode = thp if thp is not None else thp_mode()
        if mode != "madvise":
            raise ValueError(f"--huge-pages asks the kernel for huge pages, and its mode is {mode!r} "
                             f"({_THP}): 'always' gives them anyway and 'never' refuses them; leave it out")
        if tunable(environ) is None:
            tunables = environ.get("GLIBC_TUNABLES", "")
            wanted["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return wanted
