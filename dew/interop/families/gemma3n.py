"""Gemma 3n's text decoder (`model_type` "gemma3n_text", transformers' `Gemma3nForCausalLM`).

Gemma 3's sandwich block (sliding and full layers, by default four sliding then one full; a rotary setting per
layer type) with Gemma 3n's changes, read into `DecoderConfig.gemma3n` (`dew.nn.gemma3n.Gemma3nLayers`): norms
that multiply by their weight ("olmo" norms), unscaled scores over RMS-normed queries, keys and (scale-free)
values, AltUp's `altup_num_inputs` residual streams (`altup_active_idx`, `altup_coef_clip`,
`altup_correct_scale`), LAuReL beside attention (`laurel_rank`), per-layer inputs (`hidden_size_per_layer_input`,
`vocab_size_per_layer_input`, as Gemma 4's), keys and values shared by the last `num_kv_shared_layers` layers (as
Gemma 4's), each layer's gate sparsity (`activation_sparsity_pattern`) and the final logits capped
(`final_logit_softcapping`). Dew builds one MLP width for every layer (`intermediate_size` as one number or a
list of equal ones). The multimodal Gemma 3n (`gemma3n`) sits on this decoder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.gemma4 import PER_LAYER_RULES
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.gemma3n import Gemma3nLayers
from dew.nn.transformer import FULL, SLIDING, DecoderConfig

MODEL_TYPE = "gemma3n_text"
_KERNEL = (1, 0)
_LAYER = "model.layers.{layer}"
_ALTUP_MAPS = ("altup_projections", "altup_unembed_projections")

# transformers' Gemma3nTextConfig fields and defaults.
FIELDS = {
    "vocab_size": 262400, "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 35,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "sliding_window": 512, "layer_types": None,
    "final_logit_softcapping": 30.0, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
    "altup_active_idx": 0, "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_num_inputs": 4,
    "num_kv_shared_layers": 15, "laurel_rank": 64, "activation_sparsity_pattern": None,
}
# transformers' own sparsity when the config names none: the first ten layers of a deeper model at 0.95.
_SPARSE_LAYERS, _DEFAULT_SPARSITY = 10, 0.95

RULES = (
    *DECODER_RULES,
    *PER_LAYER_RULES,
    *(Rule(f"layers/altup/{name}/kernel", f"{_LAYER}.altup.{name}.weight", transpose=_KERNEL)
      for name in ("prediction_coefs", "correction_coefs", "modality_router")),
    Rule("layers/altup/router_norm/scale", f"{_LAYER}.altup.router_norm.weight"),
    Rule("layers/altup/correct_output_scale", f"{_LAYER}.altup.correct_output_scale"),
    *(Rule(f"layers/laurel/{name}/kernel", f"{_LAYER}.laurel.{name}.weight", transpose=_KERNEL)
      for name in ("linear_left", "linear_right")),
    Rule("layers/laurel/post_laurel_norm/scale", f"{_LAYER}.laurel.post_laurel_norm.weight"),
)


def _four_to_one(source: Mapping, layers: int) -> list[str]:
    return [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(layers)]


def _default_sparsity(layers: int) -> list[float]:
    sparse = _SPARSE_LAYERS if layers > _SPARSE_LAYERS else 0
    return [_DEFAULT_SPARSITY] * sparse + [0.0] * (layers - sparse)


@dataclasses.dataclass(frozen=True)
class Gemma3nTextConverter(Converter):
    """`gemma3n_text` (see the module)."""

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        widths = source.get("intermediate_size")
        if isinstance(widths, list):  # transformers' own spelling: one width per layer
            if not widths or len(set(widths)) != 1 or not isinstance(widths[0], int) or isinstance(widths[0], bool):
                raise ValueError(f"{where} field 'intermediate_size' = {widths!r} is not something Dew computes for "
                                 f"{MODEL_TYPE}: Dew builds one MLP width for every layer; give one number")
            layers = source.get("num_hidden_layers")
            if isinstance(layers, int) and len(widths) != layers:
                raise ValueError(f"{where} field 'intermediate_size' = {widths!r} names {len(widths)} layers but "
                                 f"num_hidden_layers is {layers}: give one width per layer, or one for all")
            source = {**source, "intermediate_size": widths[0]}
        return super().decoder_kwargs(source, where)

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        kwargs["logit_softcap"] = fields.get("final_logit_softcapping")
        layers = kwargs["num_layers"]
        sparsity = fields.get("activation_sparsity_pattern")
        if sparsity is None:
            sparsity = _default_sparsity(layers)
        if not isinstance(sparsity, list) or len(sparsity) != layers or not all(0.0 <= s < 1.0 for s in sparsity):
            fields.refuse("activation_sparsity_pattern", sparsity, f"transformers reads one fraction in [0, 1) per "
                          f"layer: give a list of {layers}")
        width = fields.get("hidden_size_per_layer_input")
        if not width:
            fields.refuse("hidden_size_per_layer_input", width, "Gemma 3n's layers always read per-layer inputs: "
                          "give their width")
        inputs, active = fields.get("altup_num_inputs"), fields.get("altup_active_idx")
        if active >= inputs:
            fields.refuse("altup_active_idx", active, f"it numbers one of the altup_num_inputs {inputs} streams, "
                          f"0 to {inputs - 1}")
        clip = fields.get("altup_coef_clip")
        if not clip > 0:
            fields.refuse("altup_coef_clip", clip, "it bounds AltUp's coefficients in training: give a size above 0")
        options = Gemma3nLayers(
            altup_inputs=inputs, altup_active=active, altup_clip=clip,
            altup_scale_output=fields.get("altup_correct_scale"), laurel_rank=fields.get("laurel_rank"),
            per_layer_width=width, per_layer_vocab=fields.get("vocab_size_per_layer_input"),
            kv_shared_layers=fields.get("num_kv_shared_layers"), sparsity=tuple(sparsity))
        try:
            options.kv_roles(tuple(kwargs.get("layer_types") or (FULL,) * layers))
        except ValueError as error:
            fields.refuse("num_kv_shared_layers", options.kv_shared_layers, str(error))
        kwargs["gemma3n"] = options

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        written = super().written(config)
        g = config.gemma3n or Gemma3nLayers()
        written.update(
            final_logit_softcapping=config.logit_softcap, hidden_size_per_layer_input=g.per_layer_width,
            vocab_size_per_layer_input=g.per_layer_vocab or config.vocab_size, num_kv_shared_layers=g.kv_shared_layers,
            altup_num_inputs=g.altup_inputs, altup_active_idx=g.altup_active, altup_coef_clip=g.altup_clip,
            altup_correct_scale=g.altup_scale_output, laurel_rank=g.laurel_rank,
            activation_sparsity_pattern=list(g.layer_sparsity(config.num_layers)),
        )
        return written

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        streams = (config.gemma3n or Gemma3nLayers()).altup_inputs
        return (*self.rules, *(Rule(f"{name}_{i}/kernel", f"model.{name}.{i}.weight", transpose=_KERNEL)
                               for name in _ALTUP_MAPS for i in range(streams - 1)))


GEMMA3N_TEXT = Gemma3nTextConverter(
    MODEL_TYPE, "Gemma3nTextConfig", "Gemma3nForCausalLM", FIELDS, RULES,
    dict(norm_style="olmo", norm_placement="sandwich", scale_embeddings=True, qk_norm=True, query_scale=1.0),
    window="layer_types", default_pattern=_four_to_one, rope_thetas=(1_000_000.0, 10_000.0),
    activation_field="hidden_activation", rope_by_layer_type=True, sliding_theta_field="rope_local_base_freq",
    legacy_fields=frozenset({"rope_local_base_freq"}),
    field_kinds={"intermediate_size": "size or sizes"},
)
