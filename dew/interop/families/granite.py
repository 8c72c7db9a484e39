"""Granite: the Llama block with four multipliers, each a `DecoderConfig` knob: the embeddings times
`embedding_multiplier` (`embedding_scale`), each sublayer's output times `residual_multiplier` before
the residual add (`residual_scale`), the attention scores times `attention_multiplier` in place of
`head_dim ** -0.5` (`query_scale`), and the logits divided by `logits_scaling` (`logit_divisor`)."""

from __future__ import annotations

from dew.interop.families.converter import Converter, GGUFNames
from dew.interop.families.llama import DECODER_RULES, LLAMA_CPP_METADATA, LLAMA_CPP_NAMES
from dew.interop.hf_decoders import HEAD_DIM_READ, ConfigFields

_GRANITE_FIELDS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
    "attention_dropout": 0.0, "mlp_bias": False, "embedding_multiplier": 1.0, "logits_scaling": 1.0,
    "residual_multiplier": 1.0, "attention_multiplier": 1.0,
}
# transformers' field, Dew's knob
_MULTIPLIERS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                "attention_multiplier": "query_scale", "logits_scaling": "logit_divisor"}


class GraniteConverter(Converter):
    """Granite's multipliers (see the module)."""

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        for field, knob in _MULTIPLIERS.items():
            value = fields.get(field)
            if not (isinstance(value, (int, float)) and value > 0):
                fields.refuse(field, value, "give a positive number (1.0 changes nothing)")
            kwargs[knob] = float(value)

    def written(self, config) -> dict:
        query_scale = config.head_dim ** -0.5 if config.query_scale is None else config.query_scale
        values = {"embedding_scale": config.embedding_scale, "residual_scale": config.residual_scale,
                  "query_scale": query_scale, "logit_divisor": config.logit_divisor}
        return {**super().written(config), **{field: values[knob] for field, knob in _MULTIPLIERS.items()}}


# llama.cpp writes Granite as Llama's block (its rows permuted the same way) with the multipliers as scales.
GRANITE = GraniteConverter("granite", "GraniteConfig", "GraniteForCausalLM", _GRANITE_FIELDS, DECODER_RULES,
                           getattr_fields=HEAD_DIM_READ,
                           gguf=GGUFNames("granite", LLAMA_CPP_NAMES, {
                               **LLAMA_CPP_METADATA, "embedding_scale": "embedding_multiplier",
                               "residual_scale": "residual_multiplier", "attention.scale": "attention_multiplier",
                               "logit_scale": "logits_scaling"}, permuted=True))
