"""DeepSeek V2, V3 and V3.2: latent attention (`dew.nn.mla`), a mixture of experts after the first
`first_k_dense_replace` dense layers (`dew.nn.moe`), and V3's multi-token-prediction modules
(`dew.nn.mtp`) stored as the layers after the last, `model.layers.{num_hidden_layers + k}.*`. V3.2
is V3 with the lightning indexer in every layer (`self_attn.indexer.*`, `dew.nn.mla.Indexer`), each
query attending to the `index_topk` keys it ranks highest, and a per-layer `mlp_layer_types`.

V3 routes with sigmoid scores, a balancing bias (`mlp.gate.e_score_correction_bias`, kept in the
`moe` collection) and groups scored by their two best experts; V2 with softmax scores, optionally
limited to the groups with the best single expert (`topk_method` "group_limited_greedy"), never
renormalised (transformers' V2 router does not read `norm_topk_prob`). Experts are stored one by one
(`mlp.experts.{e}.gate_proj.weight`), as transformers writes them.

Fields DeepSeek's own configuration code writes and transformers ignores are accepted where they
say what transformers computes anyway (`moe_layer_freq` 1, `scoring_func` and V3's `topk_method`
naming the family's own routing) and refused by name where they do not; the training-only ones
(`aux_loss_alpha`, `seq_aux`, `ep_size`) change nothing here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.hf_decoders import ACTIVATION_NAMES, ACTIVATIONS, ConfigFields, read_rotary, rope_parameters
from dew.interop.tensors import Rule
from dew.nn.mla import LatentAttention
from dew.nn.moe import Mixture
from dew.nn.transformer import FULL, DecoderConfig

_KERNEL = (1, 0)  # transformers stores a projection [out, in], Dew keeps it [in, out]
_LAYER = "model.layers.{layer}"
_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_BIASED = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")  # what attention_bias adds a bias to
_MLP = ("gate_proj", "up_proj", "down_proj")


def _block_rules(dew: str, tensor: str) -> tuple[Rule, ...]:
    """One decoder block's rules, its Dew scope `dew` (`layers` or an MTP depth's `mtp_k/block`) and its
    tensor prefix (`model.layers.{layer}` or `model.layers.N`)."""
    return (
        *(Rule(f"{dew}/{norm}/scale", f"{tensor}.{norm}.weight") for norm in ("input_layernorm",
                                                                              "post_attention_layernorm")),
        *(Rule(f"{dew}/self_attn/{norm}/scale", f"{tensor}.self_attn.{norm}.weight")
          for norm in ("q_a_layernorm", "kv_a_layernorm")),
        *(Rule(f"{dew}/self_attn/{proj}/kernel", f"{tensor}.self_attn.{proj}.weight", transpose=_KERNEL)
          for proj in _ATTENTION),
        *(Rule(f"{dew}/self_attn/{proj}/bias", f"{tensor}.self_attn.{proj}.bias") for proj in _BIASED),
        *(Rule(f"{dew}/self_attn/indexer/{proj}/kernel", f"{tensor}.self_attn.indexer.{proj}.weight", transpose=_KERNEL)
          for proj in ("wq_b", "wk", "weights_proj")),
        Rule(f"{dew}/self_attn/indexer/k_norm/scale", f"{tensor}.self_attn.indexer.k_norm.weight"),
        Rule(f"{dew}/self_attn/indexer/k_norm/bias", f"{tensor}.self_attn.indexer.k_norm.bias"),
        *(Rule(f"{dew}/mlp/{proj}/kernel", f"{tensor}.mlp.{proj}.weight", transpose=_KERNEL) for proj in _MLP),
        Rule(f"{dew}/mlp/gate/kernel", f"{tensor}.mlp.gate.weight", transpose=_KERNEL),
        Rule(f"{dew}/mlp/gate/e_score_correction_bias", f"{tensor}.mlp.gate.e_score_correction_bias"),
        *(Rule(f"{dew}/mlp/experts/{proj}/kernel", f"{tensor}.mlp.experts.{{expert}}.{proj}.weight",
               transpose=_KERNEL, stack=("expert",)) for proj in _MLP),
        *(Rule(f"{dew}/mlp/shared_experts/{proj}/kernel", f"{tensor}.mlp.shared_experts.{proj}.weight",
               transpose=_KERNEL) for proj in _MLP),
    )


DEEPSEEK_RULES = (
    Rule("embed_tokens/embedding", "model.embed_tokens.weight"),
    *_block_rules("layers", _LAYER),
    Rule("norm/scale", "model.norm.weight"),
    Rule("lm_head/kernel", "lm_head.weight", transpose=_KERNEL),
)


def mtp_rules(depth: int, layer: int) -> tuple[Rule, ...]:
    """The rules of multi-token-prediction depth `depth` (0-based), stored as layer `layer`: its
    norms of the embedding and of the previous state, their projection, its block and its head norm."""
    tensor = f"model.layers.{layer}"
    return (
        Rule(f"mtp_{depth}/enorm/scale", f"{tensor}.enorm.weight"),
        Rule(f"mtp_{depth}/hnorm/scale", f"{tensor}.hnorm.weight"),
        Rule(f"mtp_{depth}/eh_proj/kernel", f"{tensor}.eh_proj.weight", transpose=_KERNEL),
        Rule(f"mtp_{depth}/shared_head/norm/scale", f"{tensor}.shared_head.norm.weight"),
        *_block_rules(f"mtp_{depth}/block", tensor),
    )


_COMMON_FIELDS = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "moe_intermediate_size": 1407,
    "num_hidden_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": 2,
    "n_routed_experts": 160, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": None, "topk_group": None,
    "num_experts_per_tok": None, "first_k_dense_replace": 0, "norm_topk_prob": False, "hidden_act": "silu",
    "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False,
    "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0, "output_router_logits": False,
    # set by transformers from the head dimensions whatever the file says
    "head_dim": None, "qk_head_dim": None,
    # DeepSeek's own configuration code (see the module)
    "moe_layer_freq": 1, "scoring_func": None,
}
_V2_FIELDS = {**_COMMON_FIELDS, "topk_method": "greedy", "mlp_bias": False}
_V3_FIELDS = {
    **_COMMON_FIELDS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "rope_interleave": True, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
}
_V32_FIELDS = {
    **{k: v for k, v in _V3_FIELDS.items() if k not in ("rope_interleave", "pretraining_tp", "topk_method")},
    "max_position_embeddings": 163840, "mlp_layer_types": None, "layer_types": None, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 64, "mlp_bias": False, "topk_method": "noaux_tc",
}
_TRAINING_ONLY = frozenset({"aux_loss_alpha", "seq_aux", "ep_size"})


@dataclasses.dataclass(frozen=True)
class DeepseekConverter(Converter):
    """DeepSeek V2, V3 or V3.2 (`version` 2, 3 or 32), read and written field by field (see the module)."""

    version: int = 3

    # ---- config.json in ------------------------------------------------------------------------

    def decoder_kwargs(self, source: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
        fields = ConfigFields(source, self, where)
        get = fields.get
        layers, heads = get("num_hidden_layers"), get("num_attention_heads")
        kv_heads = get("num_key_value_heads")
        if kv_heads not in (None, heads):
            fields.refuse("num_key_value_heads", kv_heads, f"latent attention gives each of the {heads} heads its own "
                          f"key and value, and transformers' eager attention repeats them only when "
                          f"num_key_value_heads equals num_attention_heads: set it to {heads}")
        get("head_dim"), get("qk_head_dim")  # derived from the head dimensions on load
        activation = get("hidden_act")
        if activation not in ACTIVATIONS:
            fields.refuse("hidden_act", activation, f"the MLP activations Dew has are {sorted(ACTIVATIONS)}")
        fields.require("is_causal", (True,), "attention that sees later tokens (a bidirectional encoder) is not "
                       "built in Dew; set it to true for the causal decoder")
        fields.require("moe_layer_freq", (1,), "transformers makes every layer after first_k_dense_replace a "
                       "mixture of experts and reads no moe_layer_freq: a checkpoint sparse every other layer needs "
                       "DeepSeek's own code")
        fields.require("output_router_logits", (False, None), "it only asks transformers to return the router logits; "
                       "set it to false (Dew reports them through token_scores(routing=True))")
        rope_dim = get("qk_rope_head_dim")
        interleaved = bool(get("rope_interleave")) if self.version == 3 else True
        index = {}
        if self.version == 32:
            index = dict(index_heads=get("index_n_heads"), index_head_dim=get("index_head_dim"),
                         index_topk=get("index_topk"))
            types = get("layer_types")
            if types is not None and set(types) != {"indexed_attention"}:
                fields.refuse("layer_types", types, "every DeepSeek-V3.2 layer is 'indexed_attention'")
        try:
            latent = LatentAttention(kv_rank=get("kv_lora_rank"), q_rank=get("q_lora_rank"),
                                     nope_dim=get("qk_nope_head_dim"), rope_dim=rope_dim, value_dim=get("v_head_dim"),
                                     interleaved=interleaved, **index)
        except ValueError as error:
            fields.refuse("qk_rope_head_dim", rope_dim, str(error))
        bias = bool(get("attention_bias"))
        kwargs = dict(
            vocab_size=get("vocab_size"), emb_features=get("hidden_size"), num_layers=layers, num_heads=heads,
            mlp_features=get("intermediate_size"), max_seq_len=get("max_position_embeddings"),
            norm_eps=get("rms_norm_eps"), tie_embeddings=bool(get("tie_word_embeddings")),
            activation=ACTIVATIONS[activation], attention_dropout=float(get("attention_dropout") or 0.0),
            qkv_bias=bias, o_bias=bias, latent=latent, head_dim=latent.nope_dim + latent.rope_dim,
            mixture=self._mixture(fields, layers),
            mtp_depths=int(get("num_nextn_predict_layers") or 0) if self.version != 2 else 0,
        )
        if self.version != 3 and get("mlp_bias"):
            fields.refuse("mlp_bias", True, "experts with biases are not built in Dew; DeepSeek-V2 checkpoints have "
                          "none: set it to false")
        ropes = read_rotary(fields, kwargs["max_seq_len"])
        kwargs["rope_theta"], kwargs["rope_scaling"] = ropes[FULL]
        fields.finish()
        return kwargs

    def _mixture(self, fields: ConfigFields, layers: int) -> Mixture | None:
        get = fields.get
        first_dense = get("first_k_dense_replace")
        sparse = tuple(range(first_dense, layers))
        if self.version == 32 and get("mlp_layer_types") is not None:
            types = get("mlp_layer_types")
            if len(types) != layers or set(types) - {"dense", "sparse"}:
                fields.refuse("mlp_layer_types", types, f"name each of the {layers} layers 'dense' or 'sparse'")
            sparse = tuple(i for i, kind in enumerate(types) if kind == "sparse")
        experts, top_k = get("n_routed_experts"), get("num_experts_per_tok")
        shared = (get("n_shared_experts") or 0) * get("moe_intermediate_size")
        scoring = "softmax" if self.version == 2 else "sigmoid"
        fields.require("scoring_func", (None, scoring), f"transformers' {self.config_class} scores experts with "
                       f"{scoring} and reads no scoring_func")
        method = get("topk_method")
        common = dict(experts=experts, top_k=top_k, expert_features=get("moe_intermediate_size"),
                      layers=sparse, score_function=scoring,
                      scaling=float(get("routed_scaling_factor")), shared_features=shared)
        if self.version != 2:
            fields.require("topk_method", ("noaux_tc", None), "transformers' DeepSeek-V3 router selects by biased "
                           "sigmoid scores within groups (noaux_tc) and reads no topk_method")
            groups, keep = get("n_group"), get("topk_group")
            for name, value in (("n_group", groups), ("topk_group", keep)):
                if value is None:
                    fields.refuse(name, value, "transformers' DeepSeek-V3 router groups its experts: give the number "
                                  "(1 for no grouping)")
            # transformers' group score is the sum of the two best experts, which needs two per group
            if experts is not None and groups and experts // groups < 2 and groups > 1:
                fields.refuse("n_group", groups, f"transformers scores each group by its two best experts, and "
                              f"{experts} experts in {groups} groups leaves fewer: use fewer groups")
            spec = dict(common, norm_topk_prob=bool(get("norm_topk_prob")), groups=groups, groups_per_token=keep,
                        group_score="top2", bias=True)
        else:
            get("norm_topk_prob")  # declared, never read by transformers' V2 router: it does not renormalise
            groups, keep = get("n_group"), get("topk_group")
            if method == "greedy":
                spec = dict(common, norm_topk_prob=False)
            elif method == "group_limited_greedy":
                spec = dict(common, norm_topk_prob=False, groups=groups, groups_per_token=keep, group_score="max")
            else:
                fields.refuse("topk_method", method, "transformers' DeepSeek-V2 router knows 'greedy' and "
                              "'group_limited_greedy'")
        if not sparse:
            return None
        if top_k is None:
            fields.refuse("num_experts_per_tok", None, "the sparse layers need the experts each token uses")
        try:
            return Mixture(**spec)
        except ValueError as error:
            fields.refuse("n_routed_experts", experts, str(error))

    def fit_to_weights(self, kwargs: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
        """The multi-token-prediction depths whose weights the checkpoint holds (transformers writes
        `num_nextn_predict_layers` 1 without writing any): a checkpoint without them loads with MTP off."""
        names = set(names)
        depths = 0
        while depths < kwargs.get("mtp_depths", 0) and \
                f"model.layers.{kwargs['num_layers'] + depths}.eh_proj.weight" in names:
            depths += 1
        return {**kwargs, "mtp_depths": depths}

    # ---- config.json out -----------------------------------------------------------------------

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        c, lat = config, config.latent
        if lat is None:
            raise ValueError(f"{self.model_type} computes latent attention, and this model has grouped-query "
                             "attention (latent is None)")
        m = c.mixture
        sparse = c.sparse_layers
        first_dense = sparse[0] if sparse else c.num_layers
        written = {
            "model_type": self.model_type, "architectures": [self.architecture], "vocab_size": c.vocab_size,
            "hidden_size": c.emb_features, "intermediate_size": c.mlp_features, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_heads,
            "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": c.tie_embeddings, "hidden_act": ACTIVATION_NAMES[c.activation],
            "attention_dropout": c.attention_dropout, "attention_bias": c.qkv_bias and c.o_bias,
            "kv_lora_rank": lat.kv_rank, "q_lora_rank": lat.q_rank, "qk_nope_head_dim": lat.nope_dim,
            "qk_rope_head_dim": lat.rope_dim, "v_head_dim": lat.value_dim, "first_k_dense_replace": first_dense,
            "rope_parameters": rope_parameters(c.rope_theta, c.rope_scaling),
        }
        if m is not None:
            written.update(n_routed_experts=m.experts, num_experts_per_tok=m.top_k,
                           moe_intermediate_size=m.expert_features or c.mlp_features,
                           routed_scaling_factor=m.scaling, norm_topk_prob=m.norm_topk_prob)
            features = m.expert_features or c.mlp_features
            shared, left = divmod(m.shared_features, features)
            # a shared width that is no multiple of the experts' is refused when read back (differences)
            written["n_shared_experts"] = shared if not left else m.shared_features / features
            if self.version != 2:
                written.update(n_group=m.groups, topk_group=m.groups_per_token)
            else:
                grouped = m.groups > 1
                written.update(topk_method="group_limited_greedy" if grouped else "greedy",
                               n_group=m.groups if grouped else None, topk_group=m.groups_per_token if grouped else None)
        if self.version == 3:
            written.update(rope_interleave=lat.interleaved, num_nextn_predict_layers=c.mtp_depths)
        elif self.version == 32:
            written.update(num_nextn_predict_layers=c.mtp_depths, index_n_heads=lat.index_heads,
                           index_head_dim=lat.index_head_dim, index_topk=lat.index_topk, mlp_bias=c.mlp_bias,
                           mlp_layer_types=["sparse" if i in sparse else "dense" for i in range(c.num_layers)])
        else:
            written["mlp_bias"] = c.mlp_bias
        return written

    # ---- tensors -------------------------------------------------------------------------------

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        return self.rules + tuple(rule for depth in range(config.mtp_depths)
                                  for rule in mtp_rules(depth, config.num_layers + depth))

    def ignorable(self, name: str, config: DecoderConfig) -> bool:
        """Beside the usual: each MTP depth's copies of the embedding and the head (DeepSeek's checkpoints
        hold them; the depths share the main ones, as transformers' MTP model does)."""
        mtp = tuple(f"model.layers.{config.num_layers + k}." for k in range(config.mtp_depths))
        return super().ignorable(name, config) or (
            name.startswith(mtp) and name.endswith((".embed_tokens.weight", ".shared_head.head.weight")))


DEEPSEEK_V3 = DeepseekConverter("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", _V3_FIELDS,
                                DEEPSEEK_RULES, legacy_fields=_TRAINING_ONLY, version=3)
DEEPSEEK_V2 = DeepseekConverter("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", _V2_FIELDS,
                                DEEPSEEK_RULES, legacy_fields=_TRAINING_ONLY, version=2)
DEEPSEEK_V32 = DeepseekConverter("deepseek_v32", "DeepseekV32Config", "DeepseekV32ForCausalLM", _V32_FIELDS,
                                 DEEPSEEK_RULES, legacy_fields=_TRAINING_ONLY, version=32)
