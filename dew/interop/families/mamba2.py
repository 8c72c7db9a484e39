"""Mamba2: transformers' port (`Mamba2ForCausalLM`, model_type "mamba2") both ways, and mamba_ssm's own
checkpoints (`state-spaces/mamba2-*`) in, read as the port transformers' conversion script makes.

A Mamba2 model is the decoder with every layer "linear_attention", its mixer `dew.nn.mamba2.Mamba2`
and no feed-forward (`mlp_features` 0): `backbone.layers.N.norm` is the layer's `input_layernorm`,
`backbone.layers.N.mixer.*` its mixer, `backbone.norm_f` the final norm. transformers keeps the
residual stream in float32 with `residual_in_fp32` whatever the compute dtype; Dew keeps it in the
compute dtype, which is the same model in float32.

llama.cpp's `mamba2` GGUF files read and write through `LLAMA_CPP` (see the comment above it): its tensor names,
the convolution, `A`, `D` and the gated norm's scale stored in other shapes, `A = -exp(A_log)` in place of
`A_log`, and the metadata its converter writes.

A mamba_ssm config.json has no model_type: `d_model`, `n_layer`, `vocab_size`, `ssm_cfg` (the
`Mamba2` layer's arguments) and the vocabulary padding (`pad_vocab_size_multiple`), and its tensors
name the embedding `backbone.embedding`. `port_config` writes the port's config.json for it, the
vocabulary padded up to the multiple as the checkpoint's embedding is; `ssm_cfg` is read where its
values are the layer's (the released checkpoints hold defaults there) and refused by name where Dew
computes something else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from dew.interop.families.converter import Converter, GGUFNames
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule, ValueMap
from dew.nn.mamba2 import Mamba2
from dew.nn.transformer import LINEAR, DecoderConfig

# A recurrent model reads no position table, so no length limits it: the longest context Dew gives it.
CONTEXT = 1 << 20
_KERNEL = (1, 0)
_LAYER = "backbone.layers.{layer}"
_MIXER = f"{_LAYER}.mixer"

MAMBA2_FIELDS = {
    "num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
    "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
    "expand": 2, "conv_kernel": 4, "n_groups": 8, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
    "initializer_range": 0.1, "residual_in_fp32": True, "time_step_rank": "auto", "time_step_min": 0.001,
    "time_step_max": 0.1, "time_step_floor": 1e-4, "time_step_limit": (0.0, math.inf),
    "rescale_prenorm_residual": False, "use_cache": True, "chunk_size": 256, "tie_word_embeddings": False,
}
# Fields that only set how transformers initializes fresh weights, written back as read.
_INIT_ONLY = ("time_step_rank", "time_step_min", "time_step_max", "time_step_floor", "rescale_prenorm_residual",
              "initializer_range", "residual_in_fp32")


def _rules(embedding: str) -> tuple[Rule, ...]:
    return (
        Rule("embed_tokens/embedding", embedding),
        Rule("layers/input_layernorm/scale", f"{_LAYER}.norm.weight"),
        *(Rule(f"layers/self_attn/{proj}/kernel", f"{_MIXER}.{proj}.weight", transpose=_KERNEL)
          for proj in ("in_proj", "out_proj")),
        *(Rule(f"layers/self_attn/{part}/bias", f"{_MIXER}.{part}.bias") for part in ("in_proj", "out_proj", "conv1d")),
        Rule("layers/self_attn/conv1d/kernel", f"{_MIXER}.conv1d.weight"),
        *(Rule(f"layers/self_attn/{name}", f"{_MIXER}.{name}") for name in ("A_log", "dt_bias", "D")),
        Rule("layers/self_attn/norm/scale", f"{_MIXER}.norm.weight"),
        Rule("norm/scale", "backbone.norm_f.weight"),
        Rule("lm_head/kernel", "lm_head.weight", transpose=_KERNEL),
    )


PORT_RULES = _rules("backbone.embeddings.weight")
MAMBA_SSM_RULES = _rules("backbone.embedding.weight")  # mamba_ssm's name, which transformers' load hook renames


# How llama.cpp writes a transformers Mamba2 (facts from llama.cpp: conversion/mamba.py's Mamba2Model, which was
# convert_hf_to_gguf.py's, and src/models/mamba2.cpp's tensor shapes, ggml's {columns, rows} read here as [rows,
# columns]): `dt_bias` is renamed `dt_proj.bias` and so ssm_dt.bias [H]; A_log is stored as A = -exp(A_log) and,
# like D, as [H, 1], both without a ".weight" suffix; the convolution [C, 1, K] squeezed to [C, K]; the gated norm's
# scale [I] as [n_groups, I / n_groups], which llama.cpp normalizes group by group, as Dew does. The metadata: the
# width, the layers, ssm.conv_kernel, ssm.inner_size (I), ssm.state_size, ssm.time_step_rank (the heads: I over
# head_dim), ssm.group_count and the norms' epsilon; context_length 2^20, feed_forward_length 0 and
# attention.head_count 0 whatever the model. llama.cpp's graph has no bias on in_proj or out_proj, always a bias on
# the convolution, and no clamp of the time step; a missing `output.weight` ties the head to the embedding. Its
# converter pads the vocabulary list (not the embedding) to a multiple of 16, the transformers port's own padding.
_NEGATIVE_EXP = ValueMap(
    "A = -exp(A_log)", read=lambda a: np.log(-a), write=lambda a_log: -np.exp(a_log), accepts=lambda a: a < 0,
    domain="negative",
)  # A_log -> A -> A_log is exact for |A_log| >= 1, else within 2^-24 + half an ulp of A_log (A's float32 rounding)
_LLAMA_CPP_BLOCK = {"norm.weight": "attn_norm.weight", "mixer.in_proj.weight": "ssm_in.weight",
                    "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
                    "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a", "mixer.D": "ssm_d",
                    "mixer.norm.weight": "ssm_norm.weight", "mixer.out_proj.weight": "ssm_out.weight"}
LLAMA_CPP = GGUFNames(
    "mamba2",
    {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
     "lm_head.weight": "output.weight",
     **{f"{_LAYER}.{ours}": f"blk.{{layer}}.{theirs}" for ours, theirs in _LLAMA_CPP_BLOCK.items()}},
    {"embedding_length": "hidden_size", "block_count": "num_hidden_layers", "ssm.conv_kernel": "conv_kernel",
     "ssm.inner_size": "inner_size", "ssm.state_size": "state_size", "ssm.time_step_rank": "num_heads",
     "ssm.group_count": "n_groups", "attention.layer_norm_rms_epsilon": "layer_norm_epsilon"},
    fixed={"use_bias": False, "use_conv_bias": True, "time_step_limit": [0.0, math.inf], "hidden_act": "silu"},
    constants={"context_length": CONTEXT, "feed_forward_length": 0, "attention.head_count": 0},
)


class Mamba2Converter(Converter):
    """transformers' Mamba2 port (see the module)."""

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        fields = ConfigFields({name: _untagged(value) for name, value in source.items()}, self, where)
        hidden, heads, head_dim = fields.get("hidden_size"), fields.get("num_heads"), fields.get("head_dim")
        expand = fields.get("expand")
        if hidden * expand != heads * head_dim:
            fields.refuse("num_heads", heads, f"hidden_size * expand ({hidden} * {expand}) must equal num_heads * "
                          f"head_dim ({heads} * {head_dim}), as transformers' Mamba2Config requires")
        fields.require("hidden_act", ("silu", "swish"), "the convolution's activation Dew computes is silu")
        fields.require("is_causal", (True,), "attention that sees later tokens (a bidirectional encoder) is not "
                       "built in Dew; set it to true for the causal decoder")
        low, high = _limit(fields)
        for name in _INIT_ONLY:
            fields.get(name)
        layers = fields.get("num_hidden_layers")
        recurrent = Mamba2(num_heads=heads, head_dim=head_dim, state_size=fields.get("state_size"),
                           n_groups=fields.get("n_groups"), conv_kernel=fields.get("conv_kernel"),
                           chunk_size=fields.get("chunk_size"), use_bias=fields.get("use_bias"),
                           use_conv_bias=fields.get("use_conv_bias"),
                           time_step_limit=(low, None if math.isinf(high) else high))
        kwargs = dict(vocab_size=fields.get("vocab_size"), emb_features=hidden, num_layers=layers, num_heads=1,
                      head_dim=2, mlp_features=0, max_seq_len=CONTEXT, norm_eps=fields.get("layer_norm_epsilon"),
                      tie_embeddings=bool(fields.get("tie_word_embeddings")), layer_types=(LINEAR,) * layers,
                      recurrent=recurrent)
        fields.finish()
        return kwargs

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        c, r = config, config.recurrent
        low, high = r.time_step_limit if isinstance(r, Mamba2) else (0.0, None)
        written = {
            "model_type": self.model_type, "architectures": [self.architecture], "vocab_size": c.vocab_size,
            "hidden_size": c.emb_features, "num_hidden_layers": c.num_layers,
            "layer_norm_epsilon": c.norm_eps, "tie_word_embeddings": c.tie_embeddings, "hidden_act": "silu",
            "time_step_limit": [low, _INFINITY if high is None else high],
        }
        if isinstance(r, Mamba2):
            written.update(num_heads=r.num_heads, head_dim=r.head_dim, expand=max(1, r.inner // c.emb_features),
                           state_size=r.state_size, n_groups=r.n_groups, conv_kernel=r.conv_kernel,
                           chunk_size=r.chunk_size, use_bias=r.use_bias, use_conv_bias=r.use_conv_bias)
        return written

    def differences(self, config: DecoderConfig) -> list[str]:
        # the port has no longest context to write: any computes the same
        if config.recurrent is not None:
            config = _with_context(config)
        return super().differences(config)

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        if names is not None and "backbone.embedding.weight" in names:
            return MAMBA_SSM_RULES
        return PORT_RULES

    def ignorable(self, name: str, config: DecoderConfig) -> bool:
        return config.tie_embeddings and name == "lm_head.weight"

    def read_differences(self, config: DecoderConfig, source: Mapping[str, Any], names: Collection[str],
                         where: str) -> list[str]:
        # A GGUF file names no chunk size: chunking orders the scan's sums, the model is the same.
        if isinstance(config.recurrent, Mamba2) and "chunk_size" not in source:
            source = {**source, "chunk_size": config.recurrent.chunk_size}
        return super().read_differences(_with_context(config), source, names, where)

    def gguf_fields(self, config: DecoderConfig) -> dict[str, Any]:
        return {**self.written(config), "inner_size": config.recurrent.inner}

    def gguf_config(self, fields: dict[str, Any], where: str) -> dict[str, Any]:
        fields = dict(fields)
        inner, heads, hidden = fields.pop("inner_size", None), fields.get("num_heads"), fields.get("hidden_size")
        whole = lambda n: isinstance(n, int) and not isinstance(n, bool) and n > 0
        if not (whole(inner) and whole(heads) and whole(hidden) and inner % heads == 0 and inner % hidden == 0):
            raise ValueError(f"{where} gives mamba2.ssm.inner_size {inner!r}, ssm.time_step_rank (the heads) {heads!r} "
                             f"and embedding_length {hidden!r}: transformers' Mamba2, which Dew computes, needs the "
                             "inner size a whole multiple of both (num_heads * head_dim = hidden_size * expand); the "
                             "file is damaged or holds another architecture under the mamba2 name")
        return {**fields, "head_dim": inner // heads, "expand": inner // hidden}

    def gguf_rules(self, config: DecoderConfig) -> tuple[Rule, ...]:
        r = config.recurrent
        if r.use_bias:
            raise ValueError("this Mamba2 has biases on in_proj and out_proj (use_bias), which llama.cpp's mamba2 "
                             "graph does not add: export it as a transformers checkpoint (the default format)")
        steps = {"layers/self_attn/conv1d/kernel": dict(reshape=(r.conv_dim, r.conv_kernel)),
                 "layers/self_attn/A_log": dict(reshape=(r.num_heads, 1), values=_NEGATIVE_EXP),
                 "layers/self_attn/D": dict(reshape=(r.num_heads, 1)),
                 "layers/self_attn/norm/scale": dict(reshape=(r.n_groups, r.inner // r.n_groups))}
        return tuple(dataclasses.replace(rule, **steps.get(rule.dew[0], {})) for rule in super().gguf_rules(config))


# How transformers writes an infinite float in config.json (strict JSON has none): an object tagging it.
_INFINITY = {"__float__": "Infinity"}


def _untagged(value):
    """A config value with transformers' tagged infinities (`{"__float__": "Infinity"}`) as floats."""
    if isinstance(value, list):
        return [_untagged(item) for item in value]
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}.get(value["__float__"], value)
    return value


def _with_context(config: DecoderConfig) -> DecoderConfig:
    return dataclasses.replace(config, max_seq_len=CONTEXT)


def _limit(fields: ConfigFields) -> tuple[float, float]:
    limit = fields.get("time_step_limit")
    if (not isinstance(limit, (list, tuple)) or len(limit) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)
            or not 0 <= limit[0] <= limit[1] or math.isnan(limit[1])):
        fields.refuse("time_step_limit", limit, "it is [low, high], 0 <= low <= high (high may be Infinity)")
    return float(limit[0]), float(limit[1])


MAMBA2 = Mamba2Converter("mamba2", "Mamba2Config", "Mamba2ForCausalLM", MAMBA2_FIELDS, PORT_RULES, gguf=LLAMA_CPP)

# ---- mamba_ssm's own format --------------------------------------------------------------------------

# mamba_ssm's MambaConfig (models/config_mamba.py) and its defaults; `ssm_cfg` is read below.
_MAMBA_SSM_CONFIG = {
    "d_model": 2560, "d_intermediate": 0, "n_layer": 64, "vocab_size": 50277, "ssm_cfg": {}, "attn_layer_idx": [],
    "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
    "pad_vocab_size_multiple": 8, "tie_embeddings": True,
}
# What each of them must be for the port to compute the checkpoint, and why.
_MAMBA_SSM_REQUIRED = {
    "d_intermediate": (0, "an MLP after each mixer is not built for Mamba2 in Dew"),
    "attn_layer_idx": ([], "attention layers among the Mamba2 ones are not built for mamba_ssm checkpoints in Dew"),
    "attn_cfg": ({}, "attention layers among the Mamba2 ones are not built for mamba_ssm checkpoints in Dew"),
    "rms_norm": (True, "the port's norms are RMSNorm"),
}
# mamba_ssm's Mamba2 layer arguments (modules/mamba2.py) and the port's field each becomes.
_SSM_CFG_FIELDS = {"d_state": "state_size", "d_conv": "conv_kernel", "expand": "expand", "headdim": "head_dim",
                   "ngroups": "n_groups", "chunk_size": "chunk_size", "bias": "use_bias", "conv_bias": "use_conv_bias",
                   "dt_min": "time_step_min", "dt_max": "time_step_max", "dt_init_floor": "time_step_floor",
                   "dt_limit": "time_step_limit"}
_SSM_CFG_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
                     "bias": False, "conv_bias": True, "dt_min": 0.001, "dt_max": 0.1, "dt_init_floor": 1e-4,
                     "dt_limit": [0.0, math.inf]}  # mamba_ssm writes it as (0.0, float("inf")): Infinity
# Layer arguments that must keep mamba_ssm's default for the port to compute the layer.
_SSM_CFG_REQUIRED = {"d_ssm": (None,), "D_has_hdim": (False,), "rmsnorm": (True,), "norm_before_gate": (False,),
                     "activation": ("swish", "silu")}
_SSM_CFG_IGNORED = ("A_init_range", "conv_init", "use_mem_eff_path", "dt_scale", "dt_init", "layer_idx",
                    "process_group", "sequence_parallel", "device", "dtype")


def is_mamba_ssm(source: Mapping[str, Any]) -> bool:
    """Whether a config.json is mamba_ssm's own (no model_type; `d_model`, `n_layer` and `ssm_cfg`)."""
    return "model_type" not in source and {"d_model", "n_layer", "ssm_cfg"} <= set(source)


def port_config(source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """transformers' Mamba2 config.json for a mamba_ssm one: the vocabulary padded up to
    `pad_vocab_size_multiple`, the layer's `ssm_cfg` as the port's fields, token ids 0 as transformers'
    conversion script sets them; a config the port does not compute is refused by name."""
    unknown = sorted(set(source) - set(_MAMBA_SSM_CONFIG))
    if unknown:
        raise ValueError(f"{where} (a mamba_ssm config) names {unknown}, which mamba_ssm's MambaConfig does not have: "
                         f"its fields are {sorted(_MAMBA_SSM_CONFIG)}")
    read = {**_MAMBA_SSM_CONFIG, **source}
    for name, (needed, why) in _MAMBA_SSM_REQUIRED.items():
        if read[name] != needed:
            raise ValueError(f"{where} field {name!r} = {read[name]!r}: {why} (it must be {needed!r})")
    ssm_cfg = dict(read["ssm_cfg"] or {})
    layer = ssm_cfg.pop("layer", "Mamba1")
    if layer != "Mamba2":
        raise ValueError(f"{where} ssm_cfg names layer {layer!r} (mamba_ssm's default when it names none is Mamba1): "
                         "Dew builds Mamba2 layers only; Mamba1 checkpoints (state-spaces/mamba-*) are not built yet")
    for name, allowed in _SSM_CFG_REQUIRED.items():
        if name in ssm_cfg and ssm_cfg[name] not in allowed:
            raise ValueError(f"{where} ssm_cfg {name!r} = {ssm_cfg[name]!r} is not something Dew computes: the port "
                             f"computes {allowed[0]!r}")
    strange = sorted(set(ssm_cfg) - set(_SSM_CFG_FIELDS) - set(_SSM_CFG_REQUIRED) - set(_SSM_CFG_IGNORED))
    if strange:
        raise ValueError(f"{where} ssm_cfg names {strange}, which are not arguments of mamba_ssm's Mamba2 layer Dew "
                         "reads: remove them if the model was trained without them")
    layer_fields = {port: ssm_cfg.get(name, _SSM_CFG_DEFAULTS[name]) for name, port in _SSM_CFG_FIELDS.items()}
    hidden, multiple = read["d_model"], read["pad_vocab_size_multiple"]
    vocab = read["vocab_size"]
    padded = vocab if not multiple else -(-vocab // multiple) * multiple
    return {
        "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": padded, "hidden_size": hidden,
        "num_hidden_layers": read["n_layer"],
        "num_heads": hidden * layer_fields["expand"] // layer_fields["head_dim"], **layer_fields,
        "time_step_limit": [_INFINITY if math.isinf(v) else float(v) for v in layer_fields["time_step_limit"]],
        "residual_in_fp32": read["residual_in_fp32"],
        "tie_word_embeddings": read["tie_embeddings"], "layer_norm_epsilon": 1e-5, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }
