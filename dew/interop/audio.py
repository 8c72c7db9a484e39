"""Checkpoint tensors of audio towers (`dew.nn.audio`) as Dew variables, and back.

`audio_rules` gives the `dew.interop.tensors.Rule`s of one tower: Dew paths into its variables,
collection first (`params/conformer/layers/...`; Gemma 4's clipping bounds live in `constants`), under
`dew_prefix` for a model that holds the tower as a submodule; tensor names as transformers writes them,
under the checkpoint's `prefix` (`AUDIO_PREFIXES` lists where a multimodal checkpoint keeps the tower;
`audio_prefix` finds the one it uses). `audio_weights` reads a tower's variables from a mapping of
tensors, refusing a missing or unread one by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

import jax
import numpy as np
from flax import linen as nn
from flax import traverse_util

from dew.interop import tensors
from dew.interop.tensors import Rule
from dew.nn.audio import CONSTANTS, Gemma3nAudio, Gemma4Audio, audio_class

_KERNEL = (1, 0)  # transformers stores a projection [out, in], Dew keeps it [in, out]
_CONV2D = (2, 3, 1, 0)  # torch's Conv2d weight [out, in, kh, kw], Dew's HWIO kernel [kh, kw, in, out]
_DEPTHWISE = (2, 1, 0)  # torch's depthwise Conv1d weight [channels, 1, K], Dew's [K, 1, channels]

AUDIO_PREFIXES = {kind: ("model.audio_tower.", "audio_tower.") for kind in ("gemma3n_audio", "gemma4_audio")}
_ANCHOR = {kind: "subsample_conv_projection.input_proj_linear.weight" for kind in AUDIO_PREFIXES}
_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _linear(dew: str, tensor: str) -> Rule:
    return Rule(f"params/{dew}/kernel", f"{tensor}.weight", transpose=_KERNEL)


def _norm(dew: str, tensor: str) -> Rule:
    return Rule(f"params/{dew}/scale", f"{tensor}.weight")


def _subsampling(dew: str, tensor: str, blocks: tuple[str, str]) -> tuple[Rule, ...]:
    """Both subsampling blocks' convolutions and norms, and the input projection."""
    return (*(rule for block in blocks for rule in (
        Rule(f"params/{dew}/{block}/conv/kernel", f"{tensor}.{block}.conv.weight", transpose=_CONV2D),
        _norm(f"{dew}/{block}/norm", f"{tensor}.{block}.norm"))),
        _linear(f"{dew}/input_proj_linear", f"{tensor}.input_proj_linear"))


def _light_convolution(dew: str, tensor: str, projection) -> tuple[Rule, ...]:
    """A conformer layer's `lconv1d`, its two projections' rules from `projection(dew, tensor)`."""
    return (_norm(f"{dew}/pre_layer_norm", f"{tensor}.pre_layer_norm"),
            *projection(f"{dew}/linear_start", f"{tensor}.linear_start"),
            Rule(f"params/{dew}/depthwise_conv1d/kernel", f"{tensor}.depthwise_conv1d.weight", transpose=_DEPTHWISE),
            _norm(f"{dew}/conv_norm", f"{tensor}.conv_norm"),
            *projection(f"{dew}/linear_end", f"{tensor}.linear_end"))


def _gemma3n_rules(config: Gemma3nAudio, prefix: str) -> tuple[Rule, ...]:
    sub, layer = f"{prefix}subsample_conv_projection", f"{prefix}conformer.{{layer}}"
    linear, norm = _linear, _norm
    feed_forwards = [rule for ffw in ("ffw_layer_start", "ffw_layer_end") for rule in (
        norm(f"conformer/layers/{ffw}/pre_layer_norm", f"{layer}.{ffw}.pre_layer_norm"),
        linear(f"conformer/layers/{ffw}/ffw_layer_1", f"{layer}.{ffw}.ffw_layer_1"),
        linear(f"conformer/layers/{ffw}/ffw_layer_2", f"{layer}.{ffw}.ffw_layer_2"),
        norm(f"conformer/layers/{ffw}/post_layer_norm", f"{layer}.{ffw}.post_layer_norm"))]
    attention, attn = "conformer/layers/attention", f"{layer}.attention"
    return (
        *_subsampling("subsample_conv_projection", sub, ("conv_0", "conv_1")),
        *feed_forwards,
        norm(f"{attention}/pre_attn_norm", f"{attn}.pre_attn_norm"),
        *(linear(f"{attention}/attn/{proj}", f"{attn}.attn.{proj}") for proj in ("q_proj", "k_proj", "v_proj")),
        Rule(f"params/{attention}/attn/per_dim_scale", f"{attn}.attn.per_dim_scale"),
        linear(f"{attention}/attn/relative_position_embedding/pos_proj",
               f"{attn}.attn.relative_position_embedding.pos_proj"),
        linear(f"{attention}/post", f"{attn}.post"),
        norm(f"{attention}/post_norm", f"{attn}.post_norm"),
        *_light_convolution("conformer/layers/lconv1d", f"{layer}.lconv1d", lambda *names: (linear(*names),)),
        norm("conformer/layers/norm", f"{layer}.norm"),
    )


def _gemma4_rules(config: Gemma4Audio, prefix: str) -> tuple[Rule, ...]:
    sub, layer = f"{prefix}subsample_conv_projection", f"{prefix}layers.{{layer}}"

    def clippable(dew: str, tensor: str) -> tuple[Rule, ...]:
        bounds = _BOUNDS if config.use_clipped_linears else ()
        return (_linear(f"{dew}/linear", f"{tensor}.linear"),
                *(Rule(f"{CONSTANTS}/{dew}/{bound}", f"{tensor}.{bound}", infinities=True) for bound in bounds))

    feed_forwards = [rule for ffw in ("feed_forward1", "feed_forward2") for rule in (
        _norm(f"layers/{ffw}/pre_layer_norm", f"{layer}.{ffw}.pre_layer_norm"),
        *clippable(f"layers/{ffw}/ffw_layer_1", f"{layer}.{ffw}.ffw_layer_1"),
        *clippable(f"layers/{ffw}/ffw_layer_2", f"{layer}.{ffw}.ffw_layer_2"),
        _norm(f"layers/{ffw}/post_layer_norm", f"{layer}.{ffw}.post_layer_norm"))]
    return (
        *_subsampling("subsample_conv_projection", sub, ("layer0", "layer1")),
        *feed_forwards,
        *(rule for proj in ("q_proj", "k_proj", "v_proj", "post")
          for rule in clippable(f"layers/self_attn/{proj}", f"{layer}.self_attn.{proj}")),
        Rule("params/layers/self_attn/per_dim_scale", f"{layer}.self_attn.per_dim_scale"),
        _linear("layers/self_attn/relative_k_proj", f"{layer}.self_attn.relative_k_proj"),
        *(_norm(f"layers/{norm}", f"{layer}.{norm}") for norm in ("norm_pre_attn", "norm_post_attn", "norm_out")),
        *_light_convolution("layers/lconv1d", f"{layer}.lconv1d", clippable),
        _linear("output_proj", f"{prefix}output_proj"),
        Rule("params/output_proj/bias", f"{prefix}output_proj.bias"),
    )


_RULES = {"gemma3n_audio": _gemma3n_rules, "gemma4_audio": _gemma4_rules}


def audio_rules(kind: str, config, prefix: str = "", dew_prefix: str = "") -> tuple[Rule, ...]:
    """The rules between audio tower `kind`'s tensors under `prefix` (`"model.audio_tower."`) and its
    variables, each Dew path `collection/dew_prefix...` (`dew_prefix` `""`: the tower's own tree;
    `"audio_tower/"`: a model's)."""
    config_class = audio_class(kind)
    if not isinstance(config, config_class):
        raise TypeError(f"rules of {kind!r} are made from a {config_class.__name__}, not a {type(config).__name__}")
    if dew_prefix and not dew_prefix.endswith("/"):
        raise ValueError(f"dew_prefix {dew_prefix!r} must name a scope and end with '/', as 'audio_tower/' does")
    nest = lambda path: path.replace("/", f"/{dew_prefix}", 1)
    return tuple(dataclasses.replace(rule, dew=tuple(map(nest, rule.dew))) for rule in _RULES[kind](config, prefix))


def audio_prefix(kind: str, names: Collection[str], where: str) -> str:
    """The prefix under which the checkpoint tensors `names` hold audio tower `kind` (`where` names the
    checkpoint in errors): `""` for a tower saved alone, else one of `AUDIO_PREFIXES[kind]`."""
    audio_class(kind)
    found = [prefix for prefix in ("", *AUDIO_PREFIXES[kind]) if prefix + _ANCHOR[kind] in names]
    if len(found) != 1:
        held = "none of them" if not found else f"each of {found}"
        raise ValueError(f"{where} holds an audio tower ({kind}) under {held}: Dew looks for {_ANCHOR[kind]!r} "
                         f"alone or under one of {list(AUDIO_PREFIXES[kind])}; a checkpoint holds exactly one")
    return found[0]


class _Arrays:
    """A mapping of tensors read the way checkpoint readers are (`dew.interop.tensors.read_region`)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays
        self.location = {}

    def names(self):
        return list(self.arrays)

    def shape(self, name):
        return tuple(self.arrays[name].shape)

    def dtype(self, name):
        return str(np.asarray(self.arrays[name]).dtype)

    def read(self, name, index=()):
        return np.asarray(self.arrays[name])[index]


def audio_weights(kind: str, config, arrays: Mapping[str, np.ndarray], prefix: str | None = None,
                  dtype=np.float32) -> dict:
    """Tower `kind`'s variables (`{"params": ...}`, and `"constants"` where it has them) from checkpoint
    tensors `arrays` (name to array, transformers' names; torch tensors converted by the caller), stored in
    `dtype`. The tower's tensors sit under `prefix` (found with `audio_prefix` when None); every one of them
    must be read, and tensors outside the prefix are left alone."""
    if prefix is None:
        prefix = audio_prefix(kind, arrays, "the tensors given")
    rules = audio_rules(kind, config, prefix)  # checks the config's class
    shapes = nn.unbox(jax.eval_shape(config.build(param_dtype=dtype).init, jax.random.key(0), *_smallest_input(config)))
    plan = tensors.plan(rules, shapes, family=kind)
    missing = sorted(set(plan.tensors) - set(arrays))
    if missing:
        raise ValueError(f"the {kind} tower needs the tensors {missing[:5]} ({len(missing)} in all), which are not "
                         f"among those given: the checkpoint holds another tower or another prefix than {prefix!r}")
    unread = sorted({name for name in arrays if name.startswith(prefix)} - set(plan.tensors))
    if unread:
        raise ValueError(f"the {kind} tower's tensors {unread[:5]} ({len(unread)} in all) have no place in Dew's "
                         "tower: the checkpoint was saved from another configuration of it")
    for name, shape in plan.tensors.items():
        if tuple(np.shape(arrays[name])) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(np.shape(arrays[name]))}; this {kind} config makes it "
                             f"{tuple(shape)}: the audio_config record does not describe these weights")
    reader = _Arrays(arrays)
    flat = {leaf.path: np.asarray(tensors.read_region(reader, leaf, None, dtype)) for leaf in plan.leaves}
    return traverse_util.unflatten_dict(flat)


def _smallest_input(config):
    """The frames of one clip long enough for every subsampling step, and its mask."""
    features = config.mel_features or 128
    frames = 4 * config.frame_stride
    return np.zeros((1, frames, features), np.float32), np.ones((1, frames), bool)


__all__ = ["AUDIO_PREFIXES", "audio_prefix", "audio_rules", "audio_weights"]
