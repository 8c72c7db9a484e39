"""Dew's compiled kernels: every `native/<name>.cc` becomes the extension module `dew._native_<name>`,
XLA FFI handlers the compiled steps call through `jax.ffi` (`dew.kernels`).

The extensions are optional: where one cannot build (no C++ compiler, no Python headers) the install
goes on without it and Dew runs XLA's own products (`dew.kernels.matmul.status()` says why it is off).
`DEW_NATIVE=0` skips them on purpose: a TPU or GPU runs XLA's products and never calls them."""

import os
from pathlib import Path

from setuptools import Extension, setup


def _ffi_include() -> list[str]:
    try:
        import jaxlib  # the XLA FFI headers ship inside jaxlib (jax.ffi.include_dir())
    except ImportError:
        return []
    return [str(Path(jaxlib.__file__).parent / "include")]


def _extensions() -> list[Extension]:
    native = Path(__file__).parent / "native"
    include = _ffi_include()
    if not include or os.environ.get("DEW_NATIVE", "1") == "0":  # DEW_NATIVE=0: an accelerator's install
        return []
    return [Extension(f"dew._native_{source.stem}", [str(source.relative_to(native.parent))],
                      include_dirs=include, language="c++", optional=True,
                      depends=["native/module.h", "native/isa.h", "native/vectors.h"],
                      extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden"])
            for source in sorted(native.glob("*.cc"))]


setup(ext_modules=_extensions())
