"""Qwen 2 (and 2.5) and Qwen 3: the Llama block with query/key/value biases (Qwen 2) or per-head
query/key norms (Qwen 3), and Qwen's window switches (`use_sliding_window`, `max_window_layers`)."""

from __future__ import annotations

from dew.interop.families.converter import Converter, GGUFNames, layer_types_of
from dew.interop.families.llama import DECODER_RULES, LLAMA_CPP_METADATA, LLAMA_CPP_NAMES
from dew.interop.hf_decoders import HEAD_DIM_READ, ConfigFields
from dew.nn.transformer import FULL, SLIDING, DecoderConfig

_QWEN2_FIELDS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
    "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "layer_types": None, "attention_dropout": 0.0, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}


class QwenConverter(Converter):
    """A Qwen family: a window only with `use_sliding_window`, on the layers from `max_window_layers`
    on unless `layer_types` names them."""

    def layer_types(self, fields: ConfigFields, layers: int):
        window = fields.get("sliding_window")
        if not fields.get("use_sliding_window"):
            window = None
        first_sliding = fields.get("max_window_layers")
        layer_types = fields.get("layer_types") or [
            SLIDING if window is not None and i >= first_sliding else FULL for i in range(layers)
        ]
        return window, list(layer_types)

    def write_window(self, config: DecoderConfig, written: dict) -> None:
        layer_types = layer_types_of(config)
        written.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window,
                       layer_types=layer_types,
                       max_window_layers=layer_types.index(SLIDING) if SLIDING in layer_types else config.num_layers)


QWEN2 = QwenConverter("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _QWEN2_FIELDS, DECODER_RULES, dict(qkv_bias=True),
                      window="qwen", getattr_fields=HEAD_DIM_READ,
                      gguf=GGUFNames("qwen2", LLAMA_CPP_NAMES, LLAMA_CPP_METADATA))
QWEN3 = QwenConverter("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                      {**_QWEN2_FIELDS, "head_dim": 128, "attention_bias": False}, DECODER_RULES, dict(qk_norm=True),
                      window="qwen", gguf=GGUFNames("qwen3", LLAMA_CPP_NAMES, LLAMA_CPP_METADATA))
