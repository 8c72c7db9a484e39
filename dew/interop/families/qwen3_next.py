"""Qwen3-Next and Qwen 3.5's text decoder: hybrid stacks of Gated DeltaNet layers ("linear_attention",
`dew.nn.gated_deltanet`) and gated attention layers ("full_attention"), by `layer_types` (by default
three linear layers, then one full, from `full_attention_interval`).

Their attention is Qwen 3's with an output gate (`q_proj` doubled, `DecoderConfig.attn_output_gate`)
and a partial rotary (`partial_rotary_factor`, default 0.25: the first quarter of each head turns); every
RMSNorm but the mixer's gated one scales by `1 + weight` ("gemma" norms). Qwen3-Next's feed-forward
is Qwen2-MoE's (experts, a shared expert with a sigmoid gate, `decoder_sparse_step`, `mlp_only_layers`);
Qwen 3.5's text decoder is dense (Qwen 3.5-MoE's routes every layer's tokens as Qwen3-Next's do), and its rotary reads three-axis positions (`mrope_section`, interleaved;
`dew.nn.rotary.RopeScaling`), which its multimodal family computes around each image.

A linear layer's projections are one Dew kernel, `self_attn/in_proj`, holding the queries, keys,
values, the gate `z`, then `b` and `a`. Qwen3-Next stores them in two tensors grouped per key head
(`linear_attn.in_proj_qkvz`: per key head its query, key, values and gates; `in_proj_ba`), Qwen 3.5 in
four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Checkpoints' multi-token-prediction
tensors (`mtp.*`) are dropped, as transformers drops them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from dew.interop.families.converter import Converter
from dew.interop.families.experts import MixtureConverter, hub_rules
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.gated_deltanet import GatedDeltaNet
from dew.nn.transformer import FULL, LINEAR, DecoderConfig

_KERNEL = (1, 0)
_LINEAR = "model.layers.{layer}.linear_attn"
_MIXER = "layers/self_attn"
# The fields of a linear layer's shape and the `GatedDeltaNet` field each gives.
_SHAPE_FIELDS = {"linear_num_key_heads": "key_heads", "linear_num_value_heads": "value_heads",
                 "linear_key_head_dim": "key_head_dim", "linear_value_head_dim": "value_head_dim",
                 "linear_conv_kernel_dim": "conv_kernel"}
_COMMON = {
    "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
    "use_cache": True, "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
    "attention_dropout": 0.0, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "layer_types": None,
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}
# transformers' Qwen3NextConfig and Qwen3_5TextConfig fields and defaults.
_QWEN3_NEXT_FIELDS = {
    **_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True,
    "output_router_logits": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None,
}
_QWEN3_5_TEXT_FIELDS = {
    **_COMMON, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4,
}
# transformers' Qwen3_5MoeTextConfig: Qwen 3.5's fields with every layer's feed-forward Qwen3-Next's experts
_QWEN3_5_MOE_TEXT_FIELDS = {
    **{name: value for name, value in _QWEN3_5_TEXT_FIELDS.items() if name != "intermediate_size"}, "hidden_size": 2048,
    "num_hidden_layers": 40, "num_key_value_heads": 2, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "output_router_logits": False, "router_aux_loss_coef": 0.001,
}
# The three-axis rotary's keys Qwen 3.5 keeps in rope_parameters. transformers' Qwen 3.5 always interleaves
# the axes (whatever mrope_interleaved says) with these sections by default; Qwen3-Next's rotary has one axis
# and ignores them, as text positions (equal on the three axes) would anyway.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_QWEN3_5_SECTION = (11, 11, 10)
_KNOBS = dict(norm_style="gemma", qk_norm=True, attn_output_gate=True)


def linear_rules(shape: GatedDeltaNet, fused: bool) -> tuple[Rule, ...]:
    """The rules of a linear layer's mixer: Qwen3-Next's two projections grouped per key head (`fused`),
    or Qwen 3.5's four."""
    s = shape
    if fused:
        qkvz, ba = f"{_LINEAR}.in_proj_qkvz.weight", f"{_LINEAR}.in_proj_ba.weight"
        projections = Rule(f"{_MIXER}/in_proj/kernel", (qkvz,) * 4 + (ba,) * 2, transpose=_KERNEL, axis=1,
                           sizes=(s.key_dim, s.key_dim, s.value_dim, s.value_dim, s.value_heads, s.value_heads),
                           groups=s.key_heads)
    else:
        projections = Rule(f"{_MIXER}/in_proj/kernel", tuple(f"{_LINEAR}.in_proj_{part}.weight"
                                                             for part in ("qkv", "z", "b", "a")),
                           transpose=_KERNEL, axis=1, sizes=(s.conv_dim, s.value_dim, s.value_heads, s.value_heads))
    return (projections, Rule(f"{_MIXER}/conv1d/kernel", f"{_LINEAR}.conv1d.weight"),
            *(Rule(f"{_MIXER}/{name}", f"{_LINEAR}.{name}") for name in ("A_log", "dt_bias")),
            Rule(f"{_MIXER}/norm/scale", f"{_LINEAR}.norm.weight"),
            Rule(f"{_MIXER}/out_proj/kernel", f"{_LINEAR}.out_proj.weight", transpose=_KERNEL))


class _Hybrid:
    """What both families add to their base converter: the layer types, the linear layers' shape and
    tensors, the multimodal rotary keys and the tensors transformers drops."""

    FUSED: ClassVar[bool]
    DROPPED: ClassVar[tuple[str, ...]]
    THREE_AXIS: ClassVar[bool]

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        rope = source.get("rope_parameters")
        section = _QWEN3_5_SECTION
        if isinstance(rope, Mapping) and any(key in rope for key in _MROPE_KEYS):
            section = tuple(rope.get("mrope_section") or section)
            source = {**source, "rope_parameters": {k: v for k, v in rope.items() if k not in _MROPE_KEYS}}
        kwargs = super().decoder_kwargs(source, where)
        if self.THREE_AXIS:
            try:
                kwargs["rope_scaling"] = dataclasses.replace(kwargs["rope_scaling"], mrope_section=section,
                                                             mrope_interleaved=True)
            except ValueError as error:
                raise ValueError(f"{where}: rope_parameters mrope_section {list(section)}: {error}") from None
        return kwargs

    def layer_types(self, fields: ConfigFields, layers: int):
        return None, None  # no layer slides; the linear ones are read with the family's fields

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        super().read_family_fields(fields, kwargs)
        layers = kwargs["num_layers"]
        interval = fields.source.get("full_attention_interval", 4)  # transformers' older spelling of the pattern
        types = fields.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
        if len(types) != layers or not set(types) <= {LINEAR, FULL}:
            fields.refuse("layer_types", types, f"one {LINEAR!r} or {FULL!r} per layer ({layers} layers)")
        try:
            shape = GatedDeltaNet(**{ours: fields.get(theirs) for theirs, ours in _SHAPE_FIELDS.items()})
        except ValueError as error:
            fields.refuse("linear_num_value_heads", fields.get("linear_num_value_heads"), str(error))
        if LINEAR in types:
            fields.require("hidden_act", ("silu", "swish"), "the linear layers' convolution Dew computes is silu")
            kwargs.update(layer_types=tuple(types), recurrent=shape)

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        written = super().written(config)
        shape = config.recurrent if isinstance(config.recurrent, GatedDeltaNet) else GatedDeltaNet()
        written.update({theirs: getattr(shape, ours) for theirs, ours in _SHAPE_FIELDS.items()})
        written["layer_types"] = [LINEAR if config.layer_types and config.layer_types[i] == LINEAR else FULL
                                  for i in range(config.num_layers)]
        if config.rope_scaling.kind == "default":  # the family's own default is 0.25: say even 1.0
            written["rope_parameters"]["partial_rotary_factor"] = config.rope_scaling.rotated_fraction
        if self.THREE_AXIS and config.rope_scaling.mrope_section is not None:
            written["rope_parameters"].update(mrope_section=list(config.rope_scaling.mrope_section),
                                              mrope_interleaved=True)
        return written

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        rules = super().tensor_rules(config, names)
        if isinstance(config.recurrent, GatedDeltaNet):
            rules = (*rules, *linear_rules(config.recurrent, self.FUSED))
        return rules

    def ignorable(self, name: str, config: DecoderConfig) -> bool:
        return name.startswith(self.DROPPED) or super().ignorable(name, config)


class Qwen3NextConverter(_Hybrid, MixtureConverter):
    """Qwen3-Next (see the module)."""

    FUSED = True
    DROPPED = ("mtp.",)
    THREE_AXIS = False


class Qwen35TextConverter(_Hybrid, Converter):
    """Qwen 3.5's text decoder (see the module)."""

    FUSED = False
    DROPPED = ("mtp.", "model.visual.")
    THREE_AXIS = True


class Qwen35MoeTextConverter(_Hybrid, MixtureConverter):
    """Qwen 3.5-MoE's text decoder: Qwen 3.5's, every feed-forward routed to experts beside a gated shared one."""

    FUSED = False
    DROPPED = ("mtp.", "model.visual.")
    THREE_AXIS = True

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        kwargs = super().decoder_kwargs(source, where)
        # its config has no dense width (every layer routes): Dew's, which no layer reads, is the experts'
        kwargs["mlp_features"] = kwargs["mixture"].expert_features
        return kwargs

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        written = super().written(config)
        written.pop("intermediate_size", None)
        return written


QWEN3_NEXT = Qwen3NextConverter("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", _QWEN3_NEXT_FIELDS,
                                hub_rules(shared=True), _KNOBS, legacy_fields=frozenset({"full_attention_interval"}),
                                partial_rotary=0.25)
QWEN3_5_TEXT = Qwen35TextConverter("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN3_5_TEXT_FIELDS,
                                   DECODER_RULES, _KNOBS, legacy_fields=frozenset({"full_attention_interval"}),
                                   partial_rotary=0.25)
QWEN3_5_MOE_TEXT = Qwen35MoeTextConverter("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                                          _QWEN3_5_MOE_TEXT_FIELDS, hub_rules(shared=True), _KNOBS,
                                          legacy_fields=frozenset({"full_attention_interval"}), partial_rotary=0.25)
