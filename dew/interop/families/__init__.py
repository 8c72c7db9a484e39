"""Family converters, registered by transformers' `model_type`.

Each family module defines `Converter`s (`dew.interop.families.converter`): a config class's fields
with transformers' defaults, the Dew knobs the family fixes, how it reads windows and rotary settings,
its tensor rules (`dew.interop.tensors.Rule`) and, where llama.cpp writes it, its GGUF names. Adding
a family is one file and one entry in `_BUILT_IN`:

    # dew/interop/families/cohere.py
    from dew.interop.families.converter import Converter
    from dew.interop.families.llama import DECODER_RULES

    COHERE = Converter("cohere", "CohereConfig", "CohereForCausalLM", {...its declared fields...},
                       DECODER_RULES, knobs=dict(...))

    # here
    _BUILT_IN = (..., cohere.COHERE)

`register(converter)` adds one while the program runs (a test's own family). `family_of(config.json)`
finds the converter that reads a config, `family_for(DecoderConfig)` the plainest one that writes a
config computing exactly that model, and `gguf_family(architecture)` the one that reads a GGUF file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families import (
    deepseek, diffusion_gemma, dream, gemma, gemma3, gemma3n, gemma3n_multimodal, gemma4, gemma4_multimodal, granite,
    llada, llama, llama4,
    llama4_text, mamba2, mixtral, olmo, phi3, qwen, qwen3_5, qwen3_next, qwen_moe, smollm3,
)
from dew.interop.families.converter import Converter, GGUFNames
from dew.interop.hf_decoders import refuse_quantized
from dew.nn.transformer import DecoderConfig

# Plainest first: `family_for` takes the first family that computes a model exactly.
_BUILT_IN = (llama.LLAMA, qwen.QWEN2, qwen.QWEN3, llama.MISTRAL, llama.MINISTRAL, gemma.GEMMA, gemma.GEMMA2,
             gemma.GEMMA3_TEXT, olmo.OLMO2, olmo.OLMO3, llada.LLADA, dream.DREAM, mixtral.MIXTRAL,
             qwen_moe.QWEN2_MOE, qwen_moe.QWEN3_MOE, diffusion_gemma.DIFFUSION_GEMMA, deepseek.DEEPSEEK_V3,
             deepseek.DEEPSEEK_V2, deepseek.DEEPSEEK_V32, mamba2.MAMBA2, gemma3.GEMMA3, phi3.PHI3,
             qwen3_next.QWEN3_5_TEXT, qwen3_next.QWEN3_NEXT, qwen3_next.QWEN3_5_MOE_TEXT, smollm3.SMOLLM3,
             granite.GRANITE, llama4_text.LLAMA4_TEXT, llama4.LLAMA4, qwen3_5.QWEN3_5, qwen3_5.QWEN3_5_MOE,
             gemma4.GEMMA4_TEXT, gemma4_multimodal.GEMMA4, gemma3n.GEMMA3N_TEXT, gemma3n_multimodal.GEMMA3N)
FAMILIES: dict[str, Converter] = {}


def register(converter: Converter) -> Converter:
    """Make `converter` the family of its `model_type`; a model type already registered is refused."""
    if converter.model_type in FAMILIES:
        raise ValueError(f"model_type {converter.model_type!r} already has a family converter")
    FAMILIES[converter.model_type] = converter
    return converter


for _converter in _BUILT_IN:
    register(_converter)


def family_of(source: Mapping[str, Any], where: str = "config.json") -> Converter:
    """The family of a config.json, refusing a quantized one and an unknown or missing model_type by name."""
    refuse_quantized(source, where)
    model_type = source.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type is None:
        native = (" (mamba_ssm's own format: load_pretrained reads it as transformers' Mamba2 port)"
                  if mamba2.is_mamba_ssm(source) else "")
        raise ValueError(f"{where} has no model_type{native}: Dew loads transformers decoders whose config names one "
                         f"of {sorted(FAMILIES)}")
    raise ValueError(f"{where} names model_type {model_type!r}, which is not a Dew family: native families are "
                     f"{sorted(FAMILIES)} (load_pretrained tries another type through a verified mapping, tier 2)")


def ported(source: Mapping[str, Any], where: str = "config.json") -> Mapping[str, Any]:
    """The config.json of the transformers port that reads a checkpoint in a format with none of its own
    (mamba_ssm's, `mamba2.port_config`); any other config as it is."""
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


def gguf_family(architecture: str) -> Converter | None:
    """The family llama.cpp names `architecture` (`general.architecture`), None when Dew reads no such GGUF."""
    return next((converter for converter in FAMILIES.values()
                 if converter.gguf is not None and converter.gguf.architecture == architecture), None)


def gguf_architectures() -> list[str]:
    """The GGUF architectures Dew reads."""
    return [converter.gguf.architecture for converter in FAMILIES.values() if converter.gguf is not None]


__all__ = ["FAMILIES", "Converter", "GGUFNames", "decoder_kwargs", "ported", "family_for", "family_of", "gguf_architectures",
           "gguf_family", "register"]
