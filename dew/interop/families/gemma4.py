"""Gemma 4's text decoder (`model_type` "gemma4_text", transformers' `Gemma4ForCausalLM`).

Gemma 3's sandwich block (sliding and full layers, by default five sliding then one full, the last layer
always full; a rotary setting per layer type, the full layers' "proportional": only the first
`partial_rotary_factor` of each head's feature pairs turn) with Gemma 4's changes, read into
`DecoderConfig.gemma4` (`dew.nn.gemma4.Gemma4Layers`): norms that multiply by their weight ("olmo" norms),
unscaled scores over RMS-normed queries, keys and (scale-free) values, a frozen `layer_scalar` per layer,
full layers with their own head width and key/value heads (`global_head_dim`, `num_global_key_value_heads`,
or `per_layer_config` as transformers writes it) that may read values from the key projection
(`attention_k_eq_v`), per-layer inputs (`hidden_size_per_layer_input`, `vocab_size_per_layer_input`), keys
and values shared by the last `num_kv_shared_layers` layers (whose MLP `use_double_wide_mlp` doubles), and
the final logits capped (`final_logit_softcapping`). With `enable_moe_block` every layer runs
`num_experts` experts (`top_k_experts` per token, `moe_intermediate_size` wide) beside its dense MLP, routed
from the un-normed residual (`DecoderConfig.mixture` with Gemma 4's router norm and per-expert scale).
llama.cpp's gguf package
names Gemma 4's tensors, but Dew neither reads nor writes Gemma 4 GGUF files (the family has no `GGUFNames`, so
`write_gguf` and a GGUF load refuse it by name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.gemma4 import Gemma4Layers
from dew.nn.moe import Mixture
from dew.nn.transformer import FULL, SLIDING, DecoderConfig

MODEL_TYPE = "gemma4_text"
_KERNEL = (1, 0)
_LAYER = "model.layers.{layer}"
_PER_LAYER = "per_layer_inputs"

# transformers' Gemma4TextConfig fields and defaults.
FIELDS = {
    "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "sliding_window": 512, "layer_types": None,
    "final_logit_softcapping": None, "use_bidirectional_attention": None, "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "enable_moe_block": False, "use_double_wide_mlp": False, "num_experts": None, "top_k_experts": None,
    "moe_intermediate_size": None,
}
# What Gemma4TextConfig takes as keyword arguments without declaring them (the full layers' shape), with the
# defaults it falls back to.
UNDECLARED = {"global_head_dim": 512, "num_global_key_value_heads": None, "per_layer_config": None}
# transformers' rotary settings when the config names none.
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_MOE_FIELDS = ("num_experts", "top_k_experts", "moe_intermediate_size")

# The per-layer inputs' tensors and each layer's gate (Gemma 3n's too).
PER_LAYER_RULES = (
    Rule("layers/post_per_layer_input_norm/scale", f"{_LAYER}.post_per_layer_input_norm.weight"),
    *(Rule(f"layers/{name}/kernel", f"{_LAYER}.{name}.weight", transpose=_KERNEL)
      for name in ("per_layer_input_gate", "per_layer_projection")),
    Rule(f"{_PER_LAYER}/embed_tokens_per_layer/embedding", "model.embed_tokens_per_layer.weight"),
    Rule(f"{_PER_LAYER}/per_layer_model_projection/kernel", "model.per_layer_model_projection.weight",
         transpose=_KERNEL),
    Rule(f"{_PER_LAYER}/per_layer_projection_norm/scale", "model.per_layer_projection_norm.weight"),
)
_EXPERTS = "layers/experts/{}"
RULES = (
    *DECODER_RULES,
    *(Rule(f"layers/{norm}/scale", f"{_LAYER}.{norm}.weight")
      for norm in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")),
    Rule("layers/router/proj/kernel", f"{_LAYER}.router.proj.weight", transpose=_KERNEL),
    *(Rule(f"layers/router/{name}", f"{_LAYER}.router.{name}") for name in ("scale", "per_expert_scale")),
    # the experts' [E, 2F, D] gate-then-up and [E, D, F] down, as Dew's [E, D, F] and [E, F, D]
    Rule((_EXPERTS.format("gate_proj"), _EXPERTS.format("up_proj")), f"{_LAYER}.experts.gate_up_proj",
         transpose=(0, 2, 1), axis=2),
    Rule(_EXPERTS.format("down_proj"), f"{_LAYER}.experts.down_proj", transpose=(0, 2, 1)),
    Rule("layers/layer_scalar", f"{_LAYER}.layer_scalar"),
    *PER_LAYER_RULES,
)


def _five_to_one(source: Mapping, layers: int) -> list[str]:
    return [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]


@dataclasses.dataclass(frozen=True)
class Gemma4TextConverter(Converter):
    """`gemma4_text` (see the module)."""

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        source = dict(source)
        bidirectional = source.get("use_bidirectional_attention")
        if bidirectional == "all":
            raise ValueError(f"{where} field 'use_bidirectional_attention' = 'all' is not something Dew computes for "
                             f"{MODEL_TYPE}: every token reading every other (an encoder) is not built; None or "
                             "'vision' (which differ only over image tokens) read text causally")
        if bidirectional == "vision":  # image tokens only: a text decoder's mask is the causal one
            source["use_bidirectional_attention"] = None
        if source.get("rope_parameters") is None:  # transformers' own per-type default, not a flat one
            source["rope_parameters"] = DEFAULT_ROPE
        return super().decoder_kwargs(source, where)

    def layer_types(self, fields: ConfigFields, layers: int):
        window, types = super().layer_types(fields, layers)
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            fields.refuse("layer_types", types, f"name each of the {layers} layers {SLIDING!r} or {FULL!r}")
        if types[-1] != FULL:
            fields.refuse("layer_types", types, "transformers forces the last layer to full_attention; write it so")
        return window, types

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        kwargs["logit_softcap"] = fields.get("final_logit_softcapping")
        experts, top_k, expert_features = (fields.get(name) for name in _MOE_FIELDS)  # read with the block only
        if fields.get("enable_moe_block"):
            if not experts or not top_k or not expert_features or top_k > experts:
                fields.refuse("enable_moe_block", True, f"the experts' block needs num_experts ({experts}), "
                              f"top_k_experts ({top_k}, at most num_experts) and moe_intermediate_size "
                              f"({expert_features}): give the values the model was trained with")
            kwargs["mixture"] = Mixture(experts, top_k, expert_features, router_norm=True, expert_scale=True)
        layers = kwargs["num_layers"]
        types = kwargs.get("layer_types") or (FULL,) * layers
        full_head_dim, full_kv_heads = self._full_shape(fields, types, kwargs["head_dim"], kwargs["num_kv_heads"])
        width = fields.get("hidden_size_per_layer_input")
        vocab = fields.get("vocab_size_per_layer_input")
        if width and vocab < 1:
            fields.refuse("vocab_size_per_layer_input", vocab, "the per-layer table needs at least one row")
        try:
            kwargs["gemma4"] = Gemma4Layers(
                full_head_dim=full_head_dim, full_kv_heads=full_kv_heads, keys_as_values=bool(fields.get(
                    "attention_k_eq_v")), per_layer_width=width or 0, per_layer_vocab=vocab if width else None,
                kv_shared_layers=fields.get("num_kv_shared_layers"),
                double_wide_mlp=bool(fields.get("use_double_wide_mlp")))
            kwargs["gemma4"].kv_roles(tuple(types))
        except ValueError as error:
            fields.refuse("num_kv_shared_layers", fields.get("num_kv_shared_layers"), str(error))

    def _full_shape(self, fields: ConfigFields, types, head_dim: int, kv_heads: int) -> tuple[int, int]:
        """The full layers' head width and key/value heads: `per_layer_config` as transformers writes it (the
        full layers' overrides), else `global_head_dim` and, with `attention_k_eq_v`,
        `num_global_key_value_heads`."""
        overrides = fields.get("per_layer_config")
        global_head_dim, global_kv = fields.get("global_head_dim"), fields.get("num_global_key_value_heads")
        if overrides is None:
            full = {"head_dim": global_head_dim}
            if global_kv is not None and fields.get("attention_k_eq_v"):
                full["num_key_value_heads"] = global_kv
            overrides = {str(i): full for i, kind in enumerate(types) if kind == FULL}
        try:  # transformers writes the layer numbers as strings, zero-padded past 9 layers ("05")
            by_layer = {int(layer): dict(override) for layer, override in overrides.items()}
        except (AttributeError, TypeError, ValueError):
            fields.refuse("per_layer_config", overrides, "give an object of layer number to overrides")
        shapes = {}
        for i, kind in enumerate(types):
            override = by_layer.get(i, {})
            unknown = sorted(set(override) - {"head_dim", "num_key_value_heads"})
            if unknown:
                fields.refuse("per_layer_config", overrides, f"layer {i} overrides {unknown}; Dew reads head_dim and "
                              "num_key_value_heads per layer")
            shapes[i] = (kind, override.get("head_dim", head_dim), override.get("num_key_value_heads", kv_heads))
        full = {(dim, kv) for kind, dim, kv in shapes.values() if kind == FULL}
        sliding = {(dim, kv) for kind, dim, kv in shapes.values() if kind == SLIDING}
        if len(full) > 1 or sliding - {(head_dim, kv_heads)}:
            fields.refuse("per_layer_config", overrides, "Dew builds Gemma 4 with one head width and key/value head "
                          "count for every full layer and the config's own for sliding layers")
        return next(iter(full)) if full else (head_dim, kv_heads)

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        written = super().written(config)
        g, m = config.gemma4 or Gemma4Layers(), config.mixture
        if m is not None:
            written.update(enable_moe_block=True, num_experts=m.experts, top_k_experts=m.top_k,
                           moe_intermediate_size=m.expert_features or config.mlp_features)
        full_dim, full_kv = g.full_head_dim or config.head_dim, g.full_kv_heads or config.num_kv_heads
        written.update(
            final_logit_softcapping=config.logit_softcap, attention_k_eq_v=g.keys_as_values,
            hidden_size_per_layer_input=g.per_layer_width,
            vocab_size_per_layer_input=g.per_layer_vocab or config.vocab_size,
            num_kv_shared_layers=g.kv_shared_layers, use_double_wide_mlp=g.double_wide_mlp,
            per_layer_config={str(i): {"head_dim": full_dim, "num_key_value_heads": full_kv}
                              for i, kind in enumerate(written["layer_types"]) if kind == FULL},
        )
        return written


GEMMA4_TEXT = Gemma4TextConverter(
    MODEL_TYPE, "Gemma4TextConfig", "Gemma4ForCausalLM", FIELDS, RULES,
    dict(norm_style="olmo", norm_placement="sandwich", scale_embeddings=True, qk_norm=True, query_scale=1.0),
    window="layer_types", default_pattern=_five_to_one, rope_thetas=(1_000_000.0, 10_000.0),
    activation_field="hidden_activation", rope_by_layer_type=True, getattr_fields=UNDECLARED,
    field_kinds={"use_bidirectional_attention": "attention scope?", "num_experts": "count?"},
)
