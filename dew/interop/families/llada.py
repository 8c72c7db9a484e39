"""LLaDA (GSAI-ML/LLaDA-8B-Base and -Instruct): a masked-diffusion language model whose block is Llama's,
attending in both directions, in OLMo's configuration and tensor names.

Its config.json is the remote code's `LLaDAConfig` (model_type "llada"), OLMo's field names
(`d_model`, `n_heads`, `mlp_hidden_size`, ...) with `block_type` "llama", RMS norms, rotary positions
and a `mask_token_id`; its tensors live under `model.transformer.` (`wte`, `blocks.N.q_proj`,
`attn_out`, `ff_proj` the gate, `up_proj`, `ff_out` the down projection, `ln_f`, and `ff_out` the head).
transformers has no class for it. The checkpoint loads as a bidirectional `CausalTransformer`;
`process(config)` is the native MDLM process over its mask id (LLaDA predicts each position from its
own state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dew.diffusion.discrete import DiscreteProcess
from dew.interop.families.converter import Converter
from dew.interop.hf_decoders import ConfigFields, rope_parameters
from dew.interop.tensors import Rule
from dew.nn.rotary import RopeScaling
from dew.nn.transformer import DecoderConfig

_KERNEL = (1, 0)  # stored [out, in], as Dew's [in, out] kernels
_BLOCK = "model.transformer.blocks.{layer}"
_PROJECTIONS = (("self_attn/q_proj", "q_proj"), ("self_attn/k_proj", "k_proj"), ("self_attn/v_proj", "v_proj"),
                ("self_attn/o_proj", "attn_out"), ("mlp/gate_proj", "ff_proj"), ("mlp/up_proj", "up_proj"),
                ("mlp/down_proj", "ff_out"))
_RULES = (
    Rule("embed_tokens/embedding", "model.transformer.wte.weight"),
    Rule("layers/input_layernorm/scale", f"{_BLOCK}.attn_norm.weight"),
    Rule("layers/post_attention_layernorm/scale", f"{_BLOCK}.ff_norm.weight"),
    *(Rule(f"layers/{ours}/kernel", f"{_BLOCK}.{theirs}.weight", transpose=_KERNEL) for ours, theirs in _PROJECTIONS),
    *(Rule(f"layers/self_attn/{name}/bias", f"{_BLOCK}.{name}.bias") for name in ("q_proj", "k_proj", "v_proj")),
    Rule("norm/scale", "model.transformer.ln_f.weight"),
    Rule("lm_head/kernel", "model.transformer.ff_out.weight", transpose=_KERNEL),
)
_HEAD = "model.transformer.ff_out.weight"

# The remote code's `ModelConfig` fields and their defaults (configuration_llada.py, OLMo's).
_FIELDS = {
    "d_model": 768, "n_heads": 12, "n_kv_heads": None, "n_layers": 12, "mlp_ratio": 4, "mlp_hidden_size": None,
    "activation_type": "swiglu", "block_type": "sequential", "block_group_size": 1, "alibi": False,
    "alibi_bias_max": 8.0, "rope": False, "rope_full_precision": True, "rope_theta": 10000.0,
    "flash_attention": False, "attention_dropout": 0.1, "multi_query_attention": None,
    "attention_layer_norm": False, "residual_dropout": 0.1, "embedding_dropout": 0.1, "input_emb_norm": False,
    "layer_norm_type": "default", "layer_norm_with_affine": True, "rms_norm_eps": 1e-5,
    "attention_layer_norm_with_affine": True, "max_sequence_length": 1024, "include_qkv_bias": False,
    "include_bias": False, "bias_for_layer_norm": None, "scale_logits": False, "vocab_size": 50257,
    "embedding_size": 50304, "weight_tying": True, "eos_token_id": 50256, "pad_token_id": 50256,
    "mask_token_id": 50256, "init_device": None, "init_fn": "normal", "init_std": 0.02,
    "init_cutoff_factor": None, "precision": None, "use_cache": False,
}
# Fields that say how the weights were made or where they run, not what the model computes.
_NO_EFFECT = ("block_group_size", "flash_attention", "init_device", "init_fn", "init_std", "init_cutoff_factor",
              "precision", "alibi_bias_max", "attention_layer_norm_with_affine", "eos_token_id", "pad_token_id",
              "use_cache")
# What the loaded block computes, each field with the value it needs and why another is refused.
_REQUIRED = {
    "block_type": ("llama", "Dew loads LLaDA's Llama block (separate q/k/v and up projections)"),
    "activation_type": ("silu", "LLaDA's Llama block gates with SiLU"),
    "layer_norm_type": ("rms", "Dew's norms are RMS norms"),
    "layer_norm_with_affine": (True, "Dew's norms have a scale"),
    "rope": (True, "Dew's attention rotates its queries and keys"),
    "alibi": (False, "ALiBi is not built in Dew"),
    "rope_full_precision": (True, "Dew rotates in float32"),
    "attention_layer_norm": (False, "LLaDA's query/key norms are not built in Dew"),
    "input_emb_norm": (False, "Dew does not scale LLaDA's embeddings"),
    "scale_logits": (False, "Dew does not scale LLaDA's logits"),
    "include_bias": (False, "LLaDA's biases on every projection and on the head are not built in Dew"),
    "residual_dropout": (0.0, "Dew applies no dropout, so training would not be the training that rate asks for"),
    "embedding_dropout": (0.0, "Dew applies no dropout, so training would not be the training that rate asks for"),
}


@dataclasses.dataclass(frozen=True)
class MaskedDiffusionConverter(Converter):
    """A masked-diffusion family: its checkpoints load as bidirectional decoders, and `process(config)` is
    native MDLM over the config's `mask_token_id`, each position predicted from the state `logits_shift`
    positions before it. A bare `DecoderConfig` holds no mask id, so `family_for` never writes one."""

    logits_shift: int = 0

    def process(self, source: Mapping[str, Any]) -> DiscreteProcess:
        """Native MDLM over the checkpoint's mask id (its default sampler: 64 steps)."""
        mask_id = source.get("mask_token_id")
        if mask_id is None:
            raise ValueError(f"this {self.model_type} config.json names no mask_token_id: set it to the id the model "
                             "was trained to unmask")
        return DiscreteProcess(mask_id, logits_shift=self.logits_shift)

    def differences(self, config: DecoderConfig) -> list[str]:
        return ["no mask id (a masked-diffusion checkpoint needs one, and a DecoderConfig holds none)",
                *super().differences(config)]


class LLaDAConverter(MaskedDiffusionConverter):
    """LLaDA's config.json and tensor names (see the module)."""

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        fields = ConfigFields(source, self, where)
        for name, (value, why) in _REQUIRED.items():
            if fields.get(name) != value:
                fields.refuse(name, fields.get(name), f"{why}; Dew loads {name} {value!r}")
        if fields.get("bias_for_layer_norm"):
            fields.refuse("bias_for_layer_norm", True, "Dew's norms have no bias")
        for name in (*_NO_EFFECT, "mask_token_id", "is_causal"):
            fields.get(name)
        if "is_causal" in source:
            fields.refuse("is_causal", source["is_causal"], "LLaDA's code never reads it (its attention always sees "
                          "both directions): remove it")
        d_model, heads = fields.get("d_model"), fields.get("n_heads")
        kv_heads = fields.get("n_kv_heads")
        multi_query = fields.get("multi_query_attention")
        if kv_heads is None:
            kv_heads = 1 if multi_query else heads
        elif multi_query is not None and kv_heads != (1 if multi_query else heads):
            fields.refuse("multi_query_attention", multi_query, f"it contradicts n_kv_heads {kv_heads}, as LLaDA's "
                          "code refuses too; drop one of them")
        mlp_ratio, hidden = fields.get("mlp_ratio"), fields.get("mlp_hidden_size")
        vocab, embedding = fields.get("vocab_size"), fields.get("embedding_size")
        kwargs = dict(
            self.knobs, vocab_size=embedding or vocab, emb_features=d_model, num_layers=fields.get("n_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=d_model // heads,
            mlp_features=hidden if hidden is not None else mlp_ratio * d_model,
            max_seq_len=fields.get("max_sequence_length"), norm_eps=fields.get("rms_norm_eps"),
            tie_embeddings=bool(fields.get("weight_tying")), qkv_bias=bool(fields.get("include_qkv_bias")),
            rope_theta=float(fields.get("rope_theta")),
            # a training-only rate: recorded for training to refuse, nothing at inference
            attention_dropout=float(fields.get("attention_dropout") or 0.0),
        )
        fields.finish()
        return kwargs

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        """LLaDA's config.json for `config`, naming no mask id (a model's mask id is not part of its decoder);
        `differences` reads it back to say whether LLaDA computes that model."""
        c = config
        rope = rope_parameters(c.rope_theta, c.rope_scaling)
        written = {
            **{name: _FIELDS[name] for name in _NO_EFFECT if name not in ("eos_token_id", "pad_token_id")},
            **{name: value for name, (value, _) in _REQUIRED.items()},
            "model_type": self.model_type, "architectures": [self.architecture], "d_model": c.emb_features,
            "n_heads": c.num_heads, "n_kv_heads": c.num_kv_heads, "n_layers": c.num_layers, "mlp_ratio": 4,
            "mlp_hidden_size": c.mlp_features, "max_sequence_length": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "vocab_size": c.vocab_size, "embedding_size": c.vocab_size, "weight_tying": c.tie_embeddings,
            "include_qkv_bias": c.qkv_bias, "rope_theta": rope["rope_theta"], "attention_dropout": c.attention_dropout,
            "multi_query_attention": None, "bias_for_layer_norm": None, "mask_token_id": None,
        }
        if c.rope_scaling != RopeScaling():
            written["rope_scaling"] = rope  # LLaDA reads no scaling: this config.json is refused, as it should be
        return written

    def ignorable(self, name: str, config: DecoderConfig) -> bool:
        return name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == _HEAD)


LLADA = LLaDAConverter("llada", "LLaDAConfig", "LLaDAModelLM", _FIELDS, _RULES, dict(causal=False))
