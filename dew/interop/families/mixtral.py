"""Mixtral: Mistral's block with every feed-forward a mixture of experts (top-k of a softmax router,
renormalised), its tensors under `block_sparse_moe` (`gate`, `experts.N.w1/w3/w2`: gate, up, down).
llama.cpp writes it as a llama GGUF with expert metadata and stacked experts."""

from __future__ import annotations

from dew.interop.families.converter import GGUFNames
from dew.interop.families.experts import MixtureConverter, hub_rules, llama_cpp_metadata, llama_cpp_router
from dew.interop.families.llama import LLAMA_CPP_METADATA, LLAMA_CPP_NAMES

# transformers' MixtralConfig fields and defaults.
_FIELDS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
    "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "sliding_window": None,
    "attention_dropout": 0.0, "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "rope_parameters": None,
}
_EXPERTS = "num_local_experts"

MIXTRAL = MixtureConverter(
    "mixtral", "MixtralConfig", "MixtralForCausalLM", _FIELDS,
    hub_rules("block_sparse_moe", ("w1", "w3", "w2")), window="all", rope_thetas=(1e6, 1e6),
    legacy_fields=frozenset({"num_experts"}), experts_field=_EXPERTS, experts_alias="num_experts",
    gguf=GGUFNames("llama", {**LLAMA_CPP_NAMES, **llama_cpp_router("block_sparse_moe")},
                   {**LLAMA_CPP_METADATA, **llama_cpp_metadata(_EXPERTS, expert_width=False)}, permuted=True),
)
