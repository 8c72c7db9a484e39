"""Family converters, registered by transformers' `model_type`.

Each family module defines `Converter`s (`dew.interop.families.converter`): a config class's fields
with transformers' defaults, the Dew knobs the family fixes, how it reads windows and rotary settings,
its tensor rules (`dew.interop.tensors.Rule`) and, where llama.cpp writes it, its GGUF names. Adding
a family is one file and one row in `_BUILT_IN`:

    # dew/interop/families/cohere.py
    from dew.interop.families.converter import Converter
    from dew.interop.families.llama import DECODER_RULES

    COHERE = Converter("cohere", "CohereConfig", "CohereForCausalLM", {...its declared fields...},
                       DECODER_RULES, knobs=dict(...))

    # here: its model_type, module, converter's name and the GGUF architecture it reads (None: none)
    _BUILT_IN = (..., ("cohere", "cohere", "COHERE", None))

A family's module is imported when its converter is first asked for, so loading a Llama imports no
vision tower. `register(converter)` adds one while the program runs (a test's own family). `family_of(config.json)`
finds the converter that reads a config, `family_for(DecoderConfig)` the plainest one that writes a
config computing exactly that model, and `gguf_family(architecture)` the one that reads a GGUF file.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from dew.interop.families.converter import Converter, GGUFNames
from dew.interop.hf_decoders import refuse_quantized
from dew.nn.transformer import DecoderConfig

# Plainest first: `family_for` takes the first family that computes a model exactly. Each row: the
# model_type, the module of dew.interop.families defining it, the converter's name there, and the GGUF
# architecture it reads (None: no GGUF), which `gguf_family` reads without importing every family.
_BUILT_IN = (
    ("llama", "llama", "LLAMA", "llama"), ("qwen2", "qwen", "QWEN2", "qwen2"), ("qwen3", "qwen", "QWEN3", "qwen3"),
    ("mistral", "llama", "MISTRAL", None), ("ministral", "llama", "MINISTRAL", None),
    ("gemma", "gemma", "GEMMA", None), ("gemma2", "gemma", "GEMMA2", None),
    ("gemma3_text", "gemma", "GEMMA3_TEXT", None), ("olmo2", "olmo", "OLMO2", None),
    ("olmo3", "olmo", "OLMO3", None), ("llada", "llada", "LLADA", None), ("Dream", "dream", "DREAM", None),
    ("mixtral", "mixtral", "MIXTRAL", "llama"), ("qwen2_moe", "qwen_moe", "QWEN2_MOE", "qwen2moe"),
    ("qwen3_moe", "qwen_moe", "QWEN3_MOE", "qwen3moe"),
    ("diffusion_gemma", "diffusion_gemma", "DIFFUSION_GEMMA", None),
    ("deepseek_v3", "deepseek", "DEEPSEEK_V3", None), ("deepseek_v2", "deepseek", "DEEPSEEK_V2", None),
    ("deepseek_v32", "deepseek", "DEEPSEEK_V32", None), ("mamba2", "mamba2", "MAMBA2", "mamba2"),
    ("gemma3", "gemma3", "GEMMA3", None), ("phi3", "phi3", "PHI3", None),
    ("qwen3_5_text", "qwen3_next", "QWEN3_5_TEXT", None), ("qwen3_next", "qwen3_next", "QWEN3_NEXT", None),
    ("qwen3_5_moe_text", "qwen3_next", "QWEN3_5_MOE_TEXT", None), ("smollm3", "smollm3", "SMOLLM3", "smollm3"),
    ("granite", "granite", "GRANITE", "granite"), ("llama4_text", "llama4_text", "LLAMA4_TEXT", None),
    ("llama4", "llama4", "LLAMA4", None), ("qwen3_5", "qwen3_5", "QWEN3_5", None),
    ("qwen3_5_moe", "qwen3_5", "QWEN3_5_MOE", None), ("gemma4_text", "gemma4", "GEMMA4_TEXT", None),
    ("gemma4", "gemma4_multimodal", "GEMMA4", None), ("gemma3n_text", "gemma3n", "GEMMA3N_TEXT", None),
    ("gemma3n", "gemma3n_multimodal", "GEMMA3N", None),
)


def _family_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


class _Families(MutableMapping):
    """model_type -> `Converter`, in registration order; a built-in family's module is imported when its
    converter is first looked up (membership and the names need no import)."""

    def __init__(self):
        self._entries: dict[str, Converter | tuple[str, str]] = {}
        self._gguf: dict[str, str | None] = {}  # a built-in family's GGUF architecture, before its import

    def __getitem__(self, model_type: str) -> Converter:
        entry = self._entries[model_type]
        if isinstance(entry, tuple):
            module, name = entry
            entry = getattr(_family_module(module), name)
            self._entries[model_type] = entry
        return entry

    def __setitem__(self, model_type: str, converter: Converter) -> None:
        self._entries[model_type] = converter
        self._gguf.pop(model_type, None)

    def __delitem__(self, model_type: str) -> None:
        del self._entries[model_type]
        self._gguf.pop(model_type, None)

    def __contains__(self, model_type: object) -> bool:
        return model_type in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def gguf_architecture(self, model_type: str) -> str | None:
        """The GGUF architecture `model_type`'s family reads (None: none), its module not imported for it."""
        if model_type in self._gguf:
            return self._gguf[model_type]
        gguf = self[model_type].gguf
        return None if gguf is None else gguf.architecture


FAMILIES = _Families()
for _model_type, _module, _name, _architecture in _BUILT_IN:
    FAMILIES._entries[_model_type] = (_module, _name)
    FAMILIES._gguf[_model_type] = _architecture


def register(converter: Converter) -> Converter:
    """Make `converter` the family of its `model_type`; a model type already registered is refused."""
    if converter.model_type in FAMILIES:
        raise ValueError(f"model_type {converter.model_type!r} already has a family converter")
    FAMILIES[converter.model_type] = converter
    return converter


def family_of(source: Mapping[str, Any], where: str = "config.json") -> Converter:
    """The family of a config.json, refusing a quantized one and an unknown or missing model_type by name."""
    refuse_quantized(source, where)
    model_type = source.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type is None:
        native = (" (mamba_ssm's own format: load_pretrained reads it as transformers' Mamba2 port)"
                  if _family_module("mamba2").is_mamba_ssm(source) else "")
        raise ValueError(f"{where} has no model_type{native}: Dew loads transformers decoders whose config names one "
                         f"of {sorted(FAMILIES)}")
    raise ValueError(f"{where} names model_type {model_type!r}, which is not a Dew family: native families are "
                     f"{sorted(FAMILIES)} (load_pretrained tries another type through a verified mapping, tier 2)")


def ported(source: Mapping[str, Any], where: str = "config.json") -> Mapping[str, Any]:
    """The config.json of the transformers port that reads a checkpoint in a format with none of its own
    (mamba_ssm's, `mamba2.port_config`); any other config as it is."""
    mamba2 = _family_module("mamba2")
    return mamba2.port_config(source, where) if mamba2.is_mamba_ssm(source) else source


def decoder_kwargs(source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """`DecoderConfig` keyword arguments (without dtypes) for a transformers config.json's contents."""
    return family_of(source, where).decoder_kwargs(source, where)


def family_for(config: DecoderConfig) -> Converter:
    """The plainest family whose transformers model computes exactly `config` (Llama for the default
    knobs, Qwen 2 for query/key/value biases, Gemma for Gemma's norms, ...); a model no family
    computes is refused, naming what the closest one would compute differently."""
    closest = None
    for converter in FAMILIES.values():
        if not converter.writes_decoders:
            continue  # DiffusionGemma's converter writes its own model, never a DecoderConfig
        differences = converter.differences(config)
        if not differences:
            return converter
        if closest is None or len(differences) < len(closest[1]):
            closest = (converter, differences)
    converter, differences = closest
    raise ValueError(f"no transformers family computes this model, so it cannot be written as a transformers "
                     f"checkpoint: the closest, {converter.model_type} ({converter.config_class}), computes "
                     f"{'; '.join(differences)}; change those knobs, or add a family (dew/interop/families)")


def gguf_families(architecture: str) -> list[Converter]:
    """The families that read a GGUF file of llama.cpp's `architecture` (`general.architecture`), plainest
    first; only their modules are imported."""
    return [FAMILIES[model_type] for model_type in FAMILIES
            if FAMILIES.gguf_architecture(model_type) == architecture]


def gguf_family(architecture: str) -> Converter | None:
    """The family llama.cpp names `architecture` (`general.architecture`), None when Dew reads no such GGUF."""
    return next(iter(gguf_families(architecture)), None)


def gguf_architectures() -> list[str]:
    """The GGUF architectures Dew reads."""
    return [architecture for architecture in map(FAMILIES.gguf_architecture, FAMILIES) if architecture is not None]


__all__ = ["FAMILIES", "Converter", "GGUFNames", "decoder_kwargs", "ported", "family_for", "family_of", "gguf_architectures",
           "gguf_families", "gguf_family", "register"]
