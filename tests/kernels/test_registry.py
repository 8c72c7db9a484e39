"""`dew.kernels.registry.register_targets` registers every kernel's XLA targets: a program loaded from its
bytes in a fresh process (`dew.serve.programs`) fails to load, and is compiled again at every start, when a
kernel it calls was left out."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import dew.kernels
from dew.kernels import registry


def test_every_function_that_registers_targets_is_a_loader():
    registering = set()
    for path in Path(dew.kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(call, ast.Attribute) and call.attr == "register_ffi_target" for call in ast.walk(node)):
                registering.add((path.stem, node.name))
    loaders = {(Path(inspect.getsourcefile(inspect.unwrap(load))).stem, load.__name__) for load in registry.LOADERS}
    # (a loader may also wire a kernel up without registering a target: softmax's attention takes oneDNN's gemm)
    assert registering and registering <= loaders, registering - loaders
