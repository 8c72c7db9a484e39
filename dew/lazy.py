"""Work done when first asked for: a package's names imported from their modules when first used (PEP 562),
so that importing the package for one piece does not import every other piece's dependencies; and a
function's results kept per argument (`kept`), so that a trace asked for again is not made again."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__` for `names`: each name to the module that defines it
    (a name that is the module itself: the module's full name ending in that name). Any other name that is
    one of the package's modules is that module, imported then (`import dew; dew.sampling.generate` reads
    as it did when the package imported its modules itself)."""
    namespace = importlib.import_module(package).__dict__

    def getattr_(name: str):
        if name in names:
            module = importlib.import_module(names[name])
            value = module if names[name] == f"{package}.{name}" else getattr(module, name)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # found directly from now on
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *names})

    return getattr_, dir_


def kept(maxsize: int):
    """Decorate a function to keep its result per arguments (the `maxsize` most recent), as
    `functools.lru_cache` does, and to compute it again for arguments that cannot be hashed (a model whose
    config holds a list) instead of failing."""

    def decorate(function):
        cached = functools.lru_cache(maxsize=maxsize)(function)

        @functools.wraps(function)
        def call(*args):
            try:
                hash(args)
            except TypeError:
                return function(*args)
            return cached(*args)

        return call

    return decorate
