"""The family registry (`dew.interop.families`): every built-in family listed, its module imported only
when its converter is asked for."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

from dew.interop.families import _BUILT_IN, FAMILIES, gguf_architectures, gguf_families, gguf_family, register
from dew.interop.families.llama import LLAMA_FIELDS, DECODER_RULES
from dew.interop.families.converter import Converter, GGUFNames


def test_the_table_names_each_converter_with_its_model_type_and_gguf_architecture():
    assert list(FAMILIES)[:len(_BUILT_IN)] == [model_type for model_type, *_ in _BUILT_IN]
    for model_type, module, name, architecture in _BUILT_IN:
        converter = getattr(importlib.import_module(f"dew.interop.families.{module}"), name)
        assert converter.model_type == model_type
        assert (converter.gguf.architecture if converter.gguf is not None else None) == architecture, model_type
        assert FAMILIES[model_type] is converter
    assert sorted(set(gguf_architectures())) == ["granite", "llama", "mamba2", "qwen2", "qwen2moe", "qwen3",
                                                 "qwen3moe", "smollm3"]
    assert [family.model_type for family in gguf_families("llama")] == ["llama", "mixtral"]  # plainest first
    assert gguf_family("no-such-architecture") is None


def test_a_registered_family_is_listed_and_found_by_its_gguf_architecture():
    converter = Converter("registry-test", "LlamaConfig", "LlamaForCausalLM", LLAMA_FIELDS, DECODER_RULES,
                          gguf=GGUFNames("registry-test-arch", {}, {}))
    register(converter)
    try:
        assert "registry-test" in FAMILIES and list(FAMILIES)[-1] == "registry-test"
        assert gguf_family("registry-test-arch") is converter
        assert "registry-test-arch" in gguf_architectures()
    finally:
        del FAMILIES["registry-test"]
    assert "registry-test" not in FAMILIES and gguf_family("registry-test-arch") is None


def test_finding_a_llama_imports_no_other_familys_module():
    # in a fresh process: this one imported every family already
    script = ("import sys; from dew.interop.families import FAMILIES, gguf_family, family_of; "
              "assert 'gemma3n' in FAMILIES and len(FAMILIES) > 30; "
              "gguf_family('llama'); family_of({'model_type': 'llama'}); "
              "import json; print(json.dumps(sorted(m for m in sys.modules if m.startswith(('dew.interop.families.', 'dew.nn.vision', "
              "'dew.nn.audio')))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    imported = set(json.loads(done.stdout))
    # diffusion_gemma's module: dew.interop.pretrained reads its checkpoints; mixtral's: llama.cpp writes it as a llama
    assert imported == {"dew.interop.families.converter", "dew.interop.families.llama", "dew.interop.families.mixtral",
                        "dew.interop.families.experts", "dew.interop.families.diffusion_gemma"}
