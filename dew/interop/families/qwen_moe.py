"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE: Qwen 2's and Qwen 3's attention, with sparse
layers chosen by `decoder_sparse_step` and `mlp_only_layers` (the others the dense MLP of
`intermediate_size`), `moe_intermediate_size` experts whose top-k weights are renormalised only with
`norm_topk_prob`; Qwen2-MoE adds a shared expert scaled by a sigmoid gate.

Their windows differ from Qwen 2's: Qwen2-MoE's default layer types window the even layers below
`max_window_layers`, and Qwen3-MoE windows every layer when `use_sliding_window` says so.
"""

from __future__ import annotations

from dew.interop.families.converter import GGUFNames
from dew.interop.families.experts import (
    LLAMA_CPP_SHARED_NAMES, MixtureConverter, hub_rules, llama_cpp_metadata, llama_cpp_router,
)
from dew.interop.families.llama import LLAMA_CPP_METADATA, LLAMA_CPP_NAMES
from dew.interop.families.qwen import QwenConverter
from dew.interop.hf_decoders import HEAD_DIM_READ, ConfigFields
from dew.nn.transformer import FULL, SLIDING, DecoderConfig

_COMMON = {
    "vocab_size": 151936, "hidden_size": 2048, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
    "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": None, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}
# transformers' Qwen2MoeConfig and Qwen3MoeConfig fields and defaults.
_QWEN2_MOE_FIELDS = {
    **_COMMON, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "max_window_layers": 28, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True,
    "layer_types": None,
}
_QWEN3_MOE_FIELDS = {
    **_COMMON, "intermediate_size": 6144, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
    "attention_bias": False, "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
}
_GGUF_METADATA = {**LLAMA_CPP_METADATA, **llama_cpp_metadata("num_experts")}


class Qwen2MoeConverter(MixtureConverter):
    """Qwen2-MoE: `layer_types`, else the even layers below `max_window_layers`, windowed when
    `use_sliding_window` says so."""

    def layer_types(self, fields: ConfigFields, layers: int):
        window = fields.get("sliding_window")  # read either way: transformers keeps it, as 0, when switched off
        window = window if fields.get("use_sliding_window") else None
        below = fields.get("max_window_layers")
        layer_types = fields.get("layer_types") or [
            SLIDING if window is not None and (i + 1) % 2 and i < below else FULL for i in range(layers)]
        return window, list(layer_types)

    def write_window(self, config: DecoderConfig, written: dict) -> None:
        QwenConverter.write_window(self, config, written)


class Qwen3MoeConverter(MixtureConverter):
    """Qwen3-MoE: a window on every layer when `use_sliding_window` says so."""

    def layer_types(self, fields: ConfigFields, layers: int):
        window = fields.get("sliding_window")
        return (window if fields.get("use_sliding_window") else None), None

    def write_window(self, config: DecoderConfig, written: dict) -> None:
        written.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window)


QWEN2_MOE = Qwen2MoeConverter(
    "qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", _QWEN2_MOE_FIELDS, hub_rules(shared=True),
    window="layer_types", getattr_fields=HEAD_DIM_READ,
    gguf=GGUFNames("qwen2moe", {**LLAMA_CPP_NAMES, **llama_cpp_router(), **LLAMA_CPP_SHARED_NAMES}, _GGUF_METADATA),
)
# llama.cpp's qwen3moe graph always renormalises the selected weights, whatever the checkpoint said.
QWEN3_MOE = Qwen3MoeConverter(
    "qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _QWEN3_MOE_FIELDS, hub_rules(), dict(qk_norm=True),
    window="all", getattr_fields=HEAD_DIM_READ, legacy_fields=frozenset({"num_local_experts"}),
    experts_alias="num_local_experts",
    gguf=GGUFNames("qwen3moe", {**LLAMA_CPP_NAMES, **llama_cpp_router()}, _GGUF_METADATA,
                   fixed={"norm_topk_prob": True}),
)
