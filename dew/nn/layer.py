"""One decoder layer, described by a `LayerSpec`: a mixer, a feed-forward block, and where the norms sit.

A new mixer (latent attention, say) or feed-forward block (a mixture of experts, `dew.nn.moe`) is a
spec class in its own module with a `module(...)` builder; `DecoderLayer` builds whatever its spec
names. The layer's call signature is the scan body's, `(carry, knobs, context) -> (carry, report)`,
so a run of layers whose specs agree up to their per-layer values (`LayerSpec.scan_key`) runs as one
`nn.scan`, and what each layer reports, `(feed-forward's, mixer's)` (a sparse layer's `RouterRecord`;
what an attention mixer is asked for, a dict such as `{"qk_max": ..., "indexer": ...}`; None otherwise), comes out of a scanned run stacked by
layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from dew.nn.gemma3n import AltUp, AltUpLayer, Laurel, averaged
from dew.nn.gemma4 import layer_inputs
from dew.nn.linear import Linear
from dew.nn.mlp import ACTIVATIONS, DenseSpec
from dew.nn.moe import DenseSparseSpec, Experts, Router, SparseSpec, route
from dew.nn.norms import NORM_STYLES, RMSNorm

NORM_PLACEMENTS = ("pre", "sandwich", "post")
# The collection of per-layer values a checkpoint keeps as frozen buffers (`LayerSpec.output_scalar`).
CONSTANTS = "constants"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """A layer: its `mixer` (`AttentionSpec`, or a recurrent one such as `dew.nn.recurrent.RecurrentSpec`), its
    `feed_forward` (`DenseSpec`, `SparseSpec` for a mixture of experts, or None for none: a Mamba2
    block is its norm and its mixer) and its norms.

    `norm_placement` is "pre" (a norm before the mixer and the feed-forward; the latter is named
    `post_attention_layernorm`, as in Llama), "sandwich" (Gemma 2/3: also a norm after each
    sublayer, `pre_feedforward_layernorm` before the feed-forward) or "post" (OLMo 2: norms only
    after each sublayer, before the residual add). `norm_style` is the RMSNorm rounding
    (`dew.nn.norms`). `output_scalar` names a per-layer scalar `[1]` (initially 1) the layer's output is
    multiplied by (Gemma 4's `layer_scalar`), kept in the `constants` collection as transformers keeps
    the buffer, or in `params` with `trainable_scalar`. `residual_scale` multiplies each sublayer's
    output before the residual add (Granite's `residual_multiplier`).
    """

    mixer: Any
    feed_forward: DenseSpec | SparseSpec | DenseSparseSpec | None
    norm_placement: str = "pre"
    norm_style: str = "llama"
    norm_eps: float = 1e-6
    output_scalar: str | None = None
    trainable_scalar: bool = False
    residual_scale: float = 1.0
    per_layer_input: int = 0
    altup: AltUp | None = None
    laurel_rank: int = 0

    def __post_init__(self):
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement is {self.norm_placement!r}; it must be one of {list(NORM_PLACEMENTS)}")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(f"norm_style is {self.norm_style!r}; it must be one of {list(NORM_STYLES)}")
        if isinstance(self.feed_forward, DenseSparseSpec) and self.norm_placement != "sandwich":
            raise ValueError(f"norm_placement is {self.norm_placement!r}; a DenseSparseSpec (Gemma 4's) sits between "
                             "the sandwich's pre_feedforward_layernorm and post_feedforward_layernorm: use 'sandwich'")
        if (self.altup is not None or self.laurel_rank) and (self.feed_forward is None
                                                             or self.norm_placement != "sandwich"):
            raise ValueError("altup and laurel_rank are Gemma 3n's, whose layers have a feed-forward and the sandwich's "
                             "norms: give a feed_forward and norm_placement 'sandwich'")
        if self.laurel_rank < 0:
            raise ValueError(f"laurel_rank is {self.laurel_rank}; it is the LAuReL block's rank, 0 for none")

    def scan_key(self) -> "LayerSpec":
        """The spec with its per-layer values erased: consecutive layers with equal keys scan together."""
        return dataclasses.replace(self, mixer=self.mixer.scan_key())


@struct.dataclass
class LayerKnobs:
    """What differs between the layers of one scanned run, one value per layer (scanned over):
    `window` (int32; None when no layer of the run slides), `rope` (which rotary table of its width
    the mixer reads), `index` (the layer's number in the model), `local` (its number in the run,
    the index of its slice of the run's cache) and `replay` (int32 `[B, S, K]`, the experts a sparse
    layer replays; None without `Routes`). `windows` (static) holds the run's distinct windows, `NO_WINDOW`
    for its full layers: an accelerator kernel whose mask is static picks its layer's among them."""

    window: Any
    rope: jax.Array
    index: jax.Array
    local: jax.Array
    replay: Any = None
    windows: tuple[int, ...] = struct.field(pytree_node=False, default=())


@struct.dataclass
class LayerContext:
    """What every layer reads, broadcast over a run.

    `rotary` maps a rotated width to its stacked cos and sin tables, float32 `[R, B, S, width]` each.
    `slots_BS` are the query slots and `segments_BS` their documents (0 for padding). With a cache,
    `write_slots_BS` says where each token is stored (the capacity for padding, which is dropped)
    and `filled_BT` marks, per row, the slots that hold a token once this call's tokens are written.
    `covered_BS` marks the tokens whose replayed experts (`LayerKnobs.replay`) apply (None: all).
    `groups_BS` (and a cache's `key_groups_BT`) number the image behind each slot, whose tokens read each other
    in both directions; with `sliding_groups` (Gemma 4) only sliding layers read them so.
    `report_indexer` asks latent mixers with an indexer for their `dew.nn.mla.IndexerRecord`, and
    `report_qk` every softmax-attention mixer for its largest logit per row and head (`qk_max`).
    `fresh_cache` says the cache held no token before this call (`dew.nn.kv_cache.Cache.fresh`), and
    `segmented` (static) that `segments_BS` may hold more than one document or padding (False: all ones).
    `shared_kv` holds the keys and values a "reuse" attention layer reads (`AttentionSpec.shared_kv`), and
    `per_layer_BSLP` every layer's per-layer input `[B, S, L, P]` (Gemma 4; None elsewhere).
    `positions_BS` are the queries' positions (the rotary angles'; chunked attention and query
    temperature read them too; None where no layer reads them). `key_slots_BT` gives each cached key the slot the mask rule reads (None: its index in the cache;
    `dew.nn.diffusion_gemma` gives positions). With `read_only_cache` the cache is a prefix this call
    reads and does not write: attention reads the cached keys (`filled_BT`, `key_slots_BT`), then the
    call's own (`segments_BS`, `slots_BS`), and the cache comes back as it was.
    """

    rotary: dict
    slots_BS: jax.Array
    segments_BS: jax.Array
    write_slots_BS: jax.Array | None = None
    filled_BT: jax.Array | None = None
    covered_BS: jax.Array | None = None
    report_indexer: bool = struct.field(pytree_node=False, default=False)
    report_qk: bool = struct.field(pytree_node=False, default=False)
    fresh_cache: bool = struct.field(pytree_node=False, default=False)
    segmented: bool = struct.field(pytree_node=False, default=True)
    key_slots_BT: jax.Array | None = None
    read_only_cache: bool = struct.field(pytree_node=False, default=False)
    groups_BS: jax.Array | None = None
    key_groups_BT: jax.Array | None = None
    sliding_groups: bool = struct.field(pytree_node=False, default=False)
    positions_BS: jax.Array | None = None
    shared_kv: tuple | None = None
    per_layer_BSLP: jax.Array | None = None


class DecoderLayer(nn.Module):
    """`x + mixer(norm(x))`, then `x + feed_forward(norm(x))`, with the norms where the spec puts them,
    times the spec's output scalar when it names one.

    The carry is `(x_BSE, cache, kept)`: the residual stream, this run's cache (None without one),
    and the outputs of the layers listed in `keep`, each replaced when this layer's index matches.
    """

    spec: LayerSpec
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    keep: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, carry, knobs: LayerKnobs, context: LayerContext):
        x, cache, kept = carry
        s = self.spec
        norm = lambda name: RMSNorm(s.norm_eps, s.norm_style, dtype=self.dtype, param_dtype=self.param_dtype,
                                    name=name)
        mixer = s.mixer.module(norm_style=s.norm_style, norm_eps=s.norm_eps, dtype=self.dtype,
                               param_dtype=self.param_dtype, name="self_attn")
        if s.feed_forward is not None and not isinstance(s.feed_forward, DenseSparseSpec):
            feed_forward = s.feed_forward.module(dtype=self.dtype, param_dtype=self.param_dtype, name="mlp")
        width = s.mixer.rope()[0]
        cos_RBSD, sin_RBSD = context.rotary[width]
        rotary = (cos_RBSD[knobs.rope], sin_RBSD[knobs.rope])
        altup = None
        if s.altup is None:
            x_BSE = x
        else:  # the layer runs on the active stream's prediction
            altup = AltUpLayer(s.altup, x.shape[-1], s.norm_eps, s.norm_style, self.dtype, self.param_dtype,
                               name="altup")
            predicted_KBSE = altup.predict(x)
            x_BSE = predicted_KBSE[s.altup.active]

        mixer_in = x_BSE if s.norm_placement == "post" else norm("input_layernorm")(x_BSE)
        mixed, cache, mixer_report = mixer(mixer_in, rotary, context, knobs, cache)
        if s.norm_placement != "pre":
            mixed = norm("post_attention_layernorm")(mixed)
        x_BSE = x_BSE + self._scaled(mixed)
        if s.laurel_rank:
            x_BSE = averaged(x_BSE, Laurel(s.laurel_rank, s.norm_eps, s.norm_style, self.dtype, self.param_dtype,
                                           name="laurel")(mixer_in))
        if s.feed_forward is None:
            return self._finish(x_BSE, cache, kept, knobs, None, mixer_report)
        ff_norm = {"pre": "post_attention_layernorm", "sandwich": "pre_feedforward_layernorm"}.get(s.norm_placement)
        fed_in = x_BSE if ff_norm is None else norm(ff_norm)(x_BSE)
        if isinstance(s.feed_forward, SparseSpec):
            fed, report = feed_forward(fed_in, knobs.replay, context.covered_BS)
        elif isinstance(s.feed_forward, DenseSparseSpec):
            fed, report = self._dense_beside_sparse(s.feed_forward, fed_in, x_BSE, norm, knobs, context)
        else:
            fed, report = feed_forward(fed_in), None
        if s.norm_placement != "pre":
            fed = norm("post_feedforward_layernorm")(fed)
        x_BSE = x_BSE + self._scaled(fed)
        if altup is not None:
            return self._finish(self._corrected(altup, predicted_KBSE, x_BSE, knobs, context, norm), cache, kept,
                                knobs, report, mixer_report)
        if s.per_layer_input:
            x_BSE = x_BSE + self._per_layer_gate(x_BSE, layer_inputs(context.per_layer_BSLP, knobs.index), norm)
        return self._finish(x_BSE, cache, kept, knobs, report, mixer_report)

    def _corrected(self, altup: AltUpLayer, predicted_KBSE, out_BSE, knobs, context, norm):
        """Gemma 3n's streams after the layer `[K, B, S, E]`: AltUp's correction by the layer's output, and the
        per-layer gate of the corrected active stream added to every stream after the first."""
        s = self.spec
        streams_KBSE = altup.correct(predicted_KBSE, out_BSE)
        if not s.per_layer_input:
            return streams_KBSE
        active_BSE = streams_KBSE[s.altup.active]
        if s.altup.scale_output:
            active_BSE = altup.scaled_output(active_BSE)
        gated_BSE = self._per_layer_gate(active_BSE, layer_inputs(context.per_layer_BSLP, knobs.index), norm)
        return streams_KBSE.at[1:].add(gated_BSE[None])

    def _per_layer_gate(self, x_BSE, inputs_BSP, norm):
        """Gemma 4's and 3n's use of the layer's per-layer input `[B, S, P]`: `norm(proj(act(gate(x)) * input))`,
        `act` the MLP's activation."""
        dense_spec = self.spec.feed_forward
        activation = ACTIVATIONS[getattr(dense_spec, "dense", dense_spec).activation]
        dense = lambda features, names, name: Linear(features, dtype=self.dtype, param_dtype=self.param_dtype,
                                                     names=names, name=name)
        gate_BSP = dense(self.spec.per_layer_input, ("embed", "mlp"), "per_layer_input_gate")(x_BSE)
        gated_BSP = activation(gate_BSP.astype(jnp.float32)).astype(self.dtype) * inputs_BSP.astype(self.dtype)
        out_BSE = dense(x_BSE.shape[-1], ("mlp", "embed"), "per_layer_projection")(gated_BSP)
        return norm("post_per_layer_input_norm")(out_BSE)

    def _scaled(self, sublayer_BSE):
        """A sublayer's output times the spec's `residual_scale`, in its own dtype, as transformers rounds it."""
        scale = self.spec.residual_scale
        return sublayer_BSE if scale == 1.0 else sublayer_BSE * jnp.asarray(scale, sublayer_BSE.dtype)

    def _finish(self, x_BSE, cache, kept, knobs: LayerKnobs, report, mixer_report):
        """The layer's output times its scalar (when the spec names one), kept where asked, and the carry."""
        s = self.spec
        if s.output_scalar is not None:
            ones = lambda *_: jnp.ones((1,), self.param_dtype)
            if s.trainable_scalar:
                scalar = self.param(s.output_scalar, ones)
            else:
                scalar = self.variable(CONSTANTS, s.output_scalar, ones).value
            x_BSE = x_BSE * scalar.astype(x_BSE.dtype)
        kept = tuple(jnp.where(knobs.index == layer, x_BSE, states) for layer, states in zip(self.keep, kept))
        return (x_BSE, cache, kept), (report, mixer_report)

    def _dense_beside_sparse(self, spec: DenseSparseSpec, normed_BSE, x_BSE, norm, knobs, context):
        """Gemma 4's feed-forward (`DenseSparseSpec`) on the residual `x_BSE` and its pre-norm `normed_BSE`:
        the sum of both halves, and the router's record."""
        dense = spec.dense.module(dtype=self.dtype, param_dtype=self.param_dtype, name="mlp")(normed_BSE)
        B, S, E = x_BSE.shape
        m = spec.sparse.mixture
        router = Router(m, self.spec.norm_eps, self.dtype, self.param_dtype, name="router")
        experts = Experts(E, spec.sparse.features, m.experts, self.param_dtype, bare=True, name="experts")
        x_NE = x_BSE.reshape(B * S, E)
        sparse_NE, report = route(router, experts, spec.sparse, x_NE, norm("pre_feedforward_layernorm_2")(x_NE), B,
                                  self.dtype, knobs.replay, context.covered_BS)
        sparse_BSE = norm("post_feedforward_layernorm_2")(sparse_NE.astype(self.dtype).reshape(B, S, E))
        return norm("post_feedforward_layernorm_1")(dense) + sparse_BSE, report
