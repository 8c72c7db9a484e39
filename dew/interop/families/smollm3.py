"""SmolLM3: the Llama block with some layers that read no rotary positions (NoPE): `no_rope_layers`
holds a 1 for each layer that rotates and a 0 for each that does not (by default every
`no_rope_layer_interval`-th layer is NoPE), read into `DecoderConfig.nope` (no query temperature). A sliding window
applies to the layers `layer_types` names sliding, and only with `use_sliding_window`."""

from __future__ import annotations

from dew.interop.families.converter import Converter, GGUFNames
from dew.interop.families.llama import DECODER_RULES, LLAMA_CPP_METADATA, LLAMA_CPP_NAMES
from dew.interop.hf_decoders import HEAD_DIM_READ, ConfigFields
from dew.nn.attention import NoPE
from dew.nn.transformer import FULL, SLIDING

_SMOLLM3_FIELDS = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": 128004,
    "bos_token_id": 128000, "eos_token_id": 128001, "rope_parameters": None, "use_sliding_window": False,
    "sliding_window": None, "no_rope_layers": None, "no_rope_layer_interval": 4, "layer_types": None,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
}


def _rotates(source, layers: int) -> list[bool]:
    """Whether each layer rotates, as transformers' SmolLM3Config fills `no_rope_layers` in."""
    flags = source.get("no_rope_layers")
    if flags is None:
        interval = source.get("no_rope_layer_interval", _SMOLLM3_FIELDS["no_rope_layer_interval"])
        return [(i + 1) % interval != 0 for i in range(layers)]
    return [bool(flag) for flag in flags[:layers]]


def _default_types(source, layers: int) -> list[str]:
    """transformers' layer types without `layer_types`: sliding where a NoPE layer meets the window switch."""
    windowed = source.get("use_sliding_window") and source.get("sliding_window") is not None
    return [SLIDING if windowed and not rotates else FULL for rotates in _rotates(source, layers)]


class SmolLM3Converter(Converter):
    """SmolLM3's NoPE layers and its window switch (see the module)."""

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        layers = kwargs["num_layers"]
        flags, interval = fields.get("no_rope_layers"), fields.get("no_rope_layer_interval")
        if flags is not None and len(flags) < layers:
            fields.refuse("no_rope_layers", flags, f"it needs one entry per layer ({layers}); a 1 rotates, a 0 does not")
        if flags is None and not (isinstance(interval, int) and interval >= 1):
            fields.refuse("no_rope_layer_interval", interval, "give a whole number of layers >= 1 (SmolLM3 uses 4)")
        rotates = _rotates(fields.source, layers)
        if not all(rotates):
            kwargs["nope"] = NoPE(tuple(i for i, rotating in enumerate(rotates) if not rotating))
        if "layer_types" in kwargs and not fields.get("use_sliding_window"):
            fields.refuse("use_sliding_window", False, "layer_types names sliding layers, whose mask transformers "
                          "builds while its attention kernels read no window without use_sliding_window: set it "
                          "to true for windowed layers, or name every layer full_attention")
        fields.get("use_sliding_window")

    def written(self, config) -> dict:
        still = () if config.nope is None else config.nope.layers
        rotates = [i not in still for i in range(config.num_layers)]
        return {**super().written(config), "no_rope_layers": [int(flag) for flag in rotates],
                "use_sliding_window": config.sliding_window is not None and SLIDING in (config.layer_types or ())}


# llama.cpp writes SmolLM3 as Llama's block and fixes every fourth layer NoPE in its graph.
SMOLLM3 = SmolLM3Converter("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", _SMOLLM3_FIELDS, DECODER_RULES,
                           window="layer_types", default_pattern=_default_types, rope_thetas=(2_000_000.0, 2_000_000.0),
                           getattr_fields=HEAD_DIM_READ,
                           gguf=GGUFNames("smollm3", LLAMA_CPP_NAMES, LLAMA_CPP_METADATA, permuted=True,
                                          fixed={"no_rope_layer_interval": 4}))
