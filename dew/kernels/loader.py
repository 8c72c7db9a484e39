"""Loading Dew's compiled kernels (`native/<name>.cc`, built by `pip install` into `dew._native_<name>`)
and oneDNN's library (the `onednn-cpu-gomp` wheel) whose gemm the products and the fused attention call."""

from __future__ import annotations

import ctypes
import functools
import importlib
from importlib import metadata
from pathlib import Path
from types import ModuleType

ONEDNN = "onednn-cpu-gomp"
# oneDNN's entry points the kernels call, and its OpenMP runtime's thread-count functions: each piece of a
# product runs single-threaded on one of XLA's threads and tells that runtime so.
_ONEDNN_FUNCTIONS = ("dnnl_sgemm", "dnnl_gemm_bf16bf16f32", "omp_set_num_threads", "omp_get_max_threads")


def import_extension(name: str) -> tuple[ModuleType | None, str]:
    """(the extension `dew._native_<name>`, "") or (None, why it did not build)."""
    try:
        return importlib.import_module(f"dew._native_{name}"), ""
    except ImportError as error:
        return None, (f"the extension dew._native_{name} did not build ({error}); reinstall Dew where a C++ "
                      "compiler and Python's headers are present")


def onednn_path() -> Path:
    """oneDNN's shared library in the installed wheel; LookupError saying why where it is absent."""
    try:
        files = metadata.files(ONEDNN) or []
    except metadata.PackageNotFoundError:
        raise LookupError(f"the {ONEDNN} wheel is not installed (it exists for x86-64 Linux only)") from None
    for file in files:
        if file.name.startswith("libdnnl.so"):
            return Path(file.locate()).resolve()
    raise LookupError(f"the {ONEDNN} wheel holds no libdnnl.so")


@functools.cache
def onednn_functions() -> dict[str, int]:
    """The addresses of oneDNN's gemm entry points and of its OpenMP runtime's thread-count functions;
    LookupError saying why where the library cannot load."""
    library = onednn_path()
    try:
        dnnl = ctypes.CDLL(str(library))
    except OSError as error:
        raise LookupError(f"{library} did not load ({error})") from None
    return {name: ctypes.cast(getattr(dnnl, name), ctypes.c_void_p).value for name in _ONEDNN_FUNCTIONS}


def onednn_version() -> str | None:
    """The installed oneDNN wheel's version, None without it."""
    try:
        return metadata.version(ONEDNN)
    except metadata.PackageNotFoundError:
        return None
