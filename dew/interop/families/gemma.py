"""Gemma, Gemma 2 and Gemma 3 (text): `(1 + scale)` norms and scaled embeddings; Gemma 2 and 3 add
norms after each sublayer, alternating sliding layers and a query scale, Gemma 2 score and logit caps,
Gemma 3 query/key norms and a rotary setting per layer type."""

from __future__ import annotations

from collections.abc import Mapping

from dew.interop.families.converter import Converter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.nn.transformer import FULL, SLIDING

_GEMMA_FIELDS = {
    "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": None,
}
_GEMMA2_FIELDS = {
    **{k: v for k, v in _GEMMA_FIELDS.items() if k != "hidden_act"},
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}
_KNOBS = dict(norm_style="gemma", scale_embeddings=True)


class GemmaConverter(Converter):
    """Gemma 1, whose older configs spell the tanh GELU "gelu", as transformers reads it."""

    def activation(self, fields: ConfigFields) -> str:
        activation = super().activation(fields)
        return "gelu_pytorch_tanh" if activation == "gelu" else activation


def _alternating(source: Mapping, layers: int) -> list[str]:
    return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]


def _gemma3_pattern(source: Mapping, layers: int) -> list[str]:
    every = source.get("sliding_window_pattern", 6)
    return [SLIDING if (i + 1) % every else FULL for i in range(layers)]


GEMMA = GemmaConverter("gemma", "GemmaConfig", "GemmaForCausalLM", _GEMMA_FIELDS, DECODER_RULES, _KNOBS)
GEMMA2 = Converter("gemma2", "Gemma2Config", "Gemma2ForCausalLM", _GEMMA2_FIELDS, DECODER_RULES,
                   dict(_KNOBS, norm_placement="sandwich"), window="layer_types", default_pattern=_alternating,
                   activation_field="hidden_activation")
GEMMA3_TEXT = Converter(
    "gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM",
    {**_GEMMA2_FIELDS, "vocab_size": 262208, "max_position_embeddings": 131072, "final_logit_softcapping": None,
     "attn_logit_softcapping": None, "use_bidirectional_attention": False},
    DECODER_RULES, dict(_KNOBS, norm_placement="sandwich", qk_norm=True), window="layer_types",
    default_pattern=_gemma3_pattern, rope_thetas=(1_000_000.0, 10_000.0), activation_field="hidden_activation",
    rope_by_layer_type=True, sliding_theta_field="rope_local_base_freq",
    legacy_fields=frozenset({"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}),
)
