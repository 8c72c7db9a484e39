"""OLMo 2 and OLMo 3: norms after each sublayer only (before the residual add), OLMo's norm rounding,
and query/key norms over the whole projection; OLMo 3 adds sliding layers and a rotary setting per
layer type."""

from __future__ import annotations

from dew.interop.families.converter import Converter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import HEAD_DIM_READ
from dew.nn.transformer import FULL, SLIDING

_OLMO2_FIELDS = {
    "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "use_cache": True, "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279,
    "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-5,
}
_KNOBS = dict(norm_style="olmo", norm_placement="post", qk_norm=True, qk_norm_scope="projection")

OLMO2 = Converter("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _OLMO2_FIELDS, DECODER_RULES, _KNOBS,
                  getattr_fields=HEAD_DIM_READ)
OLMO3 = Converter("olmo3", "Olmo3Config", "Olmo3ForCausalLM", {**_OLMO2_FIELDS, "sliding_window": 4096,
                                                               "layer_types": None},
                  DECODER_RULES, _KNOBS, window="layer_types",
                  default_pattern=lambda source, layers: [SLIDING if (i + 1) % 4 else FULL for i in range(layers)],
                  rope_thetas=(500_000.0, 500_000.0), rope_by_layer_type=True, getattr_fields=HEAD_DIM_READ)
