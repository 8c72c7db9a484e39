"""Dream (Dream-org/Dream-v0-Base-7B and -Instruct): a masked-diffusion language model initialised from
Qwen 2.5, whose block is Qwen 2's attending in both directions.

Its config.json is the remote code's `DreamConfig` (model_type "Dream"): Qwen 2's fields and tensor
names, and a `mask_token_id`. Its attention always has query/key/value biases, whatever the config
says. It kept the autoregressive alignment it started from: the state at position i - 1 predicts the
token at i (its sampler shifts the logits right by one, the first position keeping its own), which
its `process(config)` carries as `logits_shift=1`. transformers has no class for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.interop.families.llada import MaskedDiffusionConverter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.nn.rotary import RopeScaling
from dew.nn.transformer import DecoderConfig

# The remote code's `DreamConfig` fields and their defaults (configuration_dream.py), but its
# `mask_token_id`, which `process` reads: the decoder never does.
_FIELDS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": False, "tie_word_embeddings": False,
    "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "attention_dropout": 0.0, "pad_token_id": 151643, "bos_token_id": None, "eos_token_id": None,
}
_MASK = "mask_token_id"


class DreamConverter(MaskedDiffusionConverter):
    """Dream's config.json: Qwen 2's fields, read as the remote code reads them (see the module)."""

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        source = {key: value for key, value in source.items() if key != _MASK}
        # The remote code's rotary embedding reads rope_theta and rope_scaling, never rope_parameters.
        if source.get("rope_parameters") is not None:
            ConfigFields(source, self, where).refuse(
                "rope_parameters", source["rope_parameters"], "Dream's code reads rope_theta and rope_scaling only: "
                "write the rotary setting there")
        return super().decoder_kwargs(source, where)

    def layer_types(self, fields: ConfigFields, layers: int):
        # Dream's attention applies no window: the window of Qwen 2 it copied lives in a flash-attention path it lacks.
        fields.get("sliding_window"), fields.get("max_window_layers")
        if fields.get("use_sliding_window"):
            fields.refuse("use_sliding_window", True, "Dream's attention attends to every key: set it to false")
        return None, None

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        """Dream's config.json for `config`, the rotary setting where Dream reads it, naming no mask id."""
        written = super().written(config)
        rope = written.pop("rope_parameters")
        written["rope_theta"] = rope.pop("rope_theta")
        written["rope_scaling"] = None if config.rope_scaling == RopeScaling() else rope
        return {**written, _MASK: None}


DREAM = DreamConverter("Dream", "DreamConfig", "DreamModel", _FIELDS, DECODER_RULES, dict(qkv_bias=True, causal=False),
                       logits_shift=1)
