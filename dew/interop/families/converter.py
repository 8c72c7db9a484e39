"""`Converter`: one transformers decoder family, both ways: config.json to `DecoderConfig` and back,
and its tensor rules for safetensors and GGUF, in and out.

A family module builds a `Converter` from tables: the fields its transformers config class declares
(with transformers' defaults), the Dew knobs the family fixes, how it reads a sliding window and
rotary settings, its tensor rules (`dew.interop.tensors.Rule`) and, where llama.cpp writes the
family, its GGUF names (`GGUFNames`). A family whose reading differs from these tables overrides
the method that reads it (Qwen's window switches, Gemma's older activation name). The field
discipline and rotary parameters are shared, in `dew.interop.hf_decoders`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar

from dew.interop.hf_decoders import (
    ACTIVATION_NAMES, ACTIVATIONS, FIELD_KINDS, MASK_FIELDS, ConfigFields, read_rotary, rope_parameters,
)
from dew.interop.tensors import Rule
from dew.nn.layer import LayerSpec
from dew.nn.transformer import FULL, SLIDING, DecoderConfig

# The DecoderConfig fields a config.json does not decide: numerics and program shape.
_RUNTIME = ("dtype", "param_dtype", "scan_layers", "remat", "kernels", "attention")
# The DecoderConfig fields outside the layer specs that change what the model computes.
_GLOBAL = ("vocab_size", "emb_features", "num_layers", "max_seq_len", "tie_embeddings", "logit_softcap", "norm_eps",
           "norm_style", "scale_embeddings", "attention_dropout", "mtp_depths", "embedding_scale", "logit_divisor")


@dataclasses.dataclass(frozen=True)
class GGUFNames:
    """How llama.cpp writes a family: its `architecture` name (`general.architecture`), the GGUF name of
    each checkpoint tensor name template (`names`), the config.json field each metadata key gives
    (`metadata`, keys after the `{architecture}.` prefix), and whether it stores the query and key rows
    interleaved per head for its rotary layout (`permuted`, llama's), the config.json fields
    llama.cpp's graph fixes for the architecture rather than reading them from the file (`fixed`), and
    the metadata keys llama.cpp's converter writes with one value whatever the model, which tell a reader
    nothing (`constants`: Mamba2's `attention.head_count` 0). `dew.interop.gguf_files` reads the file
    through these; `dew.interop.gguf_out` writes it."""

    architecture: str
    names: Mapping[str, str]
    metadata: Mapping[str, str]
    permuted: bool = False
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    constants: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def attends(self) -> bool:
        """Whether the family's layers attend, so llama.cpp's head counts, key lengths and rotary keys apply."""
        return "attention.head_count" in self.metadata


@dataclasses.dataclass(frozen=True)
class Converter:
    """One transformers decoder family (see the module).

    `window` says how the family reads a sliding window: "none" (attends to every key), "all"
    (Mistral: every layer) or "layer_types" (per-layer types, with `default_pattern(source, layers)`
    when the config has none); a subclass reads other switches by overriding `layer_types`.
    `rope_thetas` are the full and sliding layers' defaults when the config names no theta. With
    `rope_by_layer_type` (Gemma 3, OLMo 3) each layer type has its own rotary setting:
    `rope_parameters` is nested by type, the older `rope_scaling` applies to full layers only, and
    sliding layers take the older theta from `sliding_theta_field` (None: the family default).
    `getattr_fields` are the fields the modeling code reads with getattr although `config_class` does
    not declare them, each with the default getattr falls back to. `architecture` is the causal-LM
    class config.json's `architectures` names. A family with `partial_rotary` turns only the first
    `partial_rotary_factor` of each head's features under the default rotary, `partial_rotary` when the
    config names none (None: every feature turns, and a config naming less is refused). `field_kinds`
    overrides `FIELD_KINDS` for fields its class annotates otherwise (Gemma 4's string
    `use_bidirectional_attention`).
    """

    # whether `family_for` may pick this family for a `DecoderConfig` (False: it loads its own model kind)
    writes_decoders: ClassVar[bool] = True

    model_type: str
    config_class: str
    architecture: str
    fields: Mapping[str, Any]
    rules: tuple[Rule, ...]
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    window: str = "none"
    default_pattern: Callable[[Mapping, int], list[str]] | None = None
    rope_thetas: tuple[float, float] = (10000.0, 10000.0)
    activation_field: str = "hidden_act"
    rope_by_layer_type: bool = False
    sliding_theta_field: str | None = None
    legacy_fields: frozenset[str] = frozenset()
    getattr_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gguf: GGUFNames | None = None
    partial_rotary: float | None = None
    field_kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def field_kind(self, name: str) -> str | None:
        """The kind of value (`dew.interop.hf_decoders.FIELD_KINDS`) this family's config class takes for `name`:
        its own `field_kinds` where the class annotates a field another way than the other families'."""
        return self.field_kinds.get(name, FIELD_KINDS.get(name))

    def reads(self, name: str) -> bool:
        """Whether transformers reads `name` from this family's config (declared or through getattr)."""
        return name in self.fields or name in self.getattr_fields or name in MASK_FIELDS

    # ---- config.json in ------------------------------------------------------------------------

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        """`DecoderConfig` keyword arguments (without dtypes) for a config.json of this family."""
        fields = ConfigFields(source, self, where)
        heads, hidden = fields.get("num_attention_heads"), fields.get("hidden_size")
        head_dim = fields.get("head_dim") if self.reads("head_dim") else None
        kwargs = dict(self.knobs)
        kwargs.update(
            vocab_size=fields.get("vocab_size"), emb_features=hidden, num_layers=fields.get("num_hidden_layers"),
            num_heads=heads, num_kv_heads=fields.get("num_key_value_heads") or heads,
            head_dim=head_dim or hidden // heads,
            mlp_features=fields.get("intermediate_size") if self.reads("intermediate_size") else None,
            max_seq_len=fields.get("max_position_embeddings"), norm_eps=fields.get("rms_norm_eps"),
            tie_embeddings=bool(fields.get("tie_word_embeddings")),
        )
        activation = self.activation(fields)
        if activation not in ACTIVATIONS:
            fields.refuse(self.activation_field, activation, f"the MLP activations Dew has are {sorted(ACTIVATIONS)}")
        kwargs["activation"] = ACTIVATIONS[activation]
        # a training-only rate: recorded for training to refuse, nothing at inference
        kwargs["attention_dropout"] = float(fields.get("attention_dropout") or 0.0)
        fields.require("is_causal", (True,), "attention that sees later tokens (a bidirectional encoder) is not "
                       "built in Dew; set it to true for the causal decoder")
        if "attention_bias" in self.fields and fields.get("attention_bias"):
            kwargs.update(qkv_bias=True, o_bias=True)
        if "mlp_bias" in self.fields:
            kwargs["mlp_bias"] = bool(fields.get("mlp_bias"))
        if "use_bidirectional_attention" in self.fields:
            fields.require("use_bidirectional_attention", (None, False),
                           "bidirectional Gemma (an encoder) is not built in Dew; set it to false for the causal "
                           "decoder")
        if "query_pre_attn_scalar" in self.fields:
            kwargs["query_scale"] = float(fields.get("query_pre_attn_scalar")) ** -0.5
        if "attn_logit_softcapping" in self.fields:
            kwargs["attn_softcap"] = fields.get("attn_logit_softcapping")
            kwargs["logit_softcap"] = fields.get("final_logit_softcapping")
        layer_types = self._read_window(fields, kwargs)
        fields.check_window_switches(kwargs.get("sliding_window"))
        ropes = read_rotary(fields, kwargs["max_seq_len"])
        for _, scaling in ropes.values():
            if scaling.kind == "default" and scaling.rotated_fraction != 1.0 and self.partial_rotary is None:
                name = "partial_rotary_factor" if "partial_rotary_factor" in fields.source else "rope_parameters"
                fields.refuse(name, fields.source.get(name), f"transformers' {self.config_class} rotates every feature "
                              f"of a head (partial_rotary_factor {scaling.rotated_fraction} is read by Qwen3-Next's "
                              "attention, not this family's): remove it")
        kwargs["rope_theta"], kwargs["rope_scaling"] = ropes[FULL]
        if ropes[SLIDING] != ropes[FULL] and SLIDING in (layer_types or ()):
            if "layer_types" not in kwargs:
                fields.refuse("sliding_window", None, "its sliding layers rotate with their own rotary setting, and "
                              "Dew tells them apart only with a window: give the window the model was trained with")
            (theta, scaling), (full_theta, full_scaling) = ropes[SLIDING], ropes[FULL]
            if theta != full_theta:
                kwargs["local_rope_theta"] = theta
            if scaling != full_scaling:
                kwargs["local_rope_scaling"] = scaling
        self.read_family_fields(fields, kwargs)
        fields.finish()
        return kwargs

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        """Read into `kwargs` the fields the tables above do not cover (a mixture of experts' fields,
        in `dew.interop.families.experts`); a plain family has none."""

    def activation(self, fields: ConfigFields) -> str:
        """The config's MLP activation name, as transformers reads it."""
        return fields.get(self.activation_field)

    def layer_types(self, fields: ConfigFields, layers: int) -> tuple[int | None, list[str] | None]:
        """The sliding window the config applies and the type transformers gives each layer (None
        where the family has no types), windowed or not."""
        if self.window == "none":
            return None, None
        window = fields.get("sliding_window")
        if self.window == "all":
            return window, None
        return window, list(fields.get("layer_types") or self.default_pattern(fields.source, layers))

    def _read_window(self, fields: ConfigFields, kwargs: dict) -> list[str] | None:
        window, layer_types = self.layer_types(fields, kwargs["num_layers"])
        if layer_types is None:
            if self.window == "all":
                kwargs["sliding_window"] = window
        elif window is not None and SLIDING in layer_types:
            # transformers' sliding layers attend to every key when the config has no window
            kwargs.update(sliding_window=window, layer_types=tuple(layer_types))
        return layer_types

    # ---- config.json out -----------------------------------------------------------------------

    def to_hf_config(self, config: DecoderConfig) -> dict[str, Any]:
        """The transformers config.json (without `dtype`) of a model this family computes exactly;
        a config it does not compute is refused, naming what differs."""
        differences = self.differences(config)
        if differences:
            raise ValueError(f"transformers' {self.config_class} does not compute this model: "
                             f"{'; '.join(differences)}")
        return self.written(config)

    def differences(self, config: DecoderConfig) -> list[str]:
        """What this family's transformers model would compute differently from `config` (empty when
        it computes exactly this model): its config.json for `config`, read back, compared."""
        try:
            back = DecoderConfig(**self.decoder_kwargs(self.written(config), where=f"{self.model_type} config"),
                                 **{name: getattr(config, name) for name in _RUNTIME})
        except ValueError as error:
            return [str(error)]
        return _differences(config, back)

    def read_differences(self, config: DecoderConfig, source: Mapping[str, Any], names: Collection[str],
                         where: str) -> list[str]:
        """What a checkpoint of this family whose config.json is `source` and whose tensors are `names` (a GGUF
        file's, as its reader gives them) computes differently from `config`; empty when it is this model."""
        try:
            kwargs = self.fit_to_weights(self.decoder_kwargs(source, where=where), names)
            back = DecoderConfig(**kwargs, **{name: getattr(config, name) for name in _RUNTIME})
        except ValueError as error:
            return [str(error)]
        return _differences(config, back)

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        """config.json for `config`, written field by field; `differences` says whether it computes
        the same model."""
        c = config
        written = {
            "model_type": self.model_type, "architectures": [self.architecture], "vocab_size": c.vocab_size,
            "hidden_size": c.emb_features, "intermediate_size": c.mlp_features, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": c.tie_embeddings, self.activation_field: ACTIVATION_NAMES[c.activation],
            "attention_dropout": c.attention_dropout,
        }
        if self.reads("head_dim"):
            written["head_dim"] = c.head_dim
        if "attention_bias" in self.fields:
            written["attention_bias"] = c.qkv_bias and c.o_bias
        if "mlp_bias" in self.fields:
            written["mlp_bias"] = c.mlp_bias
        if "query_pre_attn_scalar" in self.fields:
            written["query_pre_attn_scalar"] = _query_pre_attn_scalar(c)
        if "attn_logit_softcapping" in self.fields:
            written.update(attn_logit_softcapping=c.attn_softcap, final_logit_softcapping=c.logit_softcap)
        self.write_window(c, written)
        full = rope_parameters(c.rope_theta, c.rope_scaling)
        if self.rope_by_layer_type:
            local = rope_parameters(c.local_rope_theta or c.rope_theta, c.local_rope_scaling or c.rope_scaling)
            written["rope_parameters"] = {FULL: full, SLIDING: local}
        else:
            written["rope_parameters"] = full
        return written

    def write_window(self, config: DecoderConfig, written: dict) -> None:
        """Put the model's windows into `written` the way this family reads them."""
        if self.window == "all":
            written["sliding_window"] = config.sliding_window
        elif self.window == "layer_types":
            written["sliding_window"] = config.sliding_window
            written["layer_types"] = layer_types_of(config)

    # ---- tensors -------------------------------------------------------------------------------

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        """The rules between this family's checkpoint tensors and Dew's parameters for `config`: the
        names it writes, or, given the `names` a checkpoint holds, the layout they are in (a family that
        has more than one on disk reads each)."""
        return self.rules

    def fit_to_weights(self, kwargs: dict[str, Any], names) -> dict[str, Any]:
        """`decoder_kwargs` adjusted to what the checkpoint's tensor `names` hold (optional modules its
        config names but its weights lack); as they are for most families."""
        return kwargs

    def ignorable(self, name: str, config: DecoderConfig) -> bool:
        """Tensors a checkpoint may hold that transformers drops too: rotary buffers, a tied head's copy."""
        return name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")

    def gguf_fields(self, config: DecoderConfig) -> dict[str, Any]:
        """The values `GGUFNames.metadata` writes for `config`, by field: its config.json's and its rotary base."""
        return {**self.written(config), "rope_theta": config.rope_theta}

    def gguf_config(self, fields: dict[str, Any], where: str) -> dict[str, Any]:
        """config.json's fields from those a GGUF file's `GGUFNames.metadata` gives (`gguf_fields` read
        back); the same fields for a family whose metadata names each one."""
        return fields

    def gguf_rules(self, config: DecoderConfig) -> tuple[Rule, ...]:
        """The tensor rules over llama.cpp's names, with its query and key rows un-permuted."""
        if self.gguf is None:
            raise ValueError(f"Dew reads no GGUF files of {self.model_type}: load its safetensors checkpoint")
        permute = {}
        if self.gguf.permuted:
            permute = {f"model.layers.{{layer}}.self_attn.{proj}.weight": heads
                       for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads))}
        # a rule llama.cpp has no name for (Gemma's extra norms) names a tensor its files never hold
        return tuple(rule.renamed(self.gguf.names, permute) for rule in self.tensor_rules(config)
                     if all(name in self.gguf.names for name in rule.tensor))


def layer_types_of(config: DecoderConfig) -> list[str]:
    """transformers' `layer_types` of a model: each layer sliding or full."""
    return [SLIDING if config.layer_window(i) is not None else FULL for i in range(config.num_layers)]


def _query_pre_attn_scalar(config: DecoderConfig) -> int:
    """transformers' `query_pre_attn_scalar`, an integer s whose `s ** -0.5` is the model's query scale."""
    if config.query_scale is None:
        return config.head_dim
    scalar = round(config.query_scale ** -2)
    if scalar < 1 or float(scalar) ** -0.5 != config.query_scale:
        raise ValueError(f"query_scale {config.query_scale} is not s ** -0.5 for a whole number s, and transformers' "
                         "query_pre_attn_scalar is one")
    return scalar


def _normal(spec: LayerSpec) -> LayerSpec:
    """A spec with `query_scale` None spelled as the `head_dim ** -0.5` it stands for."""
    mixer = spec.mixer
    if getattr(mixer, "query_scale", 0.0) is None:
        mixer = dataclasses.replace(mixer, query_scale=mixer.head_dim ** -0.5)
    return dataclasses.replace(spec, mixer=mixer)


_FEED_FORWARD_KINDS = {"DenseSpec": "a dense MLP", "SparseSpec": "a mixture of experts"}


def _differences(ours: DecoderConfig, theirs: DecoderConfig) -> list[str]:
    """Each computation two configs do differently, named: every layer whose feed-forward is of another
    kind (dense or a mixture), and the first layer that differs otherwise."""
    found = [f"{name} {getattr(ours, name)!r} (it computes {getattr(theirs, name)!r})"
             for name in _GLOBAL if getattr(ours, name) != getattr(theirs, name)]
    for index, (mine, its) in enumerate(zip(ours.layer_specs, theirs.layer_specs)):
        mine, its = _normal(mine), _normal(its)
        if mine == its:
            continue
        kinds = [_FEED_FORWARD_KINDS.get(type(spec.feed_forward).__name__) for spec in (mine, its)]
        if kinds[0] != kinds[1]:  # every such layer is named: each is a change the family cannot make
            found.append(f"layer {index} feed_forward {kinds[0]} (it computes {kinds[1]})")
            continue
        for part in ("mixer", "feed_forward", None):
            a, b = (getattr(mine, part), getattr(its, part)) if part else (mine, its)
            if a is None and b is None:  # neither layer has a feed-forward
                continue
            if type(a) is not type(b):
                found.append(f"layer {index} {part} {type(a).__name__} (it computes {type(b).__name__})")
                continue
            for field in dataclasses.fields(a):
                if field.name not in ("mixer", "feed_forward"):
                    found += _field_differences(f"layer {index} {field.name}", getattr(a, field.name),
                                                getattr(b, field.name))
        break
    return found


def _field_differences(name: str, ours, theirs) -> list[str]:
    """`name` and both values where they differ; within a dataclass of one type (a recurrent mixer's shape),
    each field that differs."""
    if ours == theirs:
        return []
    if dataclasses.is_dataclass(ours) and type(ours) is type(theirs):
        return [difference for field in dataclasses.fields(ours) for difference in
                _field_differences(f"{name}.{field.name}", getattr(ours, field.name), getattr(theirs, field.name))]
    return [f"{name} {ours!r} (it computes {theirs!r})"]
