"""timm for the Gemma 3n oracles, without torchvision: `import_timm`, and `timm_wrapper_without_torchvision`, under
which transformers' `TimmWrapperModel` (the vision tower of `Gemma3nForConditionalGeneration`) can be built. Used by
the tests and by tools/make_gemma3n_fixtures.py."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from unittest import mock


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty `torchvision.*` modules for `import timm` alone.

    timm imports torchvision at its top (`timm.layers.norm_act` takes `FrozenBatchNorm2d` from
    `torchvision.ops.misc`, `timm.data` its transforms and datasets), but MobileNet-v5 runs none of it. The
    torchvision wheel that matches torch 2.13 (0.28.0) is a CUDA build: against the CPU torch its `_C.so` cannot
    load (it needs libc10_cuda.so) and `import torchvision` then fails registering fake kernels for the missing
    `torchvision::nms`; installed beside transformers it would also break every image processor, which imports it.
    So the oracle imports timm with these stand-ins (any attribute is an inert class, so timm's subclasses and
    enum lookups resolve) and takes them out of `sys.modules` again."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        pass


class _StandInClass(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInClass(f"{cls.__name__}.{name}", (), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandInClass(f"{self.__name__}.{name}", (), {})


def import_timm():
    """timm, imported with the torchvision stand-ins (see `_TorchvisionStandIn`); ImportError where it is not
    installed."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    if importlib.util.find_spec("timm") is None:
        raise ImportError("timm is not installed (the test extra lists it)")
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    finally:
        sys.meta_path.remove(finder)
        for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
            if isinstance(sys.modules[name], _StandInModule):
                del sys.modules[name]
    return timm


@contextlib.contextmanager
def timm_wrapper_without_torchvision():
    """transformers' TimmWrapperModel made buildable: it checks for torchvision (which its `is_timm_available`
    requires, see `_TorchvisionStandIn` for why none imports here) before calling `timm.create_model`, and imports
    timm only when that check passes. Inside this context the check is lifted and the module holds the timm
    `import_timm` gives; the model built is what the wrapper builds anywhere, timm's encoder under `timm_model`."""
    from transformers.models.timm_wrapper import modeling_timm_wrapper

    timm = import_timm()
    with mock.patch.object(modeling_timm_wrapper, "requires_backends", lambda *args, **kwargs: None), \
            mock.patch.object(modeling_timm_wrapper, "timm", timm, create=True):
        yield
