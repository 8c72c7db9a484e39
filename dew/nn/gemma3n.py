"""Gemma 3n's text decoder layers (`DecoderConfig.gemma3n`): AltUp, LAuReL and how its per-layer inputs enter.

- AltUp (`AltUp`): the residual stream is `inputs` K streams `[K, B, S, E]`; a layer runs on one of them (the
  `active` one) and updates the others from it. Before the layer, each stream is predicted as itself plus a mix
  of all K, `x_i + sum_k P_ik x_k`, the coefficients `P` (`prediction_coefs`, K * K of them) computed per token
  from the active stream (`modality_router` over `router_norm(x) / E`, then tanh). After it, every prediction is
  corrected by the layer's change to the active one, `pred_i + (out - pred_active) * (1 + c_i)`, the `c` from the
  layer's output by the same router (`correction_coefs`). While training (a `dropout` rng given, as the training
  losses give one) both coefficient matrices are clipped to `[-clip, clip]`: the prediction's straight through
  (transformers clamps that weight in place, so its gradient is the unclipped one's), the correction's as a clip.
  The embeddings become the streams with `altup_projections` (stream 0 the embeddings, stream k their projection
  rescaled to the embeddings' root mean square), and the streams merge after the last layer with
  `altup_unembed_projections` the same way, averaged (`AltUpStreams`).
- LAuReL (`laurel_rank` r > 0): beside attention, a rank-r map of the normed input, `x + norm(right(left(x)))`,
  is added to the attention's residual sum and the pair averaged in variance (divided by `sqrt(2)`).
- Per-layer inputs (as Gemma 4's, `dew.nn.gemma4.PerLayerInputs`) gate the corrected active stream (times
  `correct_output_scale` with `scale_output`), and the gated projection is added to every stream after the
  first.
- The last `kv_shared_layers` layers read an earlier layer's keys and values, as Gemma 4's
  (`dew.nn.gemma4.kv_roles`); `sparsity` gives each layer's MLP its activation sparsity (`DenseSpec.sparsity`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import dot
from dew.nn.gemma4 import kv_roles
from dew.nn.linear import Linear, named
from dew.nn.norms import RMSNorm


@dataclasses.dataclass(frozen=True)
class AltUp:
    """A layer's AltUp (see the module): `inputs` streams, the `active` one run through the layer, coefficients
    clipped to `clip` while training (None: never), the corrected active stream times `correct_output_scale`
    before its per-layer gate with `scale_output`."""

    inputs: int = 4
    active: int = 0
    clip: float | None = 120.0
    scale_output: bool = True

    def __post_init__(self):
        if self.inputs < 1:
            raise ValueError(f"altup inputs is {self.inputs}; it counts the residual streams, at least 1")
        if not 0 <= self.active < self.inputs:
            raise ValueError(f"altup active is {self.active}; it is the stream the layer runs on, 0 to "
                             f"{self.inputs - 1} of {self.inputs}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"altup clip is {self.clip}; it bounds the coefficients' size, above 0 (None: no clip)")


@dataclasses.dataclass(frozen=True)
class Gemma3nLayers:
    """Gemma 3n's layer options (see the module). `per_layer_vocab` is the per-layer table's rows (None: the
    model's vocabulary; ids past it read row 0); `sparsity` is each layer's activation sparsity (empty: none)."""

    altup_inputs: int = 4
    altup_active: int = 0
    altup_clip: float | None = 120.0
    altup_scale_output: bool = True
    laurel_rank: int = 64
    per_layer_width: int = 256
    per_layer_vocab: int | None = None
    kv_shared_layers: int = 0
    sparsity: tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "sparsity", tuple(float(s) for s in self.sparsity))
        self.altup  # noqa: B018 - checks the AltUp fields
        for name in ("laurel_rank", "per_layer_width", "kv_shared_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"gemma3n {name} is {getattr(self, name)}; it is a count, 0 for none")
        if self.per_layer_vocab is not None and self.per_layer_vocab < 1:
            raise ValueError(f"gemma3n per_layer_vocab is {self.per_layer_vocab}; it must be at least 1, or None for "
                             "the model's own")

    @property
    def altup(self) -> AltUp:
        return AltUp(self.altup_inputs, self.altup_active, self.altup_clip, self.altup_scale_output)

    def layer_sparsity(self, layers: int) -> tuple[float, ...]:
        """Each of `layers` layers' activation sparsity; a `sparsity` of another length is refused."""
        if not self.sparsity:
            return (0.0,) * layers
        if len(self.sparsity) != layers:
            raise ValueError(f"gemma3n sparsity gives {len(self.sparsity)} values for {layers} layers: give one per "
                             "layer (0 for a dense gate), or none")
        return self.sparsity

    def kv_roles(self, kinds: tuple[str, ...]) -> tuple[str | None, ...]:
        """Each layer's part in sharing keys and values (`dew.nn.gemma4.kv_roles`)."""
        return kv_roles(kinds, self.kv_shared_layers, "gemma3n")


class _Coefficients(nn.Module):
    """`x @ kernel` (`kernel` `[in, features]`, its entries clipped to `clip` where given, the gradient passed
    straight through the clip with `straight_through`)."""

    features: int
    straight_through: bool
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, clip: float | None):
        kernel = self.param("kernel", named(nn.initializers.normal(0.02), (None, None)), (x.shape[-1], self.features),
                            self.param_dtype)
        if clip is not None:
            clipped = jnp.clip(kernel, -clip, clip)
            if self.straight_through:  # the clipped values exactly (kernel - kernel is 0), the unclipped gradient
                clipped = jax.lax.stop_gradient(clipped) + (kernel - jax.lax.stop_gradient(kernel))
            kernel = clipped
        x_NK = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        return dot(x_NK, kernel.astype(self.dtype), out_dtype=self.dtype).reshape(*x.shape[:-1], self.features)


class AltUpLayer(nn.Module):
    """One layer's AltUp (see the module), over `width`-wide streams `[K, B, S, E]`."""

    spec: AltUp
    width: int
    norm_eps: float
    norm_style: str
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        K = self.spec.inputs
        self.router_norm = RMSNorm(self.norm_eps, self.norm_style, dtype=self.dtype, param_dtype=self.param_dtype)
        self.modality_router = Linear(K, dtype=self.dtype, param_dtype=self.param_dtype, names=("embed", None))
        self.prediction_coefs = _Coefficients(K * K, True, self.dtype, self.param_dtype)
        self.correction_coefs = _Coefficients(K, False, self.dtype, self.param_dtype)
        self.correct_output_scale = self.param("correct_output_scale", named(nn.initializers.zeros_init(), ("norm",)),
                                               (self.width,), self.param_dtype)

    def _clip(self) -> float | None:
        return self.spec.clip if self.has_rng("dropout") else None  # clipped while training only

    def _modalities(self, x_BSE):
        routed = self.modality_router(self.router_norm(x_BSE) * jnp.asarray(self.width ** -1.0, self.dtype))
        return jnp.tanh(routed.astype(jnp.float32)).astype(self.dtype)  # [B, S, K]

    def predict(self, streams_KBSE):
        """Each stream predicted from all of them, `x_i + sum_k P_ik x_k` `[K, B, S, E]`."""
        K = self.spec.inputs
        modalities = self._modalities(streams_KBSE[self.spec.active])
        coefs_BSIK = self.prediction_coefs(modalities, self._clip())
        coefs_BSIK = coefs_BSIK.reshape(*coefs_BSIK.shape[:-1], K, K)
        mixed_KBSE = jnp.einsum("bsik,kbse->ibse", coefs_BSIK, streams_KBSE)
        return (mixed_KBSE + streams_KBSE).astype(streams_KBSE.dtype)

    def correct(self, predicted_KBSE, out_BSE):
        """The predictions moved by the layer's change to the active one, `pred_i + (out - pred_a) * (1 + c_i)`."""
        modalities = self._modalities(out_BSE)
        coefs_BSK = self.correction_coefs(modalities, self._clip()) + 1.0
        change_BSE = out_BSE - predicted_KBSE[self.spec.active]
        coefs_KBS1 = jnp.moveaxis(coefs_BSK, -1, 0)[..., None]
        return (change_BSE[None] * coefs_KBS1 + predicted_KBSE).astype(out_BSE.dtype)

    def scaled_output(self, active_BSE):
        """The corrected active stream times `correct_output_scale` (in float32, rounded once)."""
        return (active_BSE.astype(jnp.float32) * self.correct_output_scale.astype(jnp.float32)).astype(active_BSE.dtype)


class Laurel(nn.Module):
    """LAuReL of `rank` (see the module): `x + norm(right(left(x)))` of the layer's normed input `[B, S, E]`."""

    rank: int
    norm_eps: float
    norm_style: str
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSE):
        dense = lambda features, names, name: Linear(features, dtype=self.dtype, param_dtype=self.param_dtype,
                                                     names=names, name=name)
        low_BSR = dense(self.rank, ("embed", "mlp"), "linear_left")(x_BSE)
        back_BSE = dense(x_BSE.shape[-1], ("mlp", "embed"), "linear_right")(low_BSR)
        return x_BSE + RMSNorm(self.norm_eps, self.norm_style, dtype=self.dtype, param_dtype=self.param_dtype,
                               name="post_laurel_norm")(back_BSE)


def averaged(a_BSE, b_BSE):
    """`(a + b) / sqrt(2)`: LAuReL's sum with the attention's residual, averaged in variance."""
    return (a_BSE + b_BSE) / jnp.asarray(math.sqrt(2.0), a_BSE.dtype)


def _rescaled(x_BSE, target_BS1):
    """`x` rescaled to the root mean square `target` (its own floored at sqrt(1e-5))."""
    size_BS1 = jnp.sqrt(jnp.maximum(jnp.mean(jnp.square(x_BSE), axis=-1, keepdims=True), 1e-5))
    return x_BSE * target_BS1 / size_BS1


def _root_mean_square(x_BSE):
    return jnp.sqrt(jnp.mean(jnp.square(x_BSE), axis=-1, keepdims=True))


def split_streams(x_BSE, projections) -> jax.Array:
    """The embeddings as AltUp's streams `[K, B, S, E]`: themselves, then each of `projections` (K - 1 maps, the
    `altup_projections`) of them rescaled to their root mean square."""
    target_BS1 = _root_mean_square(x_BSE)
    return jnp.stack([x_BSE, *(_rescaled(project(x_BSE), target_BS1) for project in projections)])


def merge_streams(streams_KBSE, projections) -> jax.Array:
    """AltUp's streams merged to `[B, S, E]`: stream 0 and each later one through its projection (the
    `altup_unembed_projections`) rescaled to stream 0's root mean square, averaged."""
    target_BS1 = _root_mean_square(streams_KBSE[0])
    merged = [streams_KBSE[0], *(_rescaled(project(stream), target_BS1)
                                 for project, stream in zip(projections, streams_KBSE[1:]))]
    return jnp.mean(jnp.stack(merged), axis=0)
