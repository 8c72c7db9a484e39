"""Checkpoint tensors of vision towers and projectors (`dew.nn.vision`) as Dew parameters, and back.

`tower_rules` and `projector_rules` give the `dew.interop.tensors.Rule`s of one module, its Dew paths
relative to the module (`embeddings/patch_embedding/kernel`), or under `dew_prefix` (`"tower/"`) for
a model that holds it as a submodule; its tensor names under the checkpoint's `prefix`. A Gemma 3
checkpoint holds its tower and projector under one of the prefixes `TOWER_PREFIXES` and
`PROJECTOR_PREFIXES` list (transformers 5 reads them all; `tower_prefix` and `projector_prefix` find
the one a checkpoint uses); the first of each is the one Dew writes, which every transformers version
reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from dew.interop.tensors import Rule
from dew.nn.vision import (Gemma3nEmbedderConfig, Gemma4ProjectorConfig, Gemma4VisionConfig, GemmaProjectorConfig,
                           Llama4ProjectorConfig, Llama4VisionConfig, MobileNetV5Config, Qwen35MergerConfig,
                           Qwen35VisionConfig, SiglipConfig, projector_class, tower_class)

_KERNEL = (1, 0)  # transformers stores a projection [out, in], Dew keeps it [in, out]
_CONV = (2, 3, 1, 0)  # torch's Conv2d weight [out, in, kh, kw], Dew's (flax's) HWIO kernel [kh, kw, in, out]
_CONV3D = (1, 2, 3, 4, 0)  # torch's Conv3d weight [out, in, t, kh, kw], Dew's kernel [in, t, kh, kw, out]
_NORM = (("scale", "weight"), ("bias", "bias"))  # a LayerNorm's Dew leaves and transformers' tensors

TOWER_PREFIXES = {"siglip": (
    "vision_tower.vision_model.",  # the Hub's Gemma 3 files (transformers 4)
    "model.vision_tower.vision_model.",  # transformers 4.5x's module names
    "vision_tower.",  # what transformers 5 writes
    "model.vision_tower.",  # transformers 5's module names
), "llama4": ("vision_model.", "model.vision_model."), "qwen3_5": ("model.visual.",),
    "gemma4": ("model.vision_tower.",)}
PROJECTOR_PREFIXES = {"gemma": ("multi_modal_projector.", "model.multi_modal_projector."),
                      "llama4": ("multi_modal_projector.", "model.multi_modal_projector."),
                      "qwen3_5": ("model.visual.merger.",), "gemma4": ("model.embed_vision.",)}
# The tensor whose presence under a prefix says a checkpoint holds that module there.
_TOWER_ANCHORS = {"siglip": "embeddings.patch_embedding.weight", "llama4": "patch_embedding.linear.weight",
                  "qwen3_5": "patch_embed.proj.weight", "gemma4": "patch_embedder.input_proj.weight"}
_PROJECTOR_ANCHORS = {"gemma": "mm_input_projection_weight", "llama4": "linear_1.weight",
                      "qwen3_5": "linear_fc1.weight", "gemma4": "embedding_projection.weight"}
# What a tower's checkpoint may hold that the tower never reads: SigLIP's pooling head, which Gemma 3 does
# not run (saved where `vision_use_head` was true), and the position ids buffer older files kept.
_UNREAD = {"siglip": ("head.", "embeddings.position_ids"), "llama4": (), "qwen3_5": (), "gemma4": ()}
# Gemma 3n: timm's encoder inside transformers' TimmWrapperModel, and one embedder per modality (the audio
# one's tensors lie under GEMMA3N_AUDIO_PREFIXES, read with the same projector rules).
TOWER_PREFIXES["gemma3n"] = ("model.vision_tower.timm_model.", "vision_tower.timm_model.")
PROJECTOR_PREFIXES["gemma3n"] = ("model.embed_vision.", "embed_vision.")
GEMMA3N_AUDIO_PREFIXES = ("model.embed_audio.", "embed_audio.")
_TOWER_ANCHORS["gemma3n"], _PROJECTOR_ANCHORS["gemma3n"] = "conv_stem.conv.weight", "embedding_projection.weight"
_UNREAD["gemma3n"] = ()
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _encoder_layer(dew_layer: str, tensor_layer: str, norms, linears) -> tuple[Rule, ...]:
    """An encoder layer's LayerNorms (scale and bias) and biased linears (`[out, in]` kernels), under the Dew
    scope `dew_layer` and the checkpoint prefix `tensor_layer` (both with the layer placeholder)."""
    return (
        *(Rule(f"{dew_layer}/{norm}/{ours}", f"{tensor_layer}.{norm}.{theirs}") for norm in norms
          for ours, theirs in _NORM),
        *(Rule(f"{dew_layer}/{block}/{proj}/{leaf}", f"{tensor_layer}.{block}.{proj}.{tensor}", transpose=transpose)
          for block, proj in linears
          for leaf, tensor, transpose in (("kernel", "weight", _KERNEL), ("bias", "bias", None))),
    )


def _siglip_rules(config: SiglipConfig, prefix: str) -> tuple[Rule, ...]:
    linears = [("self_attn", proj) for proj in ("q_proj", "k_proj", "v_proj", "out_proj")] + [("mlp", "fc1"),
                                                                                             ("mlp", "fc2")]
    return (
        Rule("embeddings/patch_embedding/kernel", f"{prefix}embeddings.patch_embedding.weight", transpose=_CONV),
        Rule("embeddings/patch_embedding/bias", f"{prefix}embeddings.patch_embedding.bias"),
        Rule("embeddings/position_embedding/embedding", f"{prefix}embeddings.position_embedding.weight"),
        *_encoder_layer("encoder/layers", f"{prefix}encoder.layers.{{layer}}", ("layer_norm1", "layer_norm2"),
                        linears),
        *(Rule(f"post_layernorm/{ours}", f"{prefix}post_layernorm.{theirs}") for ours, theirs in _NORM),
    )


def _gemma_rules(config: GemmaProjectorConfig, prefix: str) -> tuple[Rule, ...]:
    return (Rule("mm_input_projection_weight", f"{prefix}mm_input_projection_weight"),
            Rule("mm_soft_emb_norm/scale", f"{prefix}mm_soft_emb_norm.weight"))


def _llama4_tower_rules(config: Llama4VisionConfig, prefix: str) -> tuple[Rule, ...]:
    layer = f"{prefix}model.layers.{{layer}}"
    biased = [("self_attn", proj) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")] + [("mlp", "fc1"),
                                                                                          ("mlp", "fc2")]
    return (
        Rule("patch_embedding/linear/kernel", f"{prefix}patch_embedding.linear.weight", transpose=_KERNEL),
        Rule("class_embedding", f"{prefix}class_embedding"),
        Rule("positional_embedding_vlm", f"{prefix}positional_embedding_vlm"),
        *(Rule(f"{norm}/{ours}", f"{prefix}{norm}.{theirs}") for norm in ("layernorm_pre", "layernorm_post")
          for ours, theirs in _NORM),
        *_encoder_layer("model/layers", layer, ("input_layernorm", "post_attention_layernorm"), biased),
        *(Rule(f"vision_adapter/mlp/{fc}/kernel", f"{prefix}vision_adapter.mlp.{fc}.weight", transpose=_KERNEL)
          for fc in ("fc1", "fc2")),
    )


def _llama4_projector_rules(config: Llama4ProjectorConfig, prefix: str) -> tuple[Rule, ...]:
    return (Rule("linear_1/kernel", f"{prefix}linear_1.weight", transpose=_KERNEL),)


def _qwen35_tower_rules(config: Qwen35VisionConfig, prefix: str) -> tuple[Rule, ...]:
    linears = [("attn", "qkv"), ("attn", "proj"), ("mlp", "linear_fc1"), ("mlp", "linear_fc2")]
    return (
        Rule("patch_embed/kernel", f"{prefix}patch_embed.proj.weight", transpose=_CONV3D),
        Rule("patch_embed/bias", f"{prefix}patch_embed.proj.bias"),
        Rule("pos_embed/embedding", f"{prefix}pos_embed.weight"),
        *_encoder_layer("layers", f"{prefix}blocks.{{layer}}", ("norm1", "norm2"), linears),
    )


def _qwen35_merger_rules(config: Qwen35MergerConfig, prefix: str) -> tuple[Rule, ...]:
    return (*(Rule(f"norm/{ours}", f"{prefix}norm.{theirs}") for ours, theirs in _NORM),
            *(Rule(f"{fc}/{leaf}", f"{prefix}{fc}.{tensor}", transpose=transpose) for fc in ("linear_fc1", "linear_fc2")
              for leaf, tensor, transpose in (("kernel", "weight", _KERNEL), ("bias", "bias", None))))


def _mobilenet_rules(config: MobileNetV5Config, prefix: str) -> tuple[Rule, ...]:
    conv = lambda dew, name: Rule(f"{dew}/kernel", f"{prefix}{name}.weight", transpose=_CONV)
    norm = lambda dew, name: Rule(f"{dew}/scale", f"{prefix}{name}.weight")
    conv_norm = lambda dew, name: (conv(f"{dew}/conv", f"{name}.conv"), norm(f"{dew}/bn", f"{name}.bn"))
    rules = [*conv_norm("conv_stem", "conv_stem"), Rule("conv_stem/conv/bias", f"{prefix}conv_stem.conv.bias")]
    for s, stage in enumerate(config.blocks):
        for i, block in enumerate(stage):
            dew, name = f"blocks_{s}_{i}", f"blocks.{s}.{i}"
            if block.kind == "er":
                rules += [conv(f"{dew}/conv_exp", f"{name}.conv_exp"), norm(f"{dew}/bn1", f"{name}.bn1"),
                          conv(f"{dew}/conv_pwl", f"{name}.conv_pwl"), norm(f"{dew}/bn2", f"{name}.bn2")]
                continue
            if block.kind == "uir":
                parts = ("dw_start",) * bool(block.start) + ("pw_exp",) + ("dw_mid",) * bool(block.kernel) + ("pw_proj",)
                rules += [rule for part in parts for rule in conv_norm(f"{dew}/{part}", f"{name}.{part}")]
            else:
                rules += [norm(f"{dew}/norm", f"{name}.norm"), conv(f"{dew}/attn/query_proj", f"{name}.attn.query.proj"),
                          conv(f"{dew}/attn/output_proj", f"{name}.attn.output.proj")]
                for head in ("key", "value"):
                    rules.append(conv(f"{dew}/attn/{head}_proj", f"{name}.attn.{head}.proj"))
                    if block.kv_stride > 1:
                        rules += [conv(f"{dew}/attn/{head}_down_conv", f"{name}.attn.{head}.down_conv"),
                                  norm(f"{dew}/attn/{head}_norm", f"{name}.attn.{head}.norm")]
            rules.append(Rule(f"{dew}/layer_scale/gamma", f"{prefix}{name}.layer_scale.gamma"))
    rules += [*conv_norm("msfa/ffn/pw_exp", "msfa.ffn.pw_exp"), *conv_norm("msfa/ffn/pw_proj", "msfa.ffn.pw_proj"),
              norm("msfa/norm", "msfa.norm")]
    return tuple(rules)


def _gemma3n_embedder_rules(config: Gemma3nEmbedderConfig, prefix: str) -> tuple[Rule, ...]:
    return (Rule("embedding/embedding", f"{prefix}embedding.weight"),
            *(Rule(f"{norm}/scale", f"{prefix}{norm}.weight") for norm in ("hard_embedding_norm", "soft_embedding_norm")),
            Rule("embedding_projection/kernel", f"{prefix}embedding_projection.weight", transpose=_KERNEL))


def _gemma4_tower_rules(config: Gemma4VisionConfig, prefix: str) -> tuple[Rule, ...]:
    layer = f"{prefix}encoder.layers.{{layer}}"
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    linears = [f"self_attn/{proj}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        f"mlp/{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
    # a clipped linear's bounds (frozen constants, infinite where a bound is off) beside its kernel
    bounds = _BOUNDS if config.use_clipped_linears else ()
    standardize = ("std_bias", "std_scale") if config.standardize else ()
    return (
        Rule("patch_embedder/input_proj/kernel", f"{prefix}patch_embedder.input_proj.weight", transpose=_KERNEL),
        Rule("patch_embedder/position_embedding_table", f"{prefix}patch_embedder.position_embedding_table"),
        *(Rule(f"layers/{norm}/scale", f"{layer}.{norm}.weight") for norm in norms),
        *(Rule(f"layers/self_attn/{norm}/scale", f"{layer}.self_attn.{norm}.weight") for norm in ("q_norm", "k_norm")),
        *(Rule(f"layers/{linear}/linear/kernel", f"{layer}.{linear.replace('/', '.')}.linear.weight", transpose=_KERNEL)
          for linear in linears),
        *(Rule(f"layers/{linear}/{bound}", f"{layer}.{linear.replace('/', '.')}.{bound}", infinities=True)
          for linear in linears for bound in bounds),
        *(Rule(name, f"{prefix}{name}") for name in standardize),
    )


def _gemma4_projector_rules(config: Gemma4ProjectorConfig, prefix: str) -> tuple[Rule, ...]:
    return (Rule("embedding_projection", f"{prefix}embedding_projection.weight", transpose=_KERNEL),)


_TOWER_RULES = {"siglip": _siglip_rules, "llama4": _llama4_tower_rules, "qwen3_5": _qwen35_tower_rules,
                "gemma4": _gemma4_tower_rules}
_PROJECTOR_RULES = {"gemma": _gemma_rules, "llama4": _llama4_projector_rules, "qwen3_5": _qwen35_merger_rules,
                    "gemma4": _gemma4_projector_rules}
_TOWER_RULES["gemma3n"], _PROJECTOR_RULES["gemma3n"] = _mobilenet_rules, _gemma3n_embedder_rules


def tower_rules(kind: str, config, prefix: str, dew_prefix: str = "") -> tuple[Rule, ...]:
    """The rules between tower `kind`'s tensors under `prefix` (`"vision_tower.vision_model."`) and its
    parameters under `dew_prefix` (`""`: the tower's own tree; `"tower/"`: a model's)."""
    return _rules(_TOWER_RULES, tower_class(kind), kind, config, prefix, dew_prefix)


def projector_rules(kind: str, config, prefix: str, dew_prefix: str = "") -> tuple[Rule, ...]:
    """The rules between projector `kind`'s tensors under `prefix` (`"multi_modal_projector."`) and its
    parameters under `dew_prefix`."""
    return _rules(_PROJECTOR_RULES, projector_class(kind), kind, config, prefix, dew_prefix)


def _rules(table, config_class, kind, config, prefix, dew_prefix) -> tuple[Rule, ...]:
    if not isinstance(config, config_class):
        raise TypeError(f"rules of {kind!r} are made from a {config_class.__name__}, not a {type(config).__name__}")
    if dew_prefix and not dew_prefix.endswith("/"):
        raise ValueError(f"dew_prefix {dew_prefix!r} must name a scope and end with '/', as 'tower/' does")
    rules = table[kind](config, prefix)
    return tuple(dataclasses.replace(rule, dew=tuple(dew_prefix + path for path in rule.dew)) for rule in rules)


def tower_prefix(kind: str, names: Collection[str], where: str) -> str:
    """The prefix under which the checkpoint tensors `names` hold tower `kind` (`where` names the
    checkpoint in errors)."""
    tower_class(kind)
    return _prefix(TOWER_PREFIXES[kind], _TOWER_ANCHORS[kind], names, f"vision tower ({kind})", where)


def projector_prefix(kind: str, names: Collection[str], where: str) -> str:
    """The prefix under which the checkpoint tensors `names` hold projector `kind`."""
    projector_class(kind)
    return _prefix(PROJECTOR_PREFIXES[kind], _PROJECTOR_ANCHORS[kind], names, f"projector ({kind})", where)


def _prefix(prefixes: Sequence[str], anchor: str, names: Collection[str], what: str, where: str) -> str:
    found = [prefix for prefix in prefixes if prefix + anchor in names]
    if len(found) != 1:
        held = "none of them" if not found else f"each of {found}"
        raise ValueError(f"{where} holds a {what} under {held}: Dew looks for {anchor!r} under one of the "
                         f"prefixes {list(prefixes)}; a checkpoint from transformers holds exactly one")
    return found[0]


def tower_ignorable(kind: str, name: str, prefix: str) -> bool:
    """Whether checkpoint tensor `name` belongs to tower `kind` under `prefix` but is never read (SigLIP's
    pooling head, its position ids buffer): a loader skips it, an export writes none."""
    tower_class(kind)
    return any(name.startswith(prefix + unread) for unread in _UNREAD[kind])
