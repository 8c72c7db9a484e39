"""What the mixture-of-experts families share (Mixtral, Qwen2-MoE, Qwen3-MoE): their config fields read
into a `dew.nn.moe.Mixture`, and their expert tensors in each layout they are stored in.

Dew holds a sparse layer's experts stacked, `mlp/experts/{gate,up}_proj/kernel` `[E, D, F]` and
`down_proj` `[E, F, D]`, beside the router `mlp/gate/kernel` `[D, E]`. Three layouts hold the same numbers:

- the Hub's, which transformers 5 also writes by default: one tensor per expert,
  `mlp.experts.{expert}.{gate,up,down}_proj.weight` `[out, in]` (Mixtral's
  `block_sparse_moe.experts.{expert}.w1/w3/w2`, w1 the gate, w3 the up projection), stacked on load
  and cut apart on save; Dew saves this one;
- transformers 5's modules' own, which `save_pretrained(save_original_format=False)` writes:
  `mlp.experts.gate_up_proj` `[E, 2F, D]` (the gate's rows first), `mlp.experts.down_proj` `[E, D, F]`
  and the router at `mlp.gate.weight` for every family;
- llama.cpp's GGUF: each projection stacked over the experts, `blk.N.ffn_{gate,up}_exps.weight`
  `[E, F, D]` and `ffn_down_exps` `[E, D, F]`, the router `ffn_gate_inp`, a shared expert
  `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp`.

The config fields of transformers' own router losses (`output_router_logits`, `router_aux_loss_coef`)
are read and change nothing: they set a training loss transformers adds, and Dew's router losses are
`LMObjective`'s (`aux_loss_alpha`, `router_z_loss`, `balance_rate`), chosen by the run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection, Sequence
from typing import Any

from dew.interop.families.converter import Converter
from dew.interop.families.llama import DECODER_RULES
from dew.interop.hf_decoders import ConfigFields
from dew.interop.tensors import Rule
from dew.nn.moe import Mixture
from dew.nn.transformer import DecoderConfig

_LAYER = "model.layers.{layer}"
_KERNEL = (1, 0)  # a transformers [out, in] weight as Dew's [in, out] kernel
_STACKED = (0, 2, 1)  # a stacked [E, out, in] tensor as Dew's [E, in, out] kernels
_EXPERTS = "layers/mlp/experts/{}/kernel"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# The fields of transformers' own router loss, read with any value (see the module).
_ROUTER_LOSS_FIELDS = ("output_router_logits", "router_aux_loss_coef")


def hub_rules(block: str = "mlp", names: tuple[str, str, str] = PROJECTIONS, shared: bool = False) -> tuple[Rule, ...]:
    """The decoder's rules with the Hub's per-expert tensors: the router and experts under
    `model.layers.N.{block}`, each expert's gate, up and down projections named `names`, and with
    `shared` Qwen2-MoE's shared expert and its gate."""
    rules = [Rule("layers/mlp/gate/kernel", f"{_LAYER}.{block}.gate.weight", transpose=_KERNEL),
             *(Rule(_EXPERTS.format(ours), f"{_LAYER}.{block}.experts.{{expert}}.{theirs}.weight", transpose=_KERNEL,
                    stack=("expert",)) for ours, theirs in zip(PROJECTIONS, names))]
    if shared:
        rules += [*(Rule(f"layers/mlp/shared_experts/{proj}/kernel", f"{_LAYER}.mlp.shared_expert.{proj}.weight",
                         transpose=_KERNEL) for proj in PROJECTIONS),
                  Rule("layers/mlp/shared_expert_gate/kernel", f"{_LAYER}.mlp.shared_expert_gate.weight",
                       transpose=_KERNEL)]
    return (*DECODER_RULES, *rules)


_FUSED = f"{_LAYER}.mlp.experts.gate_up_proj"
_FUSED_EXPERTS = (
    Rule("layers/mlp/gate/kernel", f"{_LAYER}.mlp.gate.weight", transpose=_KERNEL),
    Rule((_EXPERTS.format("gate_proj"), _EXPERTS.format("up_proj")), _FUSED, transpose=_STACKED, axis=2),
    Rule(_EXPERTS.format("down_proj"), f"{_LAYER}.mlp.experts.down_proj", transpose=_STACKED),
)
# llama.cpp's stacked experts, and its names for the router and the shared expert (convert_hf_to_gguf.py).
LLAMA_CPP_EXPERTS = tuple(Rule(_EXPERTS.format(proj), f"blk.{{layer}}.ffn_{proj.removesuffix('_proj')}_exps.weight",
                               transpose=_STACKED) for proj in PROJECTIONS)
LLAMA_CPP_SHARED_NAMES = {
    **{f"{_LAYER}.mlp.shared_expert.{proj}.weight": f"blk.{{layer}}.ffn_{proj.removesuffix('_proj')}_shexp.weight"
       for proj in PROJECTIONS},
    f"{_LAYER}.mlp.shared_expert_gate.weight": "blk.{layer}.ffn_gate_inp_shexp.weight",
}


def llama_cpp_router(block: str = "mlp") -> dict[str, str]:
    return {f"{_LAYER}.{block}.gate.weight": "blk.{layer}.ffn_gate_inp.weight"}


def llama_cpp_metadata(experts_field: str, expert_width: bool = True) -> dict[str, str]:
    """llama.cpp's expert metadata keys (after `{architecture}.`) and the config.json field each gives;
    without `expert_width` the experts' width is `feed_forward_length` (Mixtral's)."""
    keys = {"expert_count": experts_field, "expert_used_count": "num_experts_per_tok",
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
    if not expert_width:
        del keys["expert_feed_forward_length"]
    return keys


@dataclasses.dataclass(frozen=True)
class MixtureConverter(Converter):
    """A family whose sparse layers route tokens to experts (see the module).

    Which fields the family declares says what it reads, as for `Converter`: `decoder_sparse_step` and
    `mlp_only_layers` choose the sparse layers (without them every layer is), `moe_intermediate_size`
    is the experts' width (without it `intermediate_size`), `norm_topk_prob` whether the selected
    weights are renormalised (without it they are), `shared_expert_intermediate_size` a shared expert
    with a sigmoid gate, `qkv_bias` query/key/value biases. `experts_field` names the expert count,
    which transformers also reads under `experts_alias` (its config class's attribute map).
    """

    experts_field: str = "num_experts"
    experts_alias: str | None = None

    # ---- config.json in ------------------------------------------------------------------------

    def read_family_fields(self, fields: ConfigFields, kwargs: dict) -> None:
        layers = kwargs["num_layers"]
        experts, top_k = self._expert_count(fields), fields.get("num_experts_per_tok")
        for name in _ROUTER_LOSS_FIELDS:
            fields.get(name)
        if self.reads("router_jitter_noise") and fields.get("router_jitter_noise"):
            warnings.warn(f"{fields.where} sets router_jitter_noise {fields.get('router_jitter_noise')}: transformers "
                          "multiplies a sparse layer's input by that much noise in training mode only; Dew never does, "
                          "so inference is transformers' and training here runs without the noise", stacklevel=4)
        sparse = list(range(layers))
        if self.reads("decoder_sparse_step"):
            step, dense = fields.get("decoder_sparse_step"), fields.get("mlp_only_layers") or []
            if step < 1:
                fields.refuse("decoder_sparse_step", step, "every step-th layer is sparse: use 1 or more")
            # transformers' rule: not listed as dense, some experts, and a multiple of the step
            sparse = [i for i in sparse if i not in dense and experts > 0 and (i + 1) % step == 0]
        shared = fields.get("shared_expert_intermediate_size") if self.reads("shared_expert_intermediate_size") else 0
        norm = fields.get("norm_topk_prob") if self.reads("norm_topk_prob") else True
        width = fields.get("moe_intermediate_size") if self.reads("moe_intermediate_size") else kwargs["mlp_features"]
        if self.reads("qkv_bias"):
            kwargs["qkv_bias"] = bool(fields.get("qkv_bias"))
        if not sparse:
            return
        if experts < 1:
            fields.refuse(self.experts_field, experts, "a sparse layer needs at least one expert")
        if top_k is None or not 1 <= top_k <= experts:
            fields.refuse("num_experts_per_tok", top_k, f"a token picks between 1 and the {experts} experts there are "
                          f"({self.experts_field}); set it to the top-k the model was trained with")
        if self.reads("shared_expert_intermediate_size") and shared < 1:
            fields.refuse("shared_expert_intermediate_size", shared, f"{self.config_class}'s sparse layers always "
                          "add a gated shared expert, which Dew builds with a width of 1 or more")
        kwargs["mixture"] = Mixture(experts, top_k, expert_features=width, layers=_listed(sparse, layers),
                                    norm_topk_prob=bool(norm), shared_features=shared, shared_gate=shared > 0)

    def _expert_count(self, fields: ConfigFields) -> int:
        count = fields.get(self.experts_field, alias=self.experts_alias)
        if self.experts_alias in fields.source and fields.source[self.experts_alias] != count:
            fields.refuse(self.experts_alias, fields.source[self.experts_alias], f"it is transformers' other name for "
                          f"{self.experts_field}, which says {count}: keep one")
        return count

    # ---- config.json out -----------------------------------------------------------------------

    def written(self, config: DecoderConfig) -> dict[str, Any]:
        written = super().written(config)
        mixture = config.mixture
        if mixture is None:
            return written
        written.update({self.experts_field: mixture.experts, "num_experts_per_tok": mixture.top_k})
        width = mixture.expert_features or config.mlp_features
        written["moe_intermediate_size" if self.reads("moe_intermediate_size") else "intermediate_size"] = width
        if self.reads("norm_topk_prob"):
            written["norm_topk_prob"] = mixture.norm_topk_prob
        if self.reads("decoder_sparse_step"):
            step = mixture.every if mixture.layers is None else 1
            written.update(decoder_sparse_step=step, mlp_only_layers=[
                i for i in range(config.num_layers) if (i + 1) % step == 0 and i not in config.sparse_layers])
        if self.reads("shared_expert_intermediate_size"):
            written["shared_expert_intermediate_size"] = mixture.shared_features
        if self.reads("qkv_bias"):
            written["qkv_bias"] = config.qkv_bias
        return written

    def differences(self, config: DecoderConfig) -> list[str]:
        """As `Converter.differences`, naming each routing setting the family computes otherwise."""
        if config.mixture is None:
            return [f"a dense feed-forward in every layer (transformers' {self.config_class} routes tokens to "
                    "experts)"]
        config = _canonical(config)
        try:
            back = DecoderConfig(**self.decoder_kwargs(self.written(config), where=f"{self.model_type} config"),
                                 **{name: getattr(config, name) for name in ("dtype", "param_dtype", "scan_layers",
                                                                             "remat")})
        except ValueError as error:
            return [str(error)]
        if back.mixture is None:
            return [f"sparse layers {config.sparse_layers} (it computes none)"]
        found = [f"mixture {field.name} {getattr(config.mixture, field.name)!r} (it computes "
                 f"{getattr(back.mixture, field.name)!r})" for field in dataclasses.fields(Mixture)
                 if getattr(config.mixture, field.name) != getattr(back.mixture, field.name)]
        return found + super().differences(dataclasses.replace(config, mixture=back.mixture))

    # ---- tensors -------------------------------------------------------------------------------

    def tensor_rules(self, config: DecoderConfig, names: Collection[str] | None = None) -> tuple[Rule, ...]:
        if names is not None and any(name.endswith(".mlp.experts.gate_up_proj") for name in names):
            # transformers 5's fused layout; the rest of the decoder keeps its names
            fused = {path for rule in _FUSED_EXPERTS for path in rule.dew}
            kept = [rule for rule in self.rules if not set(rule.dew) & fused]
            return (*kept, *_FUSED_EXPERTS)
        return self.rules

    def gguf_rules(self, config: DecoderConfig) -> tuple[Rule, ...]:
        # the per-expert rules have no llama.cpp names and drop out; its stacked tensors replace them
        return (*super().gguf_rules(config), *LLAMA_CPP_EXPERTS)


def _listed(sparse: Sequence[int], layers: int) -> tuple[int, ...] | None:
    """A mixture's `layers` for the sparse layers `sparse` of `layers`: None when every layer is."""
    return None if list(sparse) == list(range(layers)) else tuple(sparse)


def _canonical(config: DecoderConfig) -> DecoderConfig:
    """`config` with its mixture spelled the one way the families read it back: the sparse layers
    listed (None for all), the experts' width given."""
    mixture = dataclasses.replace(config.mixture, layers=_listed(config.sparse_layers, config.num_layers), every=1,
                                  expert_features=config.mixture.expert_features or config.mlp_features)
    return dataclasses.replace(config, mixture=mixture)
