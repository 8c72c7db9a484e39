"""Phi-3: the Llama block with its query/key/value projections fused into one `qkv_proj` and gate and up
into one `gate_up_proj` (split into Dew's kernels at load, fused again at save), and a window on every
layer where the config names one (transformers' Phi3Attention reads `sliding_window` on each layer)."""

from __future__ import annotations

from dew.interop.families.converter import Converter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import HEAD_DIM_READ, ConfigFields
from dew.interop.tensors import Rule

_KERNEL = (1, 0)  # [out, in] in the checkpoint, [in, out] in Dew
_LAYER = "model.layers.{layer}"
_FUSED = {"layers/self_attn/q_proj/kernel", "layers/self_attn/k_proj/kernel", "layers/self_attn/v_proj/kernel",
          "layers/mlp/gate_proj/kernel", "layers/mlp/up_proj/kernel"}

PHI3_RULES = (
    *(rule for rule in DECODER_RULES if not (set(rule.dew) & _FUSED) and "bias" not in rule.dew[0]),
    Rule(("layers/self_attn/q_proj/kernel", "layers/self_attn/k_proj/kernel", "layers/self_attn/v_proj/kernel"),
         f"{_LAYER}.self_attn.qkv_proj.weight", transpose=_KERNEL, axis=1),
    Rule(("layers/mlp/gate_proj/kernel", "layers/mlp/up_proj/kernel"), f"{_LAYER}.mlp.gate_up_proj.weight",
         transpose=_KERNEL, axis=1),
)

_PHI3_FIELDS = {
    "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
    "tie_word_embeddings": False, "rope_parameters": None, "bos_token_id": 1, "eos_token_id": 32000,
    "pad_token_id": 32000, "sliding_window": None,
}


class Phi3Converter(Converter):
    """Phi-3, whose dropout rates are training-only and whose pretraining length only LongRoPE reads."""

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        for name in ("resid_pdrop", "embd_pdrop"):
            fields.require(name, (0, 0.0, None), "Dew applies no dropout, so training would not be the training "
                           "that rate asks for; set it to 0.0 (generation reads it nowhere)")
        fields.get("original_max_position_embeddings")  # LongRoPE's, whose rope_type the rotary reader refuses

    def written(self, config) -> dict:
        return {**super().written(config), "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "original_max_position_embeddings": config.max_seq_len}


PHI3 = Phi3Converter("phi3", "Phi3Config", "Phi3ForCausalLM", _PHI3_FIELDS, PHI3_RULES, window="all",
                     getattr_fields=HEAD_DIM_READ)
