"""Hugging Face decoder families: config.json to `DecoderConfig`, and tensor names to Dew parameter paths.

A family reads the fields its transformers config class declares (`Family.fields`, with
transformers' defaults), the fields transformers' modeling code reads with `getattr` although the class
does not declare them (`Family.getattr_fields`, and `_MASK_FIELDS` for every family), and the older
spellings transformers still converts on load (`torch_dtype`, `rope_theta`, `rope_scaling`). Any other
field is refused by name unless it is in `_INERT_FIELDS`, fields transformers neither declares nor
reads. A field whose value Dew cannot compute is refused by name too, with what would load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from dew.nn.rotary import SCALINGS, RopeScaling
from dew.nn.transformer import FULL, SLIDING, DecoderConfig

# Fields of transformers' PreTrainedConfig that say nothing about the decoder's numbers.
_BASE_FIELDS = frozenset({
    "architectures", "chunk_size_feed_forward", "id2label", "is_encoder_decoder", "label2id", "model_type",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
})
# Keys transformers pops from a config on load and never uses for the model (bookkeeping, and the
# generation parameters older versions saved in config.json; generation_config.json holds those).
_DROPPED_ON_LOAD = frozenset({
    "_name_or_path", "_commit_hash", "name_or_path", "output_attentions", "attn_implementation",
    "experts_implementation", "_attn_implementation_internal", "num_labels",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "epsilon_cutoff", "eta_cutoff", "encoder_repetition_penalty", "num_beam_groups",
    "diversity_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind",
})
# The older spellings transformers converts: the dtype and the rotary settings.
_LEGACY_FIELDS = frozenset({"torch_dtype", "rope_theta", "rope_scaling", "partial_rotary_factor"})

# Fields that change no computation, accepted with any value: transformers 4's PretrainedConfig declared the
# first group on every config (transformers 5 keeps them as plain attributes, and no family's modeling code
# reads them); the rest are what the Hub and tools write beside the model's fields.
_METADATA_FIELDS = frozenset({
    "add_cross_attention", "cross_attention_hidden_size", "decoder_start_token_id", "finetuning_task",
    "gradient_checkpointing", "is_decoder", "prefix", "sep_token_id", "task_specific_params", "tf_legacy_loss",
    "tie_encoder_decoder", "tokenizer_class", "torchscript", "use_bfloat16", "_attn_implementation_autoset",
    "pretraining_tp",  # transformers 4's Llama split its matmuls in that many slices: the same products
    "auto_map", "custom_pipelines",  # remote code the Hub offers; transformers runs the native class without it
    "unsloth_version", "unsloth_fixed",  # Unsloth's markers
    "transformers.js_config",  # SmolLM2: settings for transformers.js
    "is_llama_config",  # SmolLM2: nanotron's marker
    "cache_implementation",  # Gemma 2 and 3: a generation setting
})
# Fields transformers neither declares nor reads, accepted with the values listed, the ones that compute what
# transformers computes.
_INERT_FIELDS: dict[str, tuple] = {
    "pruned_heads": ({},),  # transformers 4's record of heads removed after training: none
    "rope_interleaved": (False,),  # SmolLM2: nanotron's rotary layout, false is transformers' own
    "use_mrope": (False,),  # Qwen2.5: multimodal rotary switched off
    "sliding_window": (None,),  # a windowless family's config naming no window
}
# Qwen's window switches, which other families never read: accepted where no window is in effect
# (use_sliding_window only when it says so too), refused where the family windows layers regardless.
_QWEN_WINDOW_FIELDS = ("use_sliding_window", "max_window_layers")

# Fields transformers' mask code (masking_utils.create_causal_mask and its sliding form) reads from every
# family's config with getattr, and the default it reads when the config lacks them.
_MASK_FIELDS = {"is_causal": True}
# What transformers' attention and rotary code read with getattr where the config class does not declare the
# field: `getattr(config, "head_dim", hidden_size // num_attention_heads)`; None stands for that quotient.
_HEAD_DIM_READ = {"head_dim": None}

# Declared fields that do not change what the decoder computes.
_NO_EFFECT = frozenset({"initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                        "pretraining_tp"})

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

_LLAMA_FIELDS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
}
_MISTRAL_FIELDS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    "rope_parameters": None, "sliding_window": 4096, "attention_dropout": 0.0,
}
_QWEN2_FIELDS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
    "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
    "layer_types": None, "attention_dropout": 0.0, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}
_GEMMA_FIELDS = {
    "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": None,
}
_GEMMA2_FIELDS = {
    **{k: v for k, v in _GEMMA_FIELDS.items() if k != "hidden_act"},
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}
_OLMO2_FIELDS = {
    "vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "use_cache": True, "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279,
    "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-5,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers decoder family: its config class's fields and the Dew knobs it fixes.

    `window` says how the family reads a sliding window: "none" (attends to every key), "all"
    (Mistral: every layer), "layer_types" (per-layer types, with `default_pattern` when the config
    has none) or "qwen" (`use_sliding_window` and `max_window_layers`). `rope_thetas` are the
    full and sliding layers' defaults when the config names no theta. With `rope_by_layer_type`
    (Gemma 3, OLMo 3) each layer type has its own rotary setting: `rope_parameters` is nested by
    type, the older `rope_scaling` applies to full layers only, and sliding layers take the older
    theta from `sliding_theta_field` (None: the family default). `getattr_fields` are the fields the
    family's modeling code reads with getattr although `config_class` does not declare them, each with
    the default getattr falls back to.
    """

    model_type: str
    config_class: str
    fields: Mapping[str, Any]
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    window: str = "none"
    default_pattern: Any = None
    rope_thetas: tuple[float, float] = (10000.0, 10000.0)
    activation_field: str = "hidden_act"
    rope_by_layer_type: bool = False
    sliding_theta_field: str | None = None
    legacy_fields: frozenset[str] = frozenset()
    getattr_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def reads(self, name: str) -> bool:
        """Whether transformers reads `name` from this family's config (declared or through getattr)."""
        return name in self.fields or name in self.getattr_fields or name in _MASK_FIELDS


def _gemma3_pattern(source: Mapping, layers: int) -> list[str]:
    every = source.get("sliding_window_pattern", 6)
    return [SLIDING if (i + 1) % every else FULL for i in range(layers)]


_GEMMA_KNOBS = dict(norm_style="gemma", scale_embeddings=True)
FAMILIES: dict[str, Family] = {family.model_type: family for family in [
    Family("llama", "LlamaConfig", _LLAMA_FIELDS),
    Family("mistral", "MistralConfig", _MISTRAL_FIELDS, window="all"),
    Family("ministral", "MinistralConfig", {**_MISTRAL_FIELDS, "layer_types": None}, window="layer_types",
           default_pattern=lambda source, layers: [SLIDING] * layers),
    Family("qwen2", "Qwen2Config", _QWEN2_FIELDS, dict(qkv_bias=True), window="qwen", getattr_fields=_HEAD_DIM_READ),
    Family("qwen3", "Qwen3Config", {**_QWEN2_FIELDS, "head_dim": 128, "attention_bias": False},
           dict(qk_norm=True), window="qwen"),
    Family("gemma", "GemmaConfig", _GEMMA_FIELDS, _GEMMA_KNOBS),
    Family("gemma2", "Gemma2Config", _GEMMA2_FIELDS, dict(_GEMMA_KNOBS, norm_placement="sandwich"),
           window="layer_types", default_pattern=lambda source, layers: [SLIDING if (i + 1) % 2 else FULL
                                                                        for i in range(layers)],
           activation_field="hidden_activation"),
    Family("gemma3_text", "Gemma3TextConfig",
           {**_GEMMA2_FIELDS, "vocab_size": 262208, "max_position_embeddings": 131072,
            "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False},
           dict(_GEMMA_KNOBS, norm_placement="sandwich", qk_norm=True), window="layer_types",
           default_pattern=_gemma3_pattern, rope_thetas=(1_000_000.0, 10_000.0), activation_field="hidden_activation",
           rope_by_layer_type=True, sliding_theta_field="rope_local_base_freq",
           legacy_fields=frozenset({"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"})),
    Family("olmo2", "Olmo2Config", _OLMO2_FIELDS, dict(norm_style="olmo", norm_placement="post", qk_norm=True,
                                                        qk_norm_scope="projection"), getattr_fields=_HEAD_DIM_READ),
    Family("olmo3", "Olmo3Config", {**_OLMO2_FIELDS, "sliding_window": 4096, "layer_types": None},
           dict(norm_style="olmo", norm_placement="post", qk_norm=True, qk_norm_scope="projection"),
           window="layer_types", default_pattern=lambda source, layers: [SLIDING if (i + 1) % 4 else FULL
                                                                        for i in range(layers)],
           rope_thetas=(500_000.0, 500_000.0), rope_by_layer_type=True, getattr_fields=_HEAD_DIM_READ),
]}


def family_of(source: Mapping[str, Any], where: str = "config.json") -> Family:
    """The family of a config.json, refusing an unknown or missing model_type by name."""
    model_type = source.get("model_type")
    if "quantization" in source:
        raise ValueError(f"{where} names 'quantization' {source['quantization']!r}: an MLX-quantized checkpoint, which "
                         "Dew does not read; load the float checkpoint it was made from")
    if "quantization_config" in source:
        method = (source["quantization_config"] or {}).get("quant_method")
        raise ValueError(f"{where} names quantization_config (quant_method {method!r}): quantized safetensors are not "
                         "built in Dew; load the float checkpoint, or a GGUF file with gguf_file=")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type is None:
        raise ValueError(f"{where} has no model_type: Dew loads transformers decoders whose config names one of "
                         f"{sorted(FAMILIES)}")
    raise ValueError(f"{where} names model_type {model_type!r}, which is not a Dew family: native families are "
                     f"{sorted(FAMILIES)} (loading other types through a verified mapping is not built yet)")


class _Fields:
    """A config's fields as one family reads them: declared and getattr-read ones with transformers' defaults."""

    def __init__(self, source: Mapping[str, Any], family: Family, where: str):
        self.source, self.family, self.where = source, family, where
        self.defaults = {**_MASK_FIELDS, **family.getattr_fields, **family.fields}
        self.unread = set(self.defaults)
        known = (set(self.defaults) | _BASE_FIELDS | _DROPPED_ON_LOAD | _LEGACY_FIELDS | _METADATA_FIELDS
                 | family.legacy_fields | {"dtype"})
        self.window_switches = {}  # Qwen's window fields in a family that does not read them
        for name, value in source.items():
            if name in known:
                continue
            if name in _QWEN_WINDOW_FIELDS:
                self.window_switches[name] = value
                continue
            if name == "hidden_act" and family.activation_field != "hidden_act":
                continue  # Gemma 2 and 3: the older spelling of hidden_activation, which is what transformers reads
            if name == "sliding_window" and value is not None:
                raise ValueError(
                    f"{where} names sliding_window {value} but transformers' {family.config_class} attends to "
                    f"every key: a checkpoint trained with a window is a Mistral (model_type 'mistral'); "
                    f"set sliding_window to null if the model was trained without one"
                )
            if value in _INERT_FIELDS.get(name, ()):
                continue
            raise ValueError(
                f"{where} field {name!r} = {value!r} is not a field of transformers' {family.config_class} and Dew "
                f"cannot compute it: remove it if the model was trained without it"
            )

    def get(self, name: str):
        self.unread.discard(name)
        value = self.source.get(name)
        return self.defaults[name] if value is None and name not in self.source else value

    def refuse(self, name: str, value, fix: str):
        raise ValueError(f"{self.where} field {name!r} = {value!r} is not something Dew computes for "
                         f"{self.family.model_type}: {fix}")

    def require(self, name: str, neutral: tuple, fix: str):
        value = self.get(name)
        if value not in neutral:
            self.refuse(name, value, fix)

    def check_window_switches(self, window: int | None):
        """Refuse Qwen's window fields in another family where they disagree with the window it computes."""
        for name, value in self.window_switches.items():
            if window is None and (name == "max_window_layers" or not value):
                continue
            applied = f"windows every sliding layer at {window}" if window is not None else "applies no window"
            raise ValueError(f"{self.where} field {name!r} = {value!r} is Qwen's window switch, which transformers' "
                             f"{self.family.config_class} never reads: it {applied}, so the checkpoint may have been "
                             f"trained otherwise; remove {name!r} if the model was trained as {self.family.model_type}")

    def finish(self):
        if self.unread - _NO_EFFECT:
            raise AssertionError(f"{self.family.model_type}: fields {sorted(self.unread - _NO_EFFECT)} are unread")


def decoder_kwargs(source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """`DecoderConfig` keyword arguments (without dtypes) for a transformers config.json's contents."""
    family = family_of(source, where)
    fields = _Fields(source, family, where)
    heads, hidden = fields.get("num_attention_heads"), fields.get("hidden_size")
    head_dim = fields.get("head_dim") if family.reads("head_dim") else None
    kwargs = dict(family.knobs)
    kwargs.update(
        vocab_size=fields.get("vocab_size"), emb_features=hidden, num_layers=fields.get("num_hidden_layers"),
        num_heads=heads, num_kv_heads=fields.get("num_key_value_heads") or heads,
        head_dim=head_dim or hidden // heads, mlp_features=fields.get("intermediate_size"),
        max_seq_len=fields.get("max_position_embeddings"), norm_eps=fields.get("rms_norm_eps"),
        tie_embeddings=bool(fields.get("tie_word_embeddings")),
    )
    activation = fields.get(family.activation_field)
    if family.model_type == "gemma" and activation == "gelu":
        activation = "gelu_pytorch_tanh"  # transformers reads Gemma's legacy "gelu" as the tanh form
    if activation not in _ACTIVATIONS:
        fields.refuse(family.activation_field, activation, f"the MLP activations Dew has are {sorted(_ACTIVATIONS)}")
    kwargs["activation"] = _ACTIVATIONS[activation]
    # a training-only rate: recorded for training to refuse, nothing at inference
    kwargs["attention_dropout"] = float(fields.get("attention_dropout") or 0.0)
    fields.require("is_causal", (True,), "attention that sees later tokens (a bidirectional encoder) is not built "
                   "in Dew; set it to true for the causal decoder")
    if "attention_bias" in family.fields and fields.get("attention_bias"):
        kwargs.update(qkv_bias=True, o_bias=True)
    if "mlp_bias" in family.fields:
        kwargs["mlp_bias"] = bool(fields.get("mlp_bias"))
    if "use_bidirectional_attention" in family.fields:
        fields.require("use_bidirectional_attention", (None, False),
                       "bidirectional Gemma (an encoder) is not built in Dew; set it to false for the causal decoder")
    if "query_pre_attn_scalar" in family.fields:
        kwargs["query_scale"] = float(fields.get("query_pre_attn_scalar")) ** -0.5
    if "attn_logit_softcapping" in family.fields:
        kwargs["attn_softcap"] = fields.get("attn_logit_softcapping")
        kwargs["logit_softcap"] = fields.get("final_logit_softcapping")
    layer_types = _read_window(fields, kwargs)
    fields.check_window_switches(kwargs.get("sliding_window"))
    ropes = _rotary(fields, kwargs["max_seq_len"])
    kwargs["rope_theta"], kwargs["rope_scaling"] = ropes[FULL]
    if ropes[SLIDING] != ropes[FULL] and SLIDING in (layer_types or ()):
        if "layer_types" not in kwargs:
            fields.refuse("sliding_window", None, "its sliding layers rotate with their own rotary setting, and Dew "
                          "tells them apart only with a window: give the window the model was trained with")
        (theta, scaling), (full_theta, full_scaling) = ropes[SLIDING], ropes[FULL]
        if theta != full_theta:
            kwargs["local_rope_theta"] = theta
        if scaling != full_scaling:
            kwargs["local_rope_scaling"] = scaling
    fields.finish()
    return kwargs


def _read_window(fields: _Fields, kwargs: dict) -> list[str] | None:
    """Set `sliding_window` and `layer_types` as the family applies them.

    Returns the type transformers gives each layer (None where the family has no types), windowed or not.
    """
    family, layers = fields.family, kwargs["num_layers"]
    if family.window == "none":
        return None
    window = fields.get("sliding_window")
    if family.window == "all":
        kwargs["sliding_window"] = window
        return None
    if family.window == "qwen":
        if not fields.get("use_sliding_window"):
            window = None
        first_sliding = fields.get("max_window_layers")
        layer_types = fields.get("layer_types") or [
            SLIDING if window is not None and i >= first_sliding else FULL for i in range(layers)
        ]
    else:
        layer_types = fields.get("layer_types") or family.default_pattern(fields.source, layers)
    # transformers' sliding layers attend to every key when the config has no window
    if window is not None and SLIDING in layer_types:
        kwargs.update(sliding_window=window, layer_types=tuple(layer_types))
    return list(layer_types)


# The rope_parameters keys each rotary scaling reads besides rope_type and rope_theta, as transformers
# names them, and the `RopeScaling` field each becomes.
_ROPE_KEYS = {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
              "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
              "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
              "attention_factor": "attention_factor", "truncate": "truncate"}
_ROPE_PARAMETERS = {kind: [key for key, field in _ROPE_KEYS.items() if field in reads]
                    for kind, reads in SCALINGS.items()}


def _rotary(fields: _Fields, max_seq_len: int) -> dict[str, tuple[float, RopeScaling]]:
    """The rotary base and scaling of full and sliding layers, from `rope_parameters` or the older
    `rope_theta` and `rope_scaling`, as the family's transformers config resolves them."""
    family, source = fields.family, fields.source
    parameters = fields.get("rope_parameters") or {}
    scaling = source.get("rope_scaling") or {}
    nested = any(key in parameters for key in (FULL, SLIDING))
    if family.rope_by_layer_type:
        if parameters and not nested:
            fields.refuse("rope_parameters", parameters, f"transformers' {family.config_class} reads one setting per "
                          f"layer type and ignores a flat one: nest it as {{{FULL!r}: {{...}}, {SLIDING!r}: {{...}}}}")
        by_type = {FULL: {**(parameters.get(FULL) or {}), **scaling}, SLIDING: dict(parameters.get(SLIDING) or {})}
        by_type[FULL].setdefault("rope_theta", source.get("rope_theta", family.rope_thetas[0]))
        sliding_theta = family.rope_thetas[1]
        if family.sliding_theta_field is not None:
            sliding_theta = source.get(family.sliding_theta_field, sliding_theta)
        by_type[SLIDING].setdefault("rope_theta", sliding_theta)
    else:
        if nested:
            fields.refuse("rope_parameters", parameters, f"transformers' {family.config_class} gives every layer one "
                          "rotary setting: write rope_parameters as one dict, not one per layer type")
        rope = dict(scaling or parameters)
        rope.setdefault("rope_theta", source.get("rope_theta", family.rope_thetas[0]))
        by_type = {FULL: rope, SLIDING: rope}
    partial = source.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        fields.refuse("partial_rotary_factor", partial, "Dew rotates every feature of a head")
    return {layer_type: _rope(fields, rope, max_seq_len) for layer_type, rope in by_type.items()}


def _rope(fields: _Fields, rope: Mapping[str, Any], max_seq_len: int) -> tuple[float, RopeScaling]:
    """One layer type's rotary base and `RopeScaling`, with the defaults transformers fills in."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    given = {key: value for key, value in rope.items() if key not in ("rope_type", "type", "rope_theta")}
    if given.pop("partial_rotary_factor", 1.0) != 1.0:
        fields.refuse("rope_parameters", rope, "Dew rotates every feature of a head (partial_rotary_factor 1)")
    if kind not in SCALINGS:
        fields.refuse("rope_parameters", rope, f"rope_type {kind!r} is not built; Dew builds {', '.join(SCALINGS)}")
    unknown = sorted(set(given) - set(_ROPE_PARAMETERS[kind]))
    if unknown:
        fields.refuse("rope_parameters", rope, f"rope_type {kind!r} reads {_ROPE_PARAMETERS[kind]}, not {unknown}: "
                      "remove them if the model was trained without them")
    if kind in ("llama3", "yarn"):
        given.setdefault("original_max_position_embeddings", max_seq_len)
    if kind == "yarn":
        # transformers' YaRN: no factor is the ratio of the lengths, and an unset or zero beta its default
        if given.get("factor") is None:
            given["factor"] = max_seq_len / given["original_max_position_embeddings"]
        given.update(beta_fast=given.get("beta_fast") or 32.0, beta_slow=given.get("beta_slow") or 1.0,
                     truncate=bool(given.get("truncate", True)))
        if fields.family.rope_by_layer_type and not given["truncate"]:
            fields.refuse("rope_parameters", rope, f"transformers' {fields.family.config_class} reads truncate only "
                          "from a flat rope_parameters, and always truncates in a per-layer-type one: remove it")
    if kind != "default" and given.get("factor") is None:
        fields.refuse("rope_parameters", rope, f"rope_type {kind!r} needs a factor")
    try:
        scaling = RopeScaling(kind, **{_ROPE_KEYS[key]: value for key, value in given.items()})
    except (TypeError, ValueError) as error:
        fields.refuse("rope_parameters", rope, str(error))
    return float(rope["rope_theta"]), scaling


def param_dtype_name(source: Mapping[str, Any]) -> str | None:
    """The checkpoint's own dtype as config.json states it (`dtype`, else the older `torch_dtype`)."""
    value = source.get("dtype") or source.get("torch_dtype")
    return None if value is None else str(value).removeprefix("torch.")


# ---- tensor names ---------------------------------------------------------------------------------

_LEAVES = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}


def hf_name(path: tuple[str, ...]) -> tuple[str, bool]:
    """The transformers tensor name of a Dew parameter path, and whether the tensor is transposed.

    `("layers_3", "self_attn", "q_proj", "kernel")` is `model.layers.3.self_attn.q_proj.weight`,
    stored `[out, in]` where Dew keeps `[in, out]`; `lm_head` sits outside `model.`.
    """
    *modules, leaf = path
    head = modules[0]
    if head.startswith("layers_"):
        modules = ["layers", head.removeprefix("layers_"), *modules[1:]]
    prefix = "" if head == "lm_head" else "model."
    return prefix + ".".join([*modules, _LEAVES[leaf]]), leaf == "kernel"


def _flat_paths(tree, prefix=()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flat_paths(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def tensor_plan(params) -> list[tuple[str, tuple[str, ...], bool]]:
    """`(transformers name, Dew path, transposed)` for every parameter of a Dew tree (arrays or shapes)."""
    plan = []
    for path, _ in _flat_paths(params):
        name, transposed = hf_name(path)
        plan.append((name, path, transposed))
    return plan


def ignorable(name: str, config: DecoderConfig) -> bool:
    """Tensors a checkpoint may hold that transformers drops too: rotary buffers, a tied head's copy."""
    return name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")
