"""Dew's compiled kernels (`native/<name>.cc`, built by `pip install` into `dew._native_<name>`): importing
one, and the conditions every one of them needs to run inside a compiled step."""

from __future__ import annotations

import importlib
from types import ModuleType

import jax


def import_extension(name: str) -> tuple[ModuleType | None, str]:
    """(the extension `dew._native_<name>`, "") or (None, why it cannot run in this process)."""
    if jax.default_backend() != "cpu":
        return None, f"the backend is {jax.default_backend()}, and Dew's native kernels are for the CPU"
    try:
        return importlib.import_module(f"dew._native_{name}"), ""
    except ImportError as error:
        return None, (f"the extension dew._native_{name} did not build ({error}); reinstall Dew where a C++ "
                      "compiler and Python's headers are present")


def several_devices() -> str | None:
    """Why a native kernel must stay out of this process's steps when it sees several devices, else None."""
    count = jax.device_count()
    if count == 1:
        return None
    return (f"this process sees {count} devices, and sharded steps keep XLA's products (GSPMD cannot "
            "partition a foreign call)")
