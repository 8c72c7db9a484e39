"""Llama, Mistral and Ministral, and the transformers decoder block every family here shares.

`DECODER_RULES` are transformers' decoder tensor names (`model.layers.N.self_attn.q_proj.weight`,
stored `[out, in]`, as Dew's `[in, out]` kernels); `LLAMA_CPP_NAMES` and `LLAMA_CPP_METADATA` are how
llama.cpp writes that block and its config.
"""

from __future__ import annotations

from dew.interop.families.converter import Converter, GGUFNames
from dew.interop.tensors import Rule
from dew.nn.transformer import SLIDING

_KERNEL = (1, 0)  # transformers stores a projection [out, in], Dew keeps it [in, out]
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
_LAYER = "model.layers.{layer}"

DECODER_RULES = (
    Rule("embed_tokens/embedding", "model.embed_tokens.weight"),
    *(Rule(f"layers/{norm}/scale", f"{_LAYER}.{norm}.weight") for norm in _NORMS),
    *(Rule(f"layers/self_attn/{norm}/scale", f"{_LAYER}.self_attn.{norm}.weight") for norm in ("q_norm", "k_norm")),
    *(Rule(f"layers/{block}/{proj}/kernel", f"{_LAYER}.{block}.{proj}.weight", transpose=_KERNEL)
      for block, proj in _PROJECTIONS),
    *(Rule(f"layers/{block}/{proj}/bias", f"{_LAYER}.{block}.{proj}.bias") for block, proj in _PROJECTIONS),
    Rule("norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", transpose=_KERNEL),
)

# llama.cpp's names of the decoder block (convert_hf_to_gguf.py), weights and biases alike.
_LLAMA_CPP_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
LLAMA_CPP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    **{f"{_LAYER}.{ours}.{kind}": f"blk.{{layer}}.{theirs}.{kind}"
       for theirs, ours in _LLAMA_CPP_BLOCK.items() for kind in ("weight", "bias")},
}
# llama.cpp's metadata keys (after `{architecture}.`) and the config.json field each gives.
LLAMA_CPP_METADATA = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta", "vocab_size": "vocab_size",
}

LLAMA_FIELDS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
}
_MISTRAL_FIELDS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "rope_parameters": None, "sliding_window": 4096, "attention_dropout": 0.0,
}

LLAMA = Converter("llama", "LlamaConfig", "LlamaForCausalLM", LLAMA_FIELDS, DECODER_RULES,
                  gguf=GGUFNames("llama", LLAMA_CPP_NAMES, LLAMA_CPP_METADATA, permuted=True))
MISTRAL = Converter("mistral", "MistralConfig", "MistralForCausalLM", _MISTRAL_FIELDS, DECODER_RULES, window="all")
MINISTRAL = Converter("ministral", "MinistralConfig", "MinistralForCausalLM", {**_MISTRAL_FIELDS, "layer_types": None},
                      DECODER_RULES, window="layer_types", default_pattern=lambda source, layers: [SLIDING] * layers)
