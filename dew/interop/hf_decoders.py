"""What every family converter shares when it reads a transformers config.json: the field discipline,
rotary parameters in both directions, and the dtype.

A family reads the fields its transformers config class declares (`Converter.fields`, with
transformers' defaults), the fields transformers' modeling code reads with `getattr` although the class
does not declare them (`Converter.getattr_fields`, and `MASK_FIELDS` for every family), and the older
spellings transformers still converts on load (`torch_dtype`, `rope_theta`, `rope_scaling`). Any other
field is refused by name unless it is in `_INERT_FIELDS`, fields transformers neither declares nor
reads. A field whose value Dew cannot compute is refused by name too, with what would load.
`ConfigFields` applies that discipline for one converter (`dew.interop.families`).

Each field's value is checked against what transformers' config class declares for it (`FIELD_KINDS`:
an integer, a number, a list of strings, ...), and a field that fixes the shape of the weights may
not be left out where transformers would fill in its reference model's size (`SHAPE_FIELDS`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from dew.nn.rotary import SCALINGS, RopeScaling
from dew.nn.transformer import FULL, SLIDING

# What a value must be, by kind, and the words a refusal uses. An integer is never a bool; a number is an
# integer or a float (transformers' strict classes refuse an int for a float, but JSON writers drop ".0").
_KINDS = {
    "size": (lambda value: _integer(value) and value > 0, "a positive integer"),
    "count": (lambda value: _integer(value) and value >= 0, "a whole number, 0 or more"),
    "integer": (lambda value: _integer(value), "an integer"),
    "number": (lambda value: _number(value), "a finite number"),
    "bool": (lambda value: isinstance(value, bool), "true or false"),
    "string": (lambda value: isinstance(value, str), "a string"),
    "object": (lambda value: isinstance(value, dict), "an object"),
    "strings": (lambda value: isinstance(value, list) and all(isinstance(item, str) for item in value),
                "a list of strings"),
    "integers": (lambda value: isinstance(value, list) and all(_integer(item) for item in value), "a list of integers"),
    # transformers' list[float]: floats only, an infinity among them
    "floats": (lambda value: isinstance(value, (list, tuple)) and all(isinstance(item, float) and not math.isnan(item)
                                                            for item in value), "a list of floats"),
    # Gemma 4's use_bidirectional_attention: which tokens read later ones
    "attention scope": (lambda value: value in ("all", "vision"), '"vision" or "all"'),
    "size or string": (lambda value: isinstance(value, str) or (_integer(value) and value > 0),
                       'a positive integer or a string ("auto")'),
    # Gemma 3n's intermediate_size (one per layer) and activation_sparsity_pattern (float | list[float])
    "size or sizes": (lambda value: (_integer(value) and value > 0) or (
        isinstance(value, list) and all(_integer(item) and item > 0 for item in value)),
        "a positive integer or a list of them"),
    "number or floats": (lambda value: _number(value) or (isinstance(value, list) and all(
        isinstance(item, float) and math.isfinite(item) for item in value)), "a number or a list of floats"),
    "token ids": (lambda value: _integer(value) or (isinstance(value, list) and all(_integer(item) for item in value)),
                  "a token id or a list of token ids"),
}
# Each config.json field Dew reads and the kind of value transformers' config classes annotate it with
# (the remote code's for LLaDA and Dream); "?" lets it be null, where some family's class does or defaults
# to null. tests/interop/test_config_fields.py holds these against transformers' own annotations.
FIELD_KINDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "n_routed_experts", "index_head_dim", "index_n_heads", "index_topk", "moe_layer_freq",
                     "sliding_window_pattern", "_sliding_window_pattern", "d_model", "n_heads", "n_layers", "mlp_ratio",
                     "max_sequence_length", "block_group_size", "query_pre_attn_scalar", "num_heads", "state_size",
                     "n_groups", "expand", "conv_kernel", "chunk_size", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                     "original_max_position_embeddings", "no_rope_layer_interval", "intermediate_size_mlp",
                     "interleave_moe_layer_step", "floor_scale", "vocab_size_per_layer_input", "global_head_dim",
                     "altup_num_inputs", "laurel_rank"),
                    "size"),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "q_lora_rank", "v_head_dim", "qk_head_dim", "n_group",
                     "topk_group", "moe_intermediate_size", "n_kv_heads", "mlp_hidden_size", "embedding_size",
                     "top_k_experts", "num_global_key_value_heads"),
                    "size?"),
    **dict.fromkeys(("max_window_layers", "n_shared_experts", "num_local_experts", "num_nextn_predict_layers",
                     "shared_expert_intermediate_size", "num_experts", "decoder_sparse_step",
                     "full_attention_interval", "hidden_size_per_layer_input", "num_kv_shared_layers",
                     "altup_active_idx"), "count"),
    # counts whose 0 the families refuse or read themselves (Qwen's switched-off window is 0)
    **dict.fromkeys(("sliding_window", "first_k_dense_replace", "num_experts_per_tok"), "count?"),
    **dict.fromkeys(("pretraining_tp", "bos_token_id", "pad_token_id", "mask_token_id"), "integer?"),
    "eos_token_id": "token ids?",
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "rope_local_base_freq", "partial_rotary_factor",
                     "routed_scaling_factor", "router_aux_loss_coef", "router_jitter_noise", "alibi_bias_max",
                     "residual_dropout", "embedding_dropout", "init_std", "layer_norm_epsilon", "time_step_min",
                     "time_step_max", "time_step_floor", "embedding_multiplier", "residual_multiplier",
                     "attention_multiplier", "logits_scaling", "resid_pdrop", "embd_pdrop", "attn_scale", "altup_coef_clip"),
                    "number"),
    **dict.fromkeys(("attention_dropout", "initializer_range", "attn_logit_softcapping", "final_logit_softcapping",
                     "init_cutoff_factor"), "number?"),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache", "use_sliding_window",
                     "output_router_logits", "qkv_bias", "is_causal", "alibi", "rope", "rope_full_precision",
                     "flash_attention", "attention_layer_norm", "input_emb_norm", "layer_norm_with_affine",
                     "attention_layer_norm_with_affine", "include_qkv_bias", "include_bias", "scale_logits",
                     "weight_tying", "use_bias", "use_conv_bias", "residual_in_fp32", "rescale_prenorm_residual",
                     "use_qk_norm", "attn_temperature_tuning", "attention_k_eq_v", "enable_moe_block",
                     "use_double_wide_mlp", "altup_correct_scale"),
                    "bool"),
    **dict.fromkeys(("norm_topk_prob", "use_bidirectional_attention", "rope_interleave", "multi_query_attention",
                     "bias_for_layer_norm"), "bool?"),
    **dict.fromkeys(("hidden_act", "hidden_activation", "activation_type", "block_type", "layer_norm_type",
                     "init_fn"), "string"),
    **dict.fromkeys(("dtype", "torch_dtype", "scoring_func", "topk_method", "init_device", "precision"), "string?"),
    **dict.fromkeys(("rope_parameters", "rope_scaling", "per_layer_config"), "object?"),
    **dict.fromkeys(("layer_types", "mlp_layer_types"), "strings?"),
    **dict.fromkeys(("mlp_only_layers", "moe_layers", "no_rope_layers"), "integers?"),
    "attention_chunk_size": "size?",
    "time_step_limit": "floats",
    "activation_sparsity_pattern": "number or floats?",
    "time_step_rank": "size or string",
}
# Fields that fix the shape of the weights. Where transformers' default for one is a number, that number is
# its reference model's size (Llama 2 7B's hidden_size 4096), which a checkpoint's weights need not have, so
# leaving the field out is refused; a default of None (head_dim from hidden_size, as many key/value heads
# as heads) or 0 (no dense layers first) is a rule of the architecture and is read as transformers reads it.
# (`num_nextn_predict_layers` is not one: DeepSeek's converter counts the depths the weights hold, and
# transformers' DeepSeek-V3.2 config has no such field to write.)
SHAPE_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_local_experts", "n_routed_experts", "n_shared_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "index_head_dim",
    "index_n_heads", "d_model", "n_heads", "n_layers", "embedding_size", "num_heads", "state_size", "n_groups",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "altup_num_inputs", "laurel_rank",
})


def reference_sizes(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The shape fields among a config class's `defaults` that default to its reference model's size, which a
    config.json must name (see `SHAPE_FIELDS`)."""
    return {name: value for name, value in defaults.items() if name in SHAPE_FIELDS and value not in (None, 0)}


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def expected(kind: str, value) -> str | None:
    """None when `value` is of `kind` (a `_KINDS` name, "?" allowing null); else what it must be, in words."""
    accepts, words = _KINDS[kind.removesuffix("?")]
    if (value is None and kind.endswith("?")) or (value is not None and accepts(value)):
        return None
    return words + (" (or null)" if kind.endswith("?") else "")


def check_field(where: str, name: str, value, kind: str, declared_by: str) -> None:
    """Refuse field `name` = `value` of `where` unless it is of `kind`, as `declared_by` declares it."""
    needs = expected(kind, value)
    if needs is None:
        return
    try:
        unquoted = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        unquoted = None
    fix = (f"write {value} without quotes" if unquoted is not None and expected(kind, unquoted) is None
           else "write the value the model was trained with")
    raise ValueError(f"{where} field {name!r} = {value!r} is not {needs}, as {declared_by} declares it: {fix}")


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
    "rms_norm": (True,),  # the Mamba2 ports' record of mamba_ssm's RMSNorm, which the port always uses
}
# Qwen's window switches, which other families never read: accepted where no window is in effect
# (use_sliding_window only when it says so too), refused where the family windows layers regardless.
_QWEN_WINDOW_FIELDS = ("use_sliding_window", "max_window_layers")

# Fields transformers' mask code (masking_utils.create_causal_mask and its sliding form) reads from every
# family's config with getattr, and the default it reads when the config lacks them.
MASK_FIELDS = {"is_causal": True}
# What transformers' attention and rotary code read with getattr where the config class does not declare the
# field: `getattr(config, "head_dim", hidden_size // num_attention_heads)`; None stands for that quotient.
HEAD_DIM_READ = {"head_dim": None}

# Declared fields that do not change what the decoder computes.
_NO_EFFECT = frozenset({"initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
                        "pretraining_tp"})

# transformers' activation names and the Dew activation each is; the first name of each is the one written.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
ACTIVATION_NAMES = {dew: name for name, dew in reversed(ACTIVATIONS.items())}


def refuse_quantized(source: Mapping[str, Any], where: str) -> None:
    """Refuse a quantized checkpoint's config by name: Dew reads float weights (and GGUF files)."""
    if "quantization" in source:
        raise ValueError(f"{where} names 'quantization' {source['quantization']!r}: an MLX-quantized checkpoint, which "
                         "Dew does not read; load the float checkpoint it was made from")
    if "quantization_config" in source:
        method = (source["quantization_config"] or {}).get("quant_method")
        raise ValueError(f"{where} names quantization_config (quant_method {method!r}): quantized safetensors are not "
                         "built in Dew; load the float checkpoint, or a GGUF file with gguf_file=")


def _known_fields(family) -> set[str]:
    """The config.json fields `family` reads or knows to change nothing."""
    return ({*MASK_FIELDS, *family.getattr_fields, *family.fields} | _BASE_FIELDS | _DROPPED_ON_LOAD | _LEGACY_FIELDS
            | _METADATA_FIELDS | family.legacy_fields | {"dtype"})


def _foreign(family, known: set[str], name: str, value) -> bool:
    """Whether field `name` = `value` is outside what `family` reads (`ConfigFields` refuses it)."""
    if name in known or name in _QWEN_WINDOW_FIELDS:
        return False
    if name == "hidden_act" and family.activation_field != "hidden_act":
        return False  # Gemma 2 and 3: the older spelling of hidden_activation, which is what transformers reads
    return value not in _INERT_FIELDS.get(name, ())


def foreign_fields(source: Mapping[str, Any], family) -> list[str]:
    """The fields of `source` that `family` neither reads nor knows to change nothing: those its
    `ConfigFields` refuses by name (tier 2 shows them inert before a family reads the config without them)."""
    known = _known_fields(family)
    return [name for name, value in source.items() if _foreign(family, known, name, value)]


class ConfigFields:
    """A config's fields as one family (a `Converter`) reads them: declared and getattr-read ones with
    transformers' defaults; every other field is refused by name here, unless inert."""

    def __init__(self, source: Mapping[str, Any], family, where: str):
        self.source, self.family, self.where = source, family, where
        self.defaults = {**MASK_FIELDS, **family.getattr_fields, **family.fields}
        self.unread = set(self.defaults)
        known = _known_fields(family)
        self.window_switches = {}  # Qwen's window fields in a family that does not read them
        read = known | set(_QWEN_WINDOW_FIELDS) | {"hidden_act"}  # the fields this family may read
        for name, value in source.items():
            kind = family.field_kind(name)
            if name in read and kind is not None:
                check_field(where, name, value, kind, f"transformers' {family.config_class}")
            if name in _QWEN_WINDOW_FIELDS and name not in known:
                self.window_switches[name] = value
            if not _foreign(family, known, name, value):
                continue
            if name == "sliding_window" and value is not None:
                raise ValueError(
                    f"{where} names sliding_window {value} but transformers' {family.config_class} attends to "
                    f"every key: a checkpoint trained with a window is a Mistral (model_type 'mistral'); "
                    f"set sliding_window to null if the model was trained without one"
                )
            raise ValueError(
                f"{where} field {name!r} = {value!r} is not a field of transformers' {family.config_class} and Dew "
                f"cannot compute it: remove it if the model was trained without it"
            )

    def get(self, name: str, alias: str | None = None):
        """The field's value, transformers' default when the config leaves it out; `alias` is transformers'
        other name for the field (its class's attribute map), read when the config uses that one."""
        self.unread.discard(name)
        if name in self.source:
            return self.source[name]
        if alias in self.source:
            return self.source[alias]
        default = self.defaults[name]
        if reference_sizes({name: default}):
            raise ValueError(f"{self.where} has no {name!r}, which fixes the shape of the weights: transformers' "
                             f"{self.family.config_class} would take {default}, its reference model's, which these "
                             f"weights need not have; add the {name} this checkpoint was trained with")
        return default

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


# The rope_parameters keys each rotary scaling reads besides rope_type and rope_theta, as transformers
# names them, and the `RopeScaling` field each becomes.
_ROPE_KEYS = {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
              "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor", "beta_fast": "beta_fast",
              "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
              "attention_factor": "attention_factor", "truncate": "truncate",
              "partial_rotary_factor": "rotated_fraction"}
_ROPE_PARAMETERS = {kind: [key for key, field in _ROPE_KEYS.items() if field in reads]
                    for kind, reads in SCALINGS.items()}


def read_rotary(fields: ConfigFields, max_seq_len: int) -> dict[str, tuple[float, RopeScaling]]:
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
    # the older spelling, outside rope_parameters, which transformers moves in (Qwen3-Next's classes default it)
    partial = source.get("partial_rotary_factor", getattr(family, "partial_rotary", None) or 1.0)
    if partial != 1.0:
        for rope in by_type.values():
            rope.setdefault("partial_rotary_factor", partial)
    return {layer_type: _rope(fields, rope, max_seq_len) for layer_type, rope in by_type.items()}


def _rope(fields: ConfigFields, rope: Mapping[str, Any], max_seq_len: int) -> tuple[float, RopeScaling]:
    """One layer type's rotary base and `RopeScaling`, with the defaults transformers fills in."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    given = {key: value for key, value in rope.items() if key not in ("rope_type", "type", "rope_theta")}
    if given.get("partial_rotary_factor", 1.0) == 1.0:  # every feature turns, whatever the kind reads
        given.pop("partial_rotary_factor", None)
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
    if kind == "proportional":  # Gemma 4's: no factor divides nothing
        given.setdefault("factor", 1.0)
    if kind != "default" and given.get("factor") is None:
        fields.refuse("rope_parameters", rope, f"rope_type {kind!r} needs a factor")
    try:
        scaling = RopeScaling(kind, **{_ROPE_KEYS[key]: value for key, value in given.items()})
    except (TypeError, ValueError) as error:
        fields.refuse("rope_parameters", rope, str(error))
    if expected("number", rope["rope_theta"]) is not None:
        fields.refuse("rope_parameters", rope, f"its rope_theta must be {expected('number', rope['rope_theta'])}")
    return float(rope["rope_theta"]), scaling


def rope_parameters(theta: float, scaling: RopeScaling) -> dict[str, Any]:
    """transformers' `rope_parameters` for one rotary setting: the inverse of what the reading above
    resolves: every parameter the kind reads, but None ones and YaRN's default `truncate` (which
    transformers reads only from a flat `rope_parameters`)."""
    fields = {field: key for key, field in _ROPE_KEYS.items()}
    written = {"rope_type": scaling.kind, "rope_theta": float(theta)}
    for field in SCALINGS[scaling.kind]:
        value = getattr(scaling, field)
        if field == "rotated_fraction" and scaling.kind == "default" and value == 1.0:
            continue  # every feature turns: what transformers does without the key
        if value is not None and not (field == "truncate" and value):
            written[fields[field]] = value
    return written


def param_dtype_name(source: Mapping[str, Any]) -> str | None:
    """The checkpoint's own dtype as config.json states it (`dtype`, else the older `torch_dtype`)."""
    value = source.get("dtype") or source.get("torch_dtype")
    return None if value is None else str(value).removeprefix("torch.")
