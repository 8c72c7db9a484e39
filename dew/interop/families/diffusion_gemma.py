"""DiffusionGemma (transformers' `diffusion_gemma`, google/diffusiongemma-26B-A4B-it): block diffusion over
Gemma 4 layers, loaded as `dew.nn.diffusion_gemma.DiffusionGemma` and written back.

config.json is `DiffusionGemmaConfig`: a `text_config` (`DiffusionGemmaTextConfig`, its fields read or
refused by name below), a Gemma 4 `vision_config` (`dew.nn.vision`'s `gemma4` tower reads it), the image
token ids and `canvas_length`. The checkpoint stores the shared text stack once, under `model.decoder.*`
(transformers ties the encoder's weights and the head to it), the encoder's own `layer_scalar` buffers under
`model.encoder.language_model.layers.N`, and the vision tower and its embedder under
`model.encoder.vision_tower` and `model.encoder.embed_vision`: Gemma 4's tower and projector
(`DiffusionGemmaVision`), read and written through their tensor rules (`dew.interop.vision`), their clipping
bounds and standardization in the frozen `constants` collection. Images run at the prompt's prefill
(`dew.nn.diffusion_gemma`), laid out by the checkpoint's processor (transformers' `Gemma4Processor`,
`processor`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from flax import traverse_util

from dew.interop import tensors
from dew.interop.export import merge_collections, split_collections
from dew.interop.families.converter import Converter
from dew.interop.hf_decoders import _BASE_FIELDS, _DROPPED_ON_LOAD, _LEGACY_FIELDS, _METADATA_FIELDS
from dew.interop.processors import Processor, load_reference
from dew.lazy import kept
from dew.nn.diffusion_gemma import CONSTANTS, FULL, SLIDING, DiffusionGemma, DiffusionGemmaConfig, DiffusionGemmaVision
from dew.nn.rotary import RopeScaling

MODEL_TYPE = "diffusion_gemma"
_SHARED = "model.decoder"
_ENCODER = "model.encoder.language_model"
TOWER, PROJECTOR = "gemma4", "gemma4"  # transformers builds Gemma 4's tower (AutoModel of a gemma4_vision config)
_TOWER_PREFIX, _PROJECTOR_PREFIX = "model.encoder.vision_tower.", "model.encoder.embed_vision."

# DiffusionGemmaTextConfig's fields with transformers' defaults.
TEXT_FIELDS = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "pad_token_id": 0,
    "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "sliding_window": 512, "layer_types": None,
    "use_bidirectional_attention": None, "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
    "global_head_dim": 512, "num_global_key_value_heads": None, "per_layer_config": None,
    # a class attribute, not a declared field: transformers keeps a config.json's value and the head reads it
    "final_logit_softcapping": 30.0,
}
# What transformers' text config takes as keyword arguments without declaring them.
UNDECLARED_TEXT_FIELDS = ("global_head_dim", "num_global_key_value_heads", "per_layer_config",
                          "final_logit_softcapping")
# DiffusionGemmaConfig's own fields with transformers' defaults.
OUTER_FIELDS = {
    "text_config": None, "vision_config": None, "boi_token_id": 255_999, "eoi_token_id": 258_882,
    "image_token_id": 258_880, "initializer_range": 0.02, "tie_word_embeddings": True, "canvas_length": 256,
}
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_GENERIC = _BASE_FIELDS | _DROPPED_ON_LOAD | _LEGACY_FIELDS | _METADATA_FIELDS | {"dtype", "torch_dtype"}


class _Fields:
    """One config record read field by field: unknown fields refused by name, transformers' defaults."""

    def __init__(self, source: Mapping[str, Any], defaults: Mapping[str, Any], where: str):
        self.source, self.defaults, self.where = source, defaults, where
        for name, value in source.items():
            if name not in defaults and name not in _GENERIC:
                raise ValueError(f"{where} field {name!r} = {value!r} is not a field of transformers' DiffusionGemma "
                                 "config and Dew cannot compute it: remove it if the model was trained without it")

    def get(self, name: str):
        return self.source[name] if name in self.source else self.defaults[name]

    def refuse(self, name: str, value, fix: str):
        raise ValueError(f"{self.where} field {name!r} = {value!r} is not something Dew computes for "
                         f"{MODEL_TYPE}: {fix}")


def model_config(source: Mapping[str, Any], where: str = "config.json", *, max_seq_len: int | None = None,
                 dtype="float32", param_dtype="float32") -> DiffusionGemmaConfig:
    """The `DiffusionGemmaConfig` a diffusion_gemma config.json describes (its text model)."""
    outer = _Fields(source, OUTER_FIELDS, where)
    if outer.get("tie_word_embeddings") is not True:
        outer.refuse("tie_word_embeddings", outer.get("tie_word_embeddings"), "Dew builds the tied model (one text "
                     "stack for encoder and decoder, the embedding as the head), which is what transformers ships")
    text = outer.get("text_config") or {}
    fields = _Fields(text, TEXT_FIELDS, f"{where} text_config")
    if fields.get("tie_word_embeddings") is not True:
        fields.refuse("tie_word_embeddings", fields.get("tie_word_embeddings"), "Dew builds the tied head")
    if fields.get("hidden_activation") != "gelu_pytorch_tanh":
        fields.refuse("hidden_activation", fields.get("hidden_activation"), "DiffusionGemma gates with "
                      "gelu_pytorch_tanh, the only activation Dew builds for it")
    if fields.get("attention_bias"):
        fields.refuse("attention_bias", True, "DiffusionGemma's projections have no bias in Dew")
    bidirectional = fields.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        fields.refuse("use_bidirectional_attention", bidirectional, "Dew's encoder is causal over text: None, or "
                      "'vision' (an image's tokens read each other in both directions)")
    experts, top_k, expert_features = (fields.get(n) for n in ("num_experts", "top_k_experts", "moe_intermediate_size"))
    if not experts or not top_k or not expert_features:
        fields.refuse("num_experts", experts, "every DiffusionGemma layer runs a mixture of experts: give num_experts, "
                      "top_k_experts and moe_intermediate_size")
    layers = fields.get("num_hidden_layers")
    layer_types = list(fields.get("layer_types") or
                       [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
    if len(layer_types) != layers:
        fields.refuse("layer_types", layer_types, f"give one type per layer ({layers})")
    if layer_types[-1] != FULL:
        fields.refuse("layer_types", layer_types, "transformers forces the last layer to full_attention; write it so")
    head_dim, kv_heads = fields.get("head_dim"), fields.get("num_key_value_heads")
    head_dims, kv = _per_layer(fields, layer_types, head_dim, kv_heads)
    rope = fields.get("rope_parameters") or _DEFAULT_ROPE
    rotary = tuple((kind, *_rotary(fields, rope, kind)) for kind in sorted(set(layer_types)))
    dropout = fields.get("attention_dropout")
    if dropout:
        fields.refuse("attention_dropout", dropout, "Dew trains DiffusionGemma without attention dropout; set it to 0")
    canvas = outer.get("canvas_length")
    if not isinstance(canvas, int) or canvas < 1:
        outer.refuse("canvas_length", canvas, "the denoiser's block needs a positive whole number of tokens")
    for name in ("boi_token_id", "eoi_token_id"):
        outer.get(name)  # the processor's markers around an image: plain text tokens to the model
    # transformers builds the default Gemma 4 tower where config.json names none; the towers' modules load here,
    # when a DiffusionGemma is read, not when the family registry finds another family
    from dew.nn.vision import projector_config, tower_config

    vision_record = dict(outer.get("vision_config") or {})
    vision = DiffusionGemmaVision(
        TOWER, tower_config(TOWER, vision_record, f"{where} vision_config"), PROJECTOR,
        projector_config(PROJECTOR, {"vision_config": vision_record, "text_config": {
            "hidden_size": fields.get("hidden_size")}}, where),
        int(outer.get("image_token_id")), bidirectional_images=bidirectional == "vision")
    return DiffusionGemmaConfig(
        vocab_size=fields.get("vocab_size"), emb_features=fields.get("hidden_size"),
        mlp_features=fields.get("intermediate_size"), num_heads=fields.get("num_attention_heads"),
        layer_types=tuple(layer_types), head_dims=head_dims, kv_heads=kv, sliding_window=fields.get("sliding_window"),
        rotary=rotary, experts=experts, top_k=top_k, expert_features=expert_features, canvas_length=canvas,
        max_seq_len=max_seq_len or fields.get("max_position_embeddings"), norm_eps=fields.get("rms_norm_eps"),
        logit_softcap=fields.get("final_logit_softcapping"), dtype=dtype, param_dtype=param_dtype, vision=vision)


def _per_layer(fields: _Fields, layer_types, head_dim, kv_heads) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's head width and key/value heads: `per_layer_config` as written (transformers writes the
    full layers' overrides), else the full layers take `global_head_dim` and `num_global_key_value_heads`."""
    overrides = fields.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": fields.get("global_head_dim")}
        if fields.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = fields.get("num_global_key_value_heads")
        overrides = {str(i): full for i, kind in enumerate(layer_types) if kind == FULL}
    head_dims, kv = [], []
    for i in range(len(layer_types)):
        override = dict(overrides.get(str(i), overrides.get(i, {})))
        unknown = sorted(set(override) - {"head_dim", "num_key_value_heads"})
        if unknown:
            fields.refuse("per_layer_config", overrides, f"layer {i} overrides {unknown}; Dew reads head_dim and "
                          "num_key_value_heads per layer")
        head_dims.append(int(override.get("head_dim", head_dim)))
        kv.append(int(override.get("num_key_value_heads", kv_heads)))
    return tuple(head_dims), tuple(kv)


def _rotary(fields: _Fields, rope: Mapping[str, Any], kind: str) -> tuple[float, RopeScaling]:
    """One layer type's rotary base and scaling ("default", or Gemma 4's "proportional")."""
    if kind not in rope:
        fields.refuse("rope_parameters", rope, f"give the {kind} layers' rotary setting")
    setting = dict(rope[kind])
    rope_type = setting.pop("rope_type", "default")
    theta = setting.pop("rope_theta", None)
    if theta is None:
        fields.refuse("rope_parameters", rope, f"the {kind} layers' setting names no rope_theta")
    if rope_type == "default":
        fraction, factor = setting.pop("partial_rotary_factor", 1.0), 1.0
    elif rope_type == "proportional":
        fraction, factor = setting.pop("partial_rotary_factor", 1.0), setting.pop("factor", 1.0)
    else:
        fields.refuse("rope_parameters", rope, f"{kind} rope_type {rope_type!r} is not built for DiffusionGemma "
                      "(Dew builds 'default' and 'proportional')")
    if rope_type == "default" and fraction != 1.0:
        # transformers' default rope for this model shortens the table instead; no released checkpoint does this
        fields.refuse("rope_parameters", rope, f"{kind} 'default' rope with partial_rotary_factor {fraction} is not "
                      "built; use 'proportional'")
    if setting:
        fields.refuse("rope_parameters", rope, f"{kind} keys {sorted(setting)} are not read for rope_type {rope_type!r}")
    if rope_type == "default":
        return float(theta), RopeScaling()
    try:
        return float(theta), RopeScaling("proportional", float(factor), rotated_fraction=float(fraction))
    except ValueError as error:
        fields.refuse("rope_parameters", rope, str(error))


# ---- tensors ------------------------------------------------------------------------------------

_LINEAR = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj", "mlp/gate_proj",
           "mlp/up_proj", "mlp/down_proj", "router/proj")
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2",
          "self_attn/q_norm", "self_attn/k_norm")
_SELF_CONDITIONING = ("gate_proj", "up_proj", "down_proj")


def tensor_names(config: DiffusionGemmaConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each checkpoint tensor of the text model: its collection and path in Dew's variables (the experts'
    fused `gate_up_proj` maps to the pair `experts/gate_proj` and `experts/up_proj`)."""
    names: dict[str, tuple[str, tuple[str, ...]]] = {
        f"{_SHARED}.embed_tokens.weight": ("params", ("embed_tokens", "embedding")),
        f"{_SHARED}.norm.weight": ("params", ("norm", "scale")),
        f"{_SHARED}.self_conditioning.pre_norm.weight": ("params", ("self_conditioning", "pre_norm", "scale")),
    }
    for name in _SELF_CONDITIONING:
        names[f"{_SHARED}.self_conditioning.{name}.weight"] = ("params", ("self_conditioning", "mlp", name, "kernel"))
    for i, kind in enumerate(config.layer_types):
        scope, layer = f"layers_{i}", f"{_SHARED}.layers.{i}"
        for path in _LINEAR:
            if path == "self_attn/v_proj" and kind == FULL:
                continue
            names[f"{layer}.{path.replace('/', '.')}.weight"] = ("params", (scope, *path.split("/"), "kernel"))
        for path in _NORMS:
            names[f"{layer}.{path.replace('/', '.')}.weight"] = ("params", (scope, *path.split("/"), "scale"))
        names[f"{layer}.router.scale"] = ("params", (scope, "router", "scale"))
        names[f"{layer}.router.per_expert_scale"] = ("params", (scope, "router", "per_expert_scale"))
        names[f"{layer}.experts.gate_up_proj"] = ("params", (scope, "experts", "gate_up_proj"))
        names[f"{layer}.experts.down_proj"] = ("params", (scope, "experts", "down_proj"))
        names[f"{layer}.layer_scalar"] = (CONSTANTS, (scope, "decoder_layer_scalar"))
        names[f"{_ENCODER}.layers.{i}.layer_scalar"] = (CONSTANTS, (scope, "encoder_layer_scalar"))
    return names


def _tied_copies(config: DiffusionGemmaConfig) -> dict[str, str]:
    """Tensors a checkpoint may also hold as copies of shared ones (the tied encoder and head): name to source."""
    copies = {"lm_head.weight": f"{_SHARED}.embed_tokens.weight",
              f"{_ENCODER}.embed_tokens.weight": f"{_SHARED}.embed_tokens.weight",
              f"{_ENCODER}.norm.weight": f"{_SHARED}.norm.weight"}
    for name in tensor_names(config):
        if name.startswith(f"{_SHARED}.layers.") and not name.endswith("layer_scalar"):
            copies[name.replace(_SHARED, _ENCODER, 1)] = name
    return copies


def _set(tree: dict, path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path):
    for key in path:
        tree = tree[key]
    return tree


def _vision_plan(config: DiffusionGemmaConfig, variables: Mapping) -> tensors.Plan:
    """The vision tower's and projector's tensor rules resolved against their part of `variables` (arrays or
    shapes, `params` and `constants` merged)."""
    from dew.interop.vision import projector_rules, tower_rules

    vision = config.vision
    rules = (*tower_rules(vision.tower_kind, vision.tower, _TOWER_PREFIX, "tower/"),
             *projector_rules(vision.projector_kind, vision.projector, _PROJECTOR_PREFIX, "projector/"))
    merged = merge_collections({name: variables[name] for name in ("params", CONSTANTS) if name in variables})
    return tensors.plan(rules, {name: merged[name] for name in ("tower", "projector")}, "DiffusionGemma's vision side")


def _vision_shapes(config: DiffusionGemmaConfig) -> dict:
    """The shapes of the vision side's variables, by collection, as the model builds them."""
    built = _built_shapes(DiffusionGemma(dataclasses.replace(config, trainable_scalars=False)))
    return {name: {part: built[name][part] for part in ("tower", "projector") if part in built[name]}
            for name in ("params", CONSTANTS)}


def read_variables(reader, config: DiffusionGemmaConfig, where: str) -> dict:
    """The model's variables (`params`, `constants`, the vision side's among them) from a checkpoint reader,
    every name checked: a missing tensor, a shape that differs and an unknown tensor are refused."""
    names = tensor_names(config)
    copies = _tied_copies(config)
    vision_shapes = _vision_shapes(config)
    vision = _vision_plan(config, vision_shapes)
    present = set(reader.names())
    missing = sorted((set(names) | set(vision.tensors)) - present)
    if missing:
        raise ValueError(f"{where} lacks {len(missing)} DiffusionGemma tensor(s) config.json asks for, such as "
                         f"{missing[:4]}: the weights and config.json come from different models")
    extra = sorted(present - set(names) - set(copies) - set(vision.tensors))
    if extra:
        raise ValueError(f"{where} holds {len(extra)} tensor(s) this DiffusionGemma has no place for, such as "
                         f"{extra[:4]}: the weights and config.json come from different models")
    for name, shape in vision.tensors.items():
        _check(name, reader.shape(name), shape)
    dtype = np.dtype(config.param_dtype)
    read = {leaf.path: tensors.read_region(reader, leaf, None, leaf.dtype) for leaf in vision.leaves}
    variables = split_collections(traverse_util.unflatten_dict(read), vision_shapes)
    for name, (collection, path) in names.items():
        value = np.asarray(reader.read(name)).astype(dtype)
        if path[-1] == "kernel":
            value = value.T  # transformers' [out, in] weight as Dew's [in, out] kernel
        _place(variables[collection], path, value, config, name)
    for name, source in copies.items():
        if name in present and not np.array_equal(np.asarray(reader.read(name)), np.asarray(reader.read(source))):
            raise ValueError(f"{where} holds {name} apart from {source}, which transformers ties it to; Dew builds the "
                             "tied model: this checkpoint was trained untied, which Dew does not build")
    return variables


def _place(tree: dict, path, value: np.ndarray, config: DiffusionGemmaConfig, name: str) -> None:
    E, F, D = config.experts, config.expert_features, config.emb_features
    if path[-1] == "gate_up_proj":
        _check(name, value.shape, (E, 2 * F, D))
        _set(tree, path[:-1] + ("gate_proj",), np.ascontiguousarray(value[:, :F, :].transpose(0, 2, 1)))
        _set(tree, path[:-1] + ("up_proj",), np.ascontiguousarray(value[:, F:, :].transpose(0, 2, 1)))
        return
    if path[-2:] == ("experts", "down_proj"):
        _check(name, value.shape, (E, D, F))
        value = np.ascontiguousarray(value.transpose(0, 2, 1))
    _set(tree, path, value)


def _check(name: str, have, want) -> None:
    if tuple(have) != tuple(want):
        raise ValueError(f"tensor {name!r} has shape {tuple(have)}; config.json asks for {tuple(want)}: the weights "
                         "and config.json come from different models")


def write_tensors(variables: Mapping, config: DiffusionGemmaConfig) -> list[tuple[str, int, Any]]:
    """`(name, nbytes, build)` for every checkpoint tensor of `variables` (the text model and the vision side),
    as `dew.interop.safetensors_files.write_checkpoint` takes them."""
    out = []
    for name, (collection, path) in tensor_names(config).items():
        tree = variables[collection]
        if path[-1] == "gate_up_proj":
            gate, up = (np.asarray(_get(tree, path[:-1] + (part,))) for part in ("gate_proj", "up_proj"))
            value = np.concatenate([gate.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=1)
        else:
            value = np.asarray(_get(tree, path))
            if path[-2:] == ("experts", "down_proj"):
                value = value.transpose(0, 2, 1)
            elif path[-1] == "kernel":
                value = value.T
        value = np.ascontiguousarray(value)
        out.append((name, value.nbytes, lambda value=value: value))
    vision = _vision_plan(config, variables)
    merged = merge_collections({name: variables[name] for name in ("params", CONSTANTS)})
    return out + tensors.export_tensors(vision, {name: merged[name] for name in ("tower", "projector")})


def processor(directory, config: DiffusionGemmaConfig) -> Processor:
    """The checkpoint's processor in `directory` (transformers' `Gemma4Processor`, from its processor_config.json and
    tokenizer), laying out prompts and their images as `DiffusionGemma.encode` reads them."""
    vision = config.vision
    return Processor(load_reference(directory), vision.image_token_id, None, config.vocab_size, vision)


@dataclasses.dataclass(frozen=True)
class BlockDiffusionConverter(Converter):
    """The registry entry for diffusion_gemma: its checkpoints load through `model_config` and
    `read_variables` into a `DiffusionGemma`, not into the causal decoder, so `family_for` never picks it."""

    writes_decoders: ClassVar[bool] = False

    def decoder_kwargs(self, source, where="config.json"):
        raise ValueError(f"{where} is a DiffusionGemma (block diffusion) checkpoint: it loads as "
                         "dew.nn.diffusion_gemma.DiffusionGemma through load_pretrained, not as a causal decoder")

    def differences(self, config) -> list[str]:
        return ["a causal decoder, not DiffusionGemma's encoder and canvas denoiser"]

    def ignorable(self, name, config) -> bool:
        return False


# `fields` holds the text config's fields beside the outer ones: `reads` answers for either record.
DIFFUSION_GEMMA = BlockDiffusionConverter(MODEL_TYPE, "DiffusionGemmaConfig", "DiffusionGemmaForBlockDiffusion",
                                          {**TEXT_FIELDS, **OUTER_FIELDS}, ())


def config_text(config: Mapping[str, Any], dtype: str) -> str:
    """config.json's text for a save: the loaded config with its `dtype` set to the parameters'."""
    written = {key: value for key, value in config.items() if key != "torch_dtype"}
    written["dtype"] = dtype
    return json.dumps(written, indent=2, sort_keys=True) + "\n"


@kept(maxsize=4)
def _built_shapes(model):
    """The variables `model` (a `DiffusionGemma`) builds, as shapes: traced once a model (equal modules are
    the same model; an unhashable one each time), as a process that loads one checkpoint several times asks
    each time."""
    import jax
    import jax.numpy as jnp
    from flax.core import meta

    tokens = jnp.zeros((1, 1), jnp.int32)
    canvas = jnp.zeros((1, model.config.canvas_length), jnp.int32)
    return meta.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, canvas)))


def check_shapes(model, variables: Mapping, where: str) -> None:
    """Refuse variables whose tree or shapes differ from what `model` (a `DiffusionGemma`) builds."""
    import jax

    want = _built_shapes(model)
    for collection in ("params", CONSTANTS):
        have_leaves = dict(jax.tree_util.tree_leaves_with_path(variables[collection]))
        for path, spec in jax.tree_util.tree_leaves_with_path(want[collection]):
            if path not in have_leaves:
                raise ValueError(f"{where}: no tensor reached {collection}{jax.tree_util.keystr(path)}")
            if tuple(have_leaves[path].shape) != tuple(spec.shape):
                raise ValueError(f"{where}: {collection}{jax.tree_util.keystr(path)} has shape "
                                 f"{tuple(have_leaves[path].shape)}; config.json asks for {tuple(spec.shape)}: the "
                                 "weights and config.json come from different models")
