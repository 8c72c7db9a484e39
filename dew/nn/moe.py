"""A mixture of experts: the router, the stacked experts, shared experts, dropless dispatch, replay.

`Mixture` is the decoder's knob (`DecoderConfig.mixture`): which layers are sparse and how they
route. Each sparse layer's feed-forward is a `SparseSpec`, whose module `SparseMLP` holds, in
transformers' names, the router `gate` (`kernel` `[D, E]`, float32), the experts `experts/{gate,up,
down}_proj/kernel` stacked `[E, D, F]` / `[E, F, D]`, and optionally `shared_experts` (a dense gated
MLP) and `shared_expert_gate` (`[D, 1]`). A balancing bias, `e_score_correction_bias` `[E]` float32,
lives in the `moe` collection, outside `params`: it moves by the objective's effects, never by a
gradient, and serves selection only.

Routing (`Router`): float32 logits, scores by softmax or sigmoid, the top-k of `scores + bias`
(within the best `groups_per_token` of `groups` expert groups when grouped, a group scored by the sum
of its two best experts or by its best), weights gathered from the unbiased scores, divided by their
sum when `norm_topk_prob`, times `scaling` (and each chosen expert's `per_expert_scale`, Gemma 4's).
Gemma 4's router (`router_norm`) projects `x / rms(x) * scale * width ** -0.5` through `proj` instead
of the float32 `kernel`. `DenseSparseSpec` is Gemma 4's feed-forward: a dense MLP beside the experts,
whose parts sit on the layer (`dew.nn.layer.DecoderLayer` wires them).

Dispatch is dropless: the token slots are sorted by expert and run through
`dew.nn.grouped.expert_mlp`, then combined with the weights in float32. With `capacity_factor`, each
expert takes at most `ceil(capacity_factor * S * top_k / E)` slots per row, in token order; the slots
past it contribute nothing.

Each sparse layer reports a `RouterRecord` (the router's choices, weights, scores and log-normaliser);
the decoder gathers them, layer-stacked, under `ModelOutput.aux["routing"]`. `Routes` replays a
recorded choice of experts.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct
from jax import lax

from dew.nn.grouped import expert_mlp
from dew.nn.linear import Linear, named
from dew.nn.mlp import DenseSpec, GatedMLP
from dew.nn.norms import normalize

F32 = jnp.float32
SCORE_FUNCTIONS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2", "max")
BIAS_COLLECTION = "moe"
BIAS_NAME = "e_score_correction_bias"
# Added to the selected weights' sum before dividing (DeepSeek-V3's guard against an all-zero sum).
_NORM_GUARD = 1e-20


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Which layers of a decoder are sparse, and how their experts are routed.

    - `experts`, `top_k`: experts per sparse layer and experts per token; `expert_features` each
      expert's hidden width (default: the decoder's `mlp_features`).
    - `layers` lists the sparse layers; without it, layer `i` is sparse when `(i + 1) % every == 0`
      (transformers' `decoder_sparse_step`; 1: every layer).
    - `score_function`: "softmax" or "sigmoid" over the float32 router logits.
    - `norm_topk_prob`: divide the selected weights by their sum; `scaling` multiplies them after
      (DeepSeek's `routed_scaling_factor`).
    - `groups`, `groups_per_token`, `group_score`: group-limited selection (DeepSeek V2/V3): experts
      in `groups` equal groups, a group scored by its two best experts' sum ("top2") or its best
      ("max"), and only the best `groups_per_token` groups' experts eligible.
    - `bias`: a balancing bias added to the scores for selection only (aux-loss-free balancing; the
      objective's `balance_rate` moves it).
    - `shared_features`: the hidden width of a dense gated MLP every token also runs through (0: none);
      `shared_gate` scales it by `sigmoid(x . w)` (Qwen2-MoE).
    - `capacity_factor`: None routes every slot (dropless); a factor caps each expert's slots per row.
    - `weighted_inputs`: each routed expert reads its token times the expert's weight, and the experts'
      outputs are summed unweighted (Llama 4's experts, which are not linear, so this differs from
      weighting their outputs).
    - `router_norm`: the router reads `x / rms(x)` times a learned `scale` `[D]` and `D ** -0.5`, and
      projects it through `proj` in the compute dtype (Gemma 4's router); `expert_scale`: a learned
      `per_expert_scale` `[E]` multiplies each chosen expert's weight (Gemma 4's).
    """

    experts: int
    top_k: int = 2
    expert_features: int | None = None
    layers: tuple[int, ...] | None = None
    every: int = 1
    score_function: str = "softmax"
    norm_topk_prob: bool = True
    scaling: float = 1.0
    groups: int = 1
    groups_per_token: int = 1
    group_score: str = "top2"
    bias: bool = False
    shared_features: int = 0
    shared_gate: bool = False
    capacity_factor: float | None = None
    router_norm: bool = False
    expert_scale: bool = False
    weighted_inputs: bool = False

    def __post_init__(self):
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.experts < 1:
            raise ValueError(f"mixture experts is {self.experts}; a mixture needs at least 1 expert")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"mixture top_k is {self.top_k}; it must be in [1, experts] = [1, {self.experts}]: "
                             f"a token cannot pick more experts than the {self.experts} there are")
        if self.expert_features is not None and self.expert_features < 1:
            raise ValueError(f"mixture expert_features is {self.expert_features}; it must be at least 1")
        if self.every < 1:
            raise ValueError(f"mixture every is {self.every}; it must be at least 1 (1: every layer is sparse)")
        if self.layers is not None and (self.every != 1 or len(set(self.layers)) != len(self.layers)
                                        or any(i < 0 for i in self.layers)):
            raise ValueError(f"mixture layers is {self.layers}: list distinct layer numbers >= 0, and leave every "
                             "at 1 (layers names the sparse layers itself)")
        for name, allowed in (("score_function", SCORE_FUNCTIONS), ("group_score", GROUP_SCORES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"mixture {name} is {getattr(self, name)!r}; it must be one of {list(allowed)}")
        if self.groups < 1 or self.experts % self.groups:
            raise ValueError(f"mixture groups is {self.groups}; it must divide the {self.experts} experts")
        if not 1 <= self.groups_per_token <= self.groups:
            raise ValueError(f"mixture groups_per_token is {self.groups_per_token}; it must be in [1, groups] = "
                             f"[1, {self.groups}]")
        eligible = self.groups_per_token * (self.experts // self.groups)
        if self.top_k > eligible:
            raise ValueError(f"mixture top_k {self.top_k} is more than the {eligible} experts of the "
                             f"{self.groups_per_token} groups a token may use: raise groups_per_token")
        if self.shared_features < 0:
            raise ValueError(f"mixture shared_features is {self.shared_features}; use 0 for no shared expert")
        if self.shared_gate and not self.shared_features:
            raise ValueError("mixture shared_gate gates the shared expert, and shared_features is 0 (none): "
                             "give shared_features, or drop shared_gate")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"mixture capacity_factor is {self.capacity_factor}; use a factor above 0, or None "
                             "for dropless routing")

    def sparse(self, index: int) -> bool:
        """Whether layer `index` is a sparse layer of this mixture."""
        return index in self.layers if self.layers is not None else (index + 1) % self.every == 0

    def capacity(self, seq_len: int) -> int | None:
        """Slots each expert takes per row of `seq_len` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * seq_len * self.top_k / self.experts))


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    """A sparse layer's feed-forward: its `mixture`, the experts' hidden width and activation."""

    mixture: Mixture
    features: int
    activation: str = "silu"

    def module(self, *, dtype, param_dtype, name: str) -> "SparseMLP":
        return SparseMLP(self, dtype=dtype, param_dtype=param_dtype, name=name)


@dataclasses.dataclass(frozen=True)
class DenseSparseSpec:
    """Gemma 4's feed-forward: the `dense` gated MLP beside the `sparse` mixture of experts, each between
    its own norms, summed. `DecoderLayer` wires it, since its parts sit on the layer under transformers'
    names: `mlp` (the dense half, after the layer's `pre_feedforward_layernorm`, then
    `post_feedforward_layernorm_1`), `router` (reading the un-normed residual), `experts` (bare
    parameters, after `pre_feedforward_layernorm_2`, then `post_feedforward_layernorm_2`)."""

    dense: DenseSpec
    sparse: SparseSpec


@struct.dataclass
class RouterRecord:
    """What a sparse layer's router reports, per token (leading axes `[..., B, S]`; the decoder's
    `aux["routing"]` adds a leading layer axis over its sparse layers): the selected `experts`
    (int32 `[..., K]`, replayed ones where replayed), their float32 `weights` `[..., K]`, the
    unbiased float32 `scores` over every expert `[..., E]`, and `log_z`, the float32 log-sum-exp of
    the router logits."""

    experts: jax.Array
    weights: jax.Array
    scores: jax.Array
    log_z: jax.Array


@struct.dataclass
class Routes:
    """A recorded choice of experts to replay: int32 `experts` `[B, S, L, K]` for the model's input
    tokens, its `L` sparse layers in order, and `covered` `[B, S]` (bool; None for all) marking the
    tokens the record covers. Covered tokens use the recorded experts, the rest their router's own
    top-k; either way the weights come from this forward's scores, so the router keeps its gradient."""

    experts: jax.Array
    covered: jax.Array | None = None

    def check(self, rows: int, seq_len: int, layers: int, top_k: int) -> None:
        """Refuse a record of the wrong shape (at trace time: shapes are static)."""
        want = (rows, seq_len, layers, top_k)
        if tuple(self.experts.shape) != want:
            raise ValueError(f"routes experts have shape {tuple(self.experts.shape)}; this model reads [B, S, L, K] = "
                             f"{list(want)}: one id per input token, sparse layer ({layers}) and selected expert "
                             f"(top_k {top_k})")
        if not jnp.issubdtype(self.experts.dtype, jnp.integer):
            raise TypeError(f"routes experts have dtype {self.experts.dtype}; they are integer expert ids")
        if self.covered is not None and tuple(self.covered.shape) != (rows, seq_len):
            raise ValueError(f"routes covered has shape {tuple(self.covered.shape)}; it marks the input tokens, "
                             f"[B, S] = {[rows, seq_len]}")


def limit_groups(choice_NE: jax.Array, groups: int, keep: int, group_score: str) -> jax.Array:
    """`choice_NE` with every expert outside each token's best `keep` groups set to -inf."""
    N, E = choice_NE.shape
    grouped_NGP = choice_NE.reshape(N, groups, E // groups)
    if group_score == "top2" and E // groups >= 2:
        score_NG = jnp.sum(lax.top_k(grouped_NGP, 2)[0], axis=-1)
    else:
        score_NG = jnp.max(grouped_NGP, axis=-1)
    _, best_NK = lax.top_k(score_NG, keep)
    allowed_NG = jnp.any(best_NK[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)
    return jnp.where(jnp.repeat(allowed_NG, E // groups, axis=1), choice_NE, -jnp.inf)


class Router(nn.Module):
    """Scores, selects and weights each token's experts (see the module docstring); all float32 but
    for `router_norm`'s input and projection, which run in `dtype` (`norm_eps` is its norm's)."""

    mixture: Mixture
    norm_eps: float = 1e-6
    dtype: jnp.dtype = F32
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, x_ND, replay_NK=None, covered_N=None):
        m = self.mixture
        D = x_ND.shape[-1]
        if m.router_norm:
            scale = self.param("scale", named(nn.initializers.ones_init(), ("norm",)), (D,), self.param_dtype)
            routed_ND = normalize(x_ND, self.norm_eps) * scale.astype(self.dtype) * jnp.asarray(D**-0.5, self.dtype)
            logits_NE = Linear(m.experts, dtype=self.dtype, param_dtype=self.param_dtype, names=("embed", None),
                               name="proj")(routed_ND).astype(F32)
        else:
            kernel = self.param("kernel", named(nn.initializers.normal(0.02), ("embed", None)), (D, m.experts), F32)
            logits_NE = lax.dot_general(x_ND.astype(F32), kernel, (((1,), (0,)), ((), ())),
                                        precision=lax.Precision.HIGHEST, preferred_element_type=F32)
        scores_NE = jax.nn.softmax(logits_NE, axis=-1) if m.score_function == "softmax" else jax.nn.sigmoid(logits_NE)
        choice_NE = scores_NE
        if m.bias:
            bias = self.variable(BIAS_COLLECTION, BIAS_NAME, lambda: jnp.zeros((m.experts,), F32))
            choice_NE = choice_NE + bias.value
        if m.groups > 1:
            choice_NE = limit_groups(choice_NE, m.groups, m.groups_per_token, m.group_score)
        _, experts_NK = lax.top_k(choice_NE, m.top_k)
        if replay_NK is not None:
            replayed = replay_NK.astype(jnp.int32)
            experts_NK = replayed if covered_N is None else jnp.where(covered_N[:, None], replayed, experts_NK)
        weights_NK = jnp.take_along_axis(scores_NE, experts_NK, axis=-1)
        if m.norm_topk_prob:
            weights_NK = weights_NK / (jnp.sum(weights_NK, axis=-1, keepdims=True) + _NORM_GUARD)
        weights_NK = weights_NK * m.scaling
        if m.expert_scale:
            per_expert_E = self.param("per_expert_scale", nn.initializers.ones_init(), (m.experts,), self.param_dtype)
            weights_NK = weights_NK * per_expert_E.astype(F32)[experts_NK]
        return experts_NK, weights_NK, scores_NE, jax.nn.logsumexp(logits_NE, axis=-1)


def drop_overflow(experts_BQ: jax.Array, experts: int, capacity: int) -> jax.Array:
    """Slot ids `[B, Q]` (a row's tokens' slots in token order) with each slot past its expert's
    `capacity` in its row replaced by `experts` (no expert)."""
    order_BQ = jnp.argsort(experts_BQ, axis=1, stable=True)
    sorted_BQ = jnp.take_along_axis(experts_BQ, order_BQ, axis=1)
    sizes_BE = jax.vmap(lambda row: jnp.bincount(row, length=experts))(experts_BQ)
    start_BE = jnp.cumsum(sizes_BE, axis=1) - sizes_BE
    queue_sorted_BQ = jnp.arange(experts_BQ.shape[1]) - jnp.take_along_axis(start_BE, sorted_BQ, axis=1)
    queue_BQ = jnp.zeros_like(queue_sorted_BQ).at[jnp.arange(experts_BQ.shape[0])[:, None], order_BQ].set(
        queue_sorted_BQ)
    return jnp.where(queue_BQ < capacity, experts_BQ, experts)


def dispatch(x_ND, slots_NK, weights_NK, w_gate_EDF, w_up_EDF, w_down_EFD, activation: str,
             weighted_inputs: bool = False) -> jax.Array:
    """float32 `[N, D]`: each token's selected experts' outputs weighted in float32, a slot of id `E`
    (dropped) contributing nothing. The slots are sorted by expert for one grouped matmul. With
    `weighted_inputs` each slot's input is weighted instead (in `x`'s dtype) and the outputs are summed."""
    N, K = slots_NK.shape
    E = w_gate_EDF.shape[0]
    slots_M = slots_NK.reshape(-1)
    order_M = jnp.argsort(slots_M, stable=True)
    sizes_E = jnp.bincount(slots_M, length=E).astype(jnp.int32)  # the dropped id E is not counted
    x_MD = x_ND[order_M // K]
    if weighted_inputs:
        x_MD = x_MD * weights_NK.reshape(-1)[order_M][:, None].astype(x_MD.dtype)
        weights_NK = jnp.ones_like(weights_NK)
    y_MD = expert_mlp(x_MD, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, activation)
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(order_M.shape[0], dtype=order_M.dtype))
    y_NKD = y_MD[inverse_M].reshape(N, K, -1)
    kept_NK = slots_NK < E
    y_NKD = jnp.where(kept_NK[..., None], y_NKD, 0.0)
    return jnp.einsum("nk,nkd->nd", jnp.where(kept_NK, weights_NK.astype(F32), 0.0), y_NKD)


class _StackedKernel(nn.Module):
    """One projection of every expert, `kernel` `[E, in, out]`, with logical axis `names`."""

    shape: tuple[int, int, int]
    names: tuple[str, str, str]
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self):
        return self.param("kernel", named(nn.initializers.normal(0.02), self.names), self.shape, self.param_dtype)


class SparseMLP(nn.Module):
    """A sparse layer's feed-forward: routed experts plus the optional shared expert.

    `__call__(x_BSD, replay_BSK=None, covered_BS=None)` returns `(y_BSD in the compute dtype,
    RouterRecord)`; `replay_BSK` / `covered_BS` replay recorded experts (`Routes`)."""

    spec: SparseSpec
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSD, replay_BSK=None, covered_BS=None):
        m, F = self.spec.mixture, self.spec.features
        B, S, D = x_BSD.shape
        x_ND = x_BSD.reshape(B * S, D)
        router = Router(m, name="gate")
        experts = Experts(D, F, m.experts, self.param_dtype, name="experts")
        y_ND, record = route(router, experts, self.spec, x_ND, x_ND, B, self.dtype, replay_BSK, covered_BS)
        if m.shared_features:
            shared_ND = GatedMLP(m.shared_features, self.spec.activation, dtype=self.dtype,
                                 param_dtype=self.param_dtype, name="shared_experts")(x_ND).astype(F32)
            if m.shared_gate:
                gate_logit = Linear(1, dtype=self.dtype, param_dtype=self.param_dtype, names=("embed", None),
                                    name="shared_expert_gate")(x_ND)
                shared_ND = jax.nn.sigmoid(gate_logit.astype(F32)) * shared_ND
            y_ND = y_ND + shared_ND
        return y_ND.astype(self.dtype).reshape(B, S, D), record


class Experts(nn.Module):
    """The experts' stacked projections, in transformers' names: `gate_proj`, `up_proj` `[E, D, F]`
    and `down_proj` `[E, F, D]`, `[in, out]` per expert as Dew's linears are: each a `kernel`, or with
    `bare` this module's own parameters (Gemma 4's layout, `experts/gate_proj`)."""

    width: int
    features: int
    experts: int
    param_dtype: jnp.dtype
    bare: bool = False

    @nn.compact
    def __call__(self):
        E, D, F = self.experts, self.width, self.features
        up, down = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
        if self.bare:
            kernel = lambda name, shape, names: self.param(name, named(nn.initializers.normal(0.02), names), shape,
                                                           self.param_dtype)
        else:
            kernel = lambda name, shape, names: _StackedKernel(shape, names, self.param_dtype, name=name)()
        return (kernel("gate_proj", (E, D, F), up), kernel("up_proj", (E, D, F), up),
                kernel("down_proj", (E, F, D), down))


def route(router: Router, experts: Experts, spec: SparseSpec, route_ND, x_ND, rows: int, dtype, replay_BSK=None,
          covered_BS=None):
    """The routed experts' float32 output `[N, D]` for the tokens `x_ND` (`rows` rows of `N / rows`),
    chosen by `router` from `route_ND`, and the router's `RouterRecord` `[B, S, ...]`; `replay_BSK` /
    `covered_BS` replay recorded experts (`Routes`)."""
    m = spec.mixture
    B, S = rows, x_ND.shape[0] // rows
    replay_NK = None if replay_BSK is None else replay_BSK.reshape(B * S, m.top_k)
    covered_N = None if covered_BS is None else covered_BS.reshape(B * S)
    experts_NK, weights_NK, scores_NE, log_z_N = router(route_ND, replay_NK, covered_N)
    gate_EDF, up_EDF, down_EFD = (w.astype(dtype) for w in experts())
    slots_NK = experts_NK
    capacity = m.capacity(S)
    if capacity is not None:
        slots_NK = drop_overflow(experts_NK.reshape(B, S * m.top_k), m.experts, capacity).reshape(B * S, m.top_k)
    y_ND = dispatch(x_ND.astype(dtype), slots_NK, weights_NK, gate_EDF, up_EDF, down_EFD, spec.activation,
                    m.weighted_inputs)
    record = RouterRecord(experts=experts_NK.reshape(B, S, m.top_k), weights=weights_NK.reshape(B, S, m.top_k),
                          scores=scores_NE.reshape(B, S, m.experts), log_z=log_z_N.reshape(B, S))
    return y_ND, record


__all__ = ["DenseSparseSpec", "Experts", "Mixture", "Router", "RouterRecord", "Routes", "SparseMLP", "SparseSpec",
           "dispatch", "drop_overflow", "limit_groups", "route"]
