"""Llama 4's text decoder (`model_type` "llama4_text", transformers' `Llama4ForCausalLM`).

The Llama block with four changes, each a layer spec knob:
- every `no_rope_layer_interval`-th layer (`no_rope_layers` 0) rotates nothing (`DecoderConfig.nope`):
  its queries take a temperature rising with the position (`attn_temperature_tuning`, `floor_scale`,
  `attn_scale`), and it attends to every earlier key; the others attend within chunks of
  `attention_chunk_size` positions (`layer_types` "chunked_attention") and, with `use_qk_norm`, divide
  their rotated queries and keys by their rms, with no scale (`qk_norm_scope` "l2");
- the layers `moe_layers` (else every `interleave_moe_layer_step`-th) route each token to its top
  `num_experts_per_tok` of `num_local_experts` experts of width `intermediate_size` by the sigmoid of the
  router's logit, the expert reading its token times that weight (`Mixture.weighted_inputs`), beside a
  shared expert of the same width; the other layers' MLP is `intermediate_size_mlp` wide.

transformers rotates each head's features in adjacent pairs (complex numbers); Dew rotates its two
halves. The query and key rows are permuted per head at load (the pairs' first members to the first
half) and back at save, which changes no score: queries and keys move together, and the rms norm and
temperature do not see the order.

Checkpoint names: `feed_forward.{gate,up,down}_proj` (dense), `feed_forward.router`,
`feed_forward.experts.gate_up_proj` `[E, D, 2F]` (gate first) and `down_proj` `[E, F, D]`, and
`feed_forward.shared_expert.*`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.attention import NoPE
from dew.nn.moe import Mixture
from dew.nn.transformer import CHUNKED, FULL, DecoderConfig

MODEL_TYPE = "llama4_text"
_KERNEL = (1, 0)  # [out, in] in the checkpoint, [in, out] in Dew
_LAYER = "model.layers.{layer}"
_FEED_FORWARD = f"{_LAYER}.feed_forward"
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_ROTATED = ("q_proj", "k_proj")

# transformers' Llama4TextConfig fields and defaults.
FIELDS = {
    "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
    "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "attention_dropout": 0.0, "num_experts_per_tok": 1, "num_local_experts": 16, "moe_layers": None,
    "interleave_moe_layer_step": 1, "use_qk_norm": True, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "rope_parameters": None, "no_rope_layers": None,
    "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "layer_types": None, "attn_temperature_tuning": True,
    "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
}


def _rules(heads: int, kv_heads: int) -> tuple[Rule, ...]:
    rotated = {f"layers/self_attn/{proj}/{leaf}" for proj in _ROTATED for leaf in ("kernel", "bias")}
    block = [rule for rule in DECODER_RULES if not set(rule.dew) & rotated and "/mlp/" not in rule.dew[0]]
    for proj, count in zip(_ROTATED, (heads, kv_heads)):
        block += [Rule(f"layers/self_attn/{proj}/kernel", f"{_LAYER}.self_attn.{proj}.weight", transpose=_KERNEL,
                       permute=count),
                  Rule(f"layers/self_attn/{proj}/bias", f"{_LAYER}.self_attn.{proj}.bias", permute=count)]
    experts = "layers/mlp/experts/{}/kernel"
    return (
        *block,
        *(Rule(f"layers/mlp/{proj}/kernel", f"{_FEED_FORWARD}.{proj}.weight", transpose=_KERNEL) for proj in _PROJECTIONS),
        Rule("layers/mlp/gate/kernel", f"{_FEED_FORWARD}.router.weight", transpose=_KERNEL),
        Rule((experts.format("gate_proj"), experts.format("up_proj")), f"{_FEED_FORWARD}.experts.gate_up_proj", axis=2),
        Rule(experts.format("down_proj"), f"{_FEED_FORWARD}.experts.down_proj"),
        *(Rule(f"layers/mlp/shared_experts/{proj}/kernel", f"{_FEED_FORWARD}.shared_expert.{proj}.weight",
               transpose=_KERNEL) for proj in _PROJECTIONS),
    )


@dataclasses.dataclass(frozen=True)
class Llama4TextConverter(Converter):
    """`llama4_text` (see the module)."""

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        layers = kwargs["num_layers"]
        expert_width = kwargs["mlp_features"]  # intermediate_size: the experts' and the shared expert's
        kwargs["mlp_features"] = fields.get("intermediate_size_mlp")
        for name in ("output_router_logits", "router_aux_loss_coef", "router_jitter_noise"):
            fields.get(name)  # transformers' own training loss, and a jitter Llama 4's router never applies
        step, listed = fields.get("interleave_moe_layer_step"), fields.get("moe_layers")
        sparse = list(listed) if listed is not None else list(range(step - 1, layers, step))
        if sparse:
            experts, top_k = fields.get("num_local_experts"), fields.get("num_experts_per_tok")
            if experts < 1 or top_k is None or not 1 <= top_k <= experts:
                fields.refuse("num_experts_per_tok", top_k, f"a token picks between 1 and the {experts} experts there "
                              "are (num_local_experts); set both to what the model was trained with")
            kwargs["mixture"] = Mixture(experts, top_k, expert_features=expert_width, layers=tuple(sparse),
                                        score_function="sigmoid", norm_topk_prob=False, shared_features=expert_width,
                                        weighted_inputs=True)
        else:
            fields.get("num_local_experts"), fields.get("num_experts_per_tok")

        interval, rotated = fields.get("no_rope_layer_interval"), fields.get("no_rope_layers")
        if not rotated:  # transformers: a NoPE layer every `interval` layers where the list is empty or absent
            rotated = [int((i + 1) % interval != 0) for i in range(layers)]
        if len(rotated) < layers:
            fields.refuse("no_rope_layers", rotated, f"give one 1 (rotary) or 0 (NoPE) for each of the {layers} layers")
        unrotated = tuple(i for i in range(layers) if not rotated[i])
        tuning, floor_scale, attn_scale = (fields.get(name) for name in ("attn_temperature_tuning", "floor_scale",
                                                                         "attn_scale"))
        if unrotated:
            kwargs["nope"] = NoPE(unrotated, floor_scale if tuning else None, attn_scale)
        kwargs["qk_norm"] = bool(fields.get("use_qk_norm"))
        kwargs["qk_norm_scope"] = "l2"

        chunk = fields.get("attention_chunk_size")
        layer_types = fields.get("layer_types") or [CHUNKED if rotated[i] and chunk is not None else FULL
                                                    for i in range(layers)]
        if len(layer_types) != layers or set(layer_types) - {CHUNKED, FULL}:
            fields.refuse("layer_types", layer_types, f"name each of the {layers} layers {CHUNKED!r} or {FULL!r}")
        if CHUNKED in layer_types:
            if chunk is None:
                fields.refuse("attention_chunk_size", chunk, f"layer_types names {CHUNKED!r} layers, which attend "
                              "within chunks of that many positions: give the chunk the model was trained with")
            kwargs.update(layer_types=tuple(layer_types), attention_chunk_size=chunk)

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        c, m = config, config.mixture
        written = super().written(c)
        nope = c.nope.layers if c.nope is not None else ()
        temperature = None if c.nope is None else c.nope.temperature()
        written.update(
            intermediate_size=m.expert_features or c.mlp_features if m is not None else c.mlp_features,
            intermediate_size_mlp=c.mlp_features, num_local_experts=m.experts if m is not None else 1,
            num_experts_per_tok=m.top_k if m is not None else 1, moe_layers=list(c.sparse_layers),
            interleave_moe_layer_step=1, use_qk_norm=c.qk_norm,
            no_rope_layers=[0 if i in nope else 1 for i in range(c.num_layers)],
            attention_chunk_size=c.attention_chunk_size,
            layer_types=[CHUNKED if c.layer_chunk(i) is not None else FULL for i in range(c.num_layers)],
            attn_temperature_tuning=temperature is not None,
        )
        if temperature is not None:
            written.update(floor_scale=c.nope.floor_scale, attn_scale=c.nope.attn_scale)
        return written

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        return _rules(config.num_heads, config.num_kv_heads)

    def gguf_rules(self, config: DecoderConfig) -> tuple[Rule, ...]:
        raise ValueError("Dew reads no GGUF files of llama4_text: load its safetensors checkpoint")


LLAMA4_TEXT = Llama4TextConverter(MODEL_TYPE, "Llama4TextConfig", "Llama4ForCausalLM", FIELDS, _rules(1, 1),
                                  rope_thetas=(500000.0, 500000.0))
