"""`CausalTransformer`: the one decoder every family configures, a sequence of layer specs.

Its parameter tree uses the transformers decoder names (`embed_tokens`, `layers_N.self_attn.q_proj`,
`mlp.gate_proj`, `norm`, `lm_head`), so a checkpoint maps tensor to tensor. `DecoderConfig` holds the
global knobs and describes each layer as a `LayerSpec` (`DecoderConfig.layer_specs`): its mixer and
its feed-forward block. Runs of layers that differ only in per-layer values (window, rotary table)
are scanned (`dew.nn.stack`), so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from flax import struct

from dew import compilation_cache
from dew.data.inputs import ModelInputs, text_fields
from dew.kernels import policy as kernel_policy
from dew.kernels import accelerator_attention
from dew.kernels import blocks
from dew.kernels.int8 import dequantize
from dew.lazy import kept
from dew.sharding import rows_split

from dew.nn.attention import AttentionSpec, NoPE
from dew.nn.head import Head
from dew.nn.kv_cache import Cache
from dew.nn.linear import EMBED_BLOCKS, KERNEL_BLOCKS, KERNEL_SCALE, QUANT_COLLECTION, Linear, named
from dew.nn.layer import NORM_PLACEMENTS, LayerContext, LayerSpec
from dew.nn.gated_deltanet import GatedDeltaNet
from dew.nn.gemma3n import Gemma3nLayers, merge_streams, split_streams
from dew.nn.gemma4 import REUSE, Gemma4Layers, PerLayerInputs
from dew.nn.mamba2 import Mamba2
from dew.nn.mla import LatentAttention, MLASpec
from dew.nn.mlp import ACTIVATIONS, DenseSpec
from dew.nn.moe import DenseSparseSpec, Mixture, Routes, SparseSpec
from dew.nn.mtp import mtp_states
from dew.nn.norms import NORM_STYLES, RMSNorm
from dew.nn.quantize import EMBED_SCALE
from dew.nn.recurrent import RecurrentSpec
from dew.nn.rotary import RopeScaling, rotated_width
from dew.nn.stack import REMAT_POLICIES, apply_layers, rotary_tables, runs, stack_variables, unstack_variables

# The knobs of grouped-query attention that latent attention does not have, and their neutral values.
_NOT_LATENT = {"causal": True, "sliding_window": None, "layer_types": None, "qk_norm": False, "query_scale": None,
               "attn_softcap": None, "attn_output_gate": False}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
# The recurrent mixers' shapes (`DecoderConfig.recurrent`).
_RECURRENT = (Mamba2, GatedDeltaNet)
CHUNKED = "chunked_attention"


def as_dtype(value) -> jnp.dtype:
    """Accept `jnp.bfloat16`, `np.dtype('bfloat16')` or the string `"bfloat16"`."""
    if isinstance(value, str):
        if value not in _DTYPES:
            raise ValueError(f"dtype {value!r} is not one of {sorted(_DTYPES)}")
        return jnp.dtype(_DTYPES[value])
    return jnp.dtype(value)


def _from_fields(kind: type) -> Callable[[str, object], object]:
    """A dict (a config read back from JSON) as the dataclass `kind`, its unknown keys refused by name;
    any other value as given."""
    def convert(name: str, value):
        if not isinstance(value, Mapping):
            return value
        fields = [field.name for field in dataclasses.fields(kind)]
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise TypeError(f"{name} has no fields {unknown}; its fields are {fields}")
        return kind(**value)

    return convert


def _recurrent(name: str, value):
    """A recurrent mixer's shape read back from JSON (a dict of its fields) as the one shape class whose
    fields it names; any other value as given."""
    if not isinstance(value, Mapping):
        return value
    kinds = [kind for kind in _RECURRENT if set(value) <= {field.name for field in dataclasses.fields(kind)}]
    if len(kinds) != 1:
        known = {kind.__name__: [field.name for field in dataclasses.fields(kind)] for kind in _RECURRENT}
        raise TypeError(f"{name} names fields {sorted(value)}, which {'no' if not kinds else 'more than one'} "
                        f"recurrent mixer has: give every field of one of {known}")
    return kinds[0](**value)


# Each field a caller may give in a convenient form, and how it becomes the stored one (in this order).
_CONVERSIONS: dict[str, Callable[[str, object], object]] = {
    "dtype": lambda name, value: as_dtype(value),
    "param_dtype": lambda name, value: as_dtype(value),
    "rope_scaling": _from_fields(RopeScaling),
    "local_rope_scaling": _from_fields(RopeScaling),
    "mixture": _from_fields(Mixture),
    "latent": _from_fields(LatentAttention),
    "recurrent": _recurrent,
    "nope": _from_fields(NoPE),
    "gemma4": _from_fields(Gemma4Layers),
    "gemma3n": _from_fields(Gemma3nLayers),
    "layer_types": lambda name, value: None if value is None else tuple(value),
}
# The string knobs and the values each may take.
_CHOICES = {"norm_style": NORM_STYLES, "norm_placement": NORM_PLACEMENTS,
            "qk_norm_scope": ("head", "projection", "l2"),
            "activation": tuple(ACTIVATIONS), "remat": ("auto", *REMAT_POLICIES), "kernels": kernel_policy.POLICIES,
            "attention": accelerator_attention.IMPLS}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The shape and numerics of a `CausalTransformer`.

    `head_dim` defaults to `emb_features // num_heads`, `num_kv_heads` to `num_heads` and
    `mlp_features` to `4 * emb_features`. `dtype` is the compute dtype (activations, matmul operands);
    `param_dtype` is how parameters are stored.

    The family knobs, each named after what it computes:
    - `qkv_bias`, `o_bias`, `mlp_bias`: biases on the query/key/value, output and MLP projections.
    - `norm_style`: the RMSNorm rounding, "llama", "olmo" or "gemma" (`(1 + scale)`; see `dew.nn.norms`).
    - `norm_placement`: "pre" (norm before attention and MLP; the MLP's norm is named
      `post_attention_layernorm`, as in Llama), "sandwich" (Gemma 2/3: also a norm after each
      sublayer, `pre_feedforward_layernorm` before the MLP) or "post" (OLMo 2: norms only after each
      sublayer, before the residual add).
    - `qk_norm_scope`: with `qk_norm`, normalise per head ("head") or the whole projection ("projection"),
      or divide each head by its rms, without a scale, after the rotation ("l2", Llama 4's).
    - `scale_embeddings`: multiply the embeddings by `sqrt(emb_features)` rounded to `dtype` (Gemma);
      `embedding_scale` multiplies them by itself in `dtype` (Granite's `embedding_multiplier`).
    - `residual_scale`: each sublayer's output times it before the residual add (Granite's
      `residual_multiplier`; `LayerSpec.residual_scale`).
    - `logit_divisor`: the output logits divided by it, after any cap (Granite's `logits_scaling`).
    - `activation`: the MLP gate's "silu", "gelu_tanh" or "gelu".
    - `query_scale`: the attention scores' factor (default `head_dim ** -0.5`); `attn_softcap` caps
      the scores, `logit_softcap` the output logits, `c * tanh(x / c)`.
    - `rope_scaling`: how the rotary frequencies are stretched past the pretraining length (a
      `dew.nn.rotary.RopeScaling`, or its fields as a dict); the default scales nothing (and, with a
      `rotated_fraction`, turns only the first features of each head: Qwen3-Next's partial rotary).
    - `attn_output_gate`: attention's `q_proj` also gives a gate per head, and the attention's output
      is multiplied by its sigmoid before `o_proj` (Qwen3-Next, Qwen 3.5).
    - `layer_types`: one "full_attention", "sliding_attention", "chunked_attention" or "linear_attention"
      per layer; only sliding layers use `sliding_window`, `local_rope_theta` (default `rope_theta`) and
      `local_rope_scaling` (default `rope_scaling`); a chunked layer's query reads only the keys in its
      own chunk of `attention_chunk_size` positions (Llama 4's local layers); a linear layer's mixer is
      the recurrent one (`recurrent`). Without it, every layer is attention and uses `sliding_window`.
    - `nope`: the layers without rotary positions and, for Llama 4's global layers, their query
      temperature (`dew.nn.attention.NoPE`, or its fields as a dict; SmolLM3's `no_rope_layers` too).
    - `recurrent`: the shape of the recurrent mixers of the "linear_attention" layers
      (`dew.nn.mamba2.Mamba2` or `dew.nn.gated_deltanet.GatedDeltaNet`, or its fields as a dict), as
      `latent` is attention's.
    - `mlp_features`: the dense MLP's hidden units; 0 for layers without a feed-forward (Mamba2's).
    - `scan_layers`: the fewest like layers in a row that run as one `nn.scan` (one compiled body, so
      compile time stays flat in depth); shorter runs are unrolled, which runs the train step faster
      on CPU at small widths (docs/performance.md). 0 unrolls every layer, 1 scans every run.
    - `remat`: what a layer keeps for the backward pass (`dew.nn.stack.REMAT_POLICIES`): "none" (everything),
      "dots" (every product's output, the accelerator attention kernel's included), "dots_no_batch" (the
      linears' outputs; attention runs again), "dots_no_mlp" (attention's side; the feed-forward runs again),
      "full" (nothing: the layer runs again); "auto", the default, lets the trainer pick the first of "none",
      "dots", "dots_no_mlp", "full" whose step fits the accelerator's memory (`dew.training.memory`; "none" on
      the CPU and outside training).
    - `attention_dropout`: the dropout rate a checkpoint was trained with on the attention
      probabilities. It changes nothing at inference; Dew does not apply dropout, so training
      objectives refuse a model whose rate is above zero.
    - `mixture`: a mixture of experts (`dew.nn.moe.Mixture`, or its fields as a dict) in the layers
      it names; their feed-forward is routed experts, the others' the dense MLP.
    - `latent`: latent attention (`dew.nn.mla.LatentAttention`, or its fields as a dict) as every
      layer's mixer instead of grouped-query attention (DeepSeek V2/V3); `head_dim` and
      `num_kv_heads` then describe nothing and are ignored.
    - `gemma4`: Gemma 4's layer options (`dew.nn.gemma4.Gemma4Layers`, or its fields as a dict): the full
      layers' own head width and key/value heads, values from the key projection, per-layer inputs and
      keys and values shared by the last layers; with it every layer norms its values (no scale) and
      multiplies its output by a frozen `layer_scalar`, and a `mixture`'s experts run beside the dense MLP
      (`dew.nn.moe.DenseSparseSpec`) rather than in its place.
    - `gemma3n`: Gemma 3n's layer options (`dew.nn.gemma3n.Gemma3nLayers`, or its fields as a dict): AltUp's
      residual streams, LAuReL, per-layer inputs, keys and values shared by the last layers and each layer's
      activation sparsity; with it every layer norms its values (no scale).
    - `mtp_depths`: DeepSeek's multi-token-prediction modules after the last layer (`dew.nn.mtp`);
      depth d predicts the token d + 1 ahead. 0: none.
    - `kernels`: which kernels run the model's products (`dew.kernels.policy`): "auto" (Dew's native
      CPU kernels where the shipped kernel table chooses them), "native" (wherever they can run), "xla"
      (XLA's own products only) or "exact" (as "auto", but GGUF blocks multiply float32 activations
      rather than integer-rounded ones). The environment variable `DEW_KERNELS` overrides it.
    - `attention`: which kernel runs a whole pass's attention (`dew.kernels.accelerator_attention`): "auto"
      (Pallas's splash on a TPU, cuDNN's on a GPU where it applies, Dew's own elsewhere), "splash", "cudnn"
      (refused where the backend cannot run it) or "xla" (Dew's own everywhere).
    """

    vocab_size: int
    emb_features: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    mlp_features: int | None = None
    head_dim: int | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    qk_norm: bool = False
    tie_embeddings: bool = False
    causal: bool = True
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logit_softcap: float | None = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_style: str = "llama"
    norm_placement: str = "pre"
    qk_norm_scope: str = "head"
    scale_embeddings: bool = False
    activation: str = "silu"
    query_scale: float | None = None
    attn_softcap: float | None = None
    attn_output_gate: bool = False
    layer_types: tuple[str, ...] | None = None
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_divisor: float = 1.0
    local_rope_theta: float | None = None
    rope_scaling: RopeScaling = RopeScaling()
    local_rope_scaling: RopeScaling | None = None
    attention_dropout: float = 0.0
    mixture: Mixture | None = None
    latent: LatentAttention | None = None
    recurrent: Mamba2 | GatedDeltaNet | None = None
    nope: NoPE | None = None
    gemma4: Gemma4Layers | None = None
    gemma3n: Gemma3nLayers | None = None
    mtp_depths: int = 0
    scan_layers: int = 8
    remat: str = "auto"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernels: str = "auto"
    attention: str = "auto"

    def __post_init__(self):
        for name, value in self._normalized().items():
            object.__setattr__(self, name, value)
        self._check()

    def _normalized(self) -> dict:
        """Every field given in a convenient form, in its stored form: dtype names as dtypes, the dicts a
        config read back from JSON holds as their dataclasses, `layer_types` as a tuple; then the
        defaults that derive from other fields (`num_kv_heads`, `head_dim`, `mlp_features`), by name."""
        normalized = {name: convert(name, getattr(self, name)) for name, convert in _CONVERSIONS.items()}
        num_heads, emb_features = self.num_heads, self.emb_features
        if self.num_kv_heads is None:
            normalized["num_kv_heads"] = num_heads
        if self.head_dim is None and num_heads >= 1:  # below 1, `_check` names num_heads
            if emb_features % num_heads:
                raise ValueError(
                    f"emb_features {emb_features} is not divisible by num_heads {num_heads}: "
                    "pass head_dim explicitly or pick a width that divides"
                )
            normalized["head_dim"] = emb_features // num_heads
        if self.mlp_features is None:
            normalized["mlp_features"] = 4 * emb_features
        return normalized

    def _check(self) -> None:
        """Refuse a normalized config that describes no decoder Dew computes, naming the field."""
        positive = ("vocab_size", "emb_features", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "max_seq_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be at least 1")
        if self.mlp_features < 0:
            raise ValueError(f"mlp_features is {self.mlp_features}; use 0 for layers without a feed-forward")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}: "
                "every key/value head must serve the same number of query heads"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd; rotary positions rotate pairs of features")
        rotated = rotated_width(self.head_dim, self.rope_scaling)
        if rotated < 2 or rotated % 2:
            raise ValueError(f"rope_scaling rotated_fraction {self.rope_scaling.rotated_fraction} turns {rotated} of "
                             f"head_dim {self.head_dim} features; rotary positions rotate pairs: choose a fraction "
                             "that turns an even number, at least 2")
        if self.scan_layers < 0:
            raise ValueError(f"scan_layers is {self.scan_layers}; it is the fewest like layers scanned together, "
                             "0 to unroll every layer")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout is {self.attention_dropout}; it is a rate in [0, 1)")
        for name in ("embedding_scale", "residual_scale", "logit_divisor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be positive (1.0 changes nothing)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window is {self.sliding_window}; use None for full attention or a width >= 1")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} is {getattr(self, name)!r}; it must be one of {list(allowed)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers but num_layers is {self.num_layers}")
            unknown = sorted(set(self.layer_types) - {FULL, SLIDING, CHUNKED, LINEAR})
            if unknown:
                raise ValueError(f"layer_types holds {unknown}; each layer is {FULL!r}, {SLIDING!r}, {CHUNKED!r} or "
                                 f"{LINEAR!r}")
            if (LINEAR in self.layer_types) != (self.recurrent is not None):
                raise ValueError(f"recurrent is {self.recurrent!r} and layer_types names "
                                 f"{self.layer_types.count(LINEAR)} {LINEAR!r} layers: the recurrent mixer's shape "
                                 "and the layers it mixes come together (give both, or neither)")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError(f"layer_types names {SLIDING!r} layers but sliding_window is None: give the width")
            if (CHUNKED in self.layer_types) != (self.attention_chunk_size is not None):
                raise ValueError(f"attention_chunk_size is {self.attention_chunk_size!r} and layer_types names "
                                 f"{self.layer_types.count(CHUNKED)} {CHUNKED!r} layers: the chunk and the layers "
                                 "that read it come together (give both, or neither)")
        else:
            if self.attention_chunk_size is not None:
                raise ValueError(f"attention_chunk_size {self.attention_chunk_size} applies to chunked layers: give "
                                 f"layer_types naming them ({CHUNKED!r}), or drop it")
            for name in ("local_rope_theta", "local_rope_scaling"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to sliding layers: give layer_types too, or drop it")
            if self.recurrent is not None:
                raise ValueError("recurrent is the mixer of the linear_attention layers: give layer_types naming them")
        if self.mixture is not None:
            outside = [i for i in self.mixture.layers or () if i >= self.num_layers]
            if outside:
                raise ValueError(f"mixture layers {outside} are not layers of this {self.num_layers}-layer model")
            if not self.mlp_features and not self.mixture.expert_features:
                raise ValueError("mlp_features is 0 (no feed-forward) with a mixture: give the experts' width "
                                 "(mixture expert_features) or mlp_features")
            if self.mlp_bias and (self.sparse_layers or self.mtp_depths):
                raise NotImplementedError("mlp_bias with a mixture: experts with biases are not built in Dew yet; "
                                          "set mlp_bias False")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size is {self.attention_chunk_size}; it is a number of positions >= 1")
        if self.nope is not None:
            outside = [i for i in self.nope.layers if i >= self.num_layers]
            if outside:
                raise ValueError(f"nope layers {outside} are not layers of this {self.num_layers}-layer model")
            if self.latent is not None:
                raise NotImplementedError("nope with latent attention: layers without rotary positions are built for "
                                          "grouped-query attention only; drop nope")
        if self.gemma4 is not None:
            if self.latent is not None or self.recurrent is not None:
                raise NotImplementedError("gemma4 with latent attention or recurrent mixers is not built in Dew; drop "
                                          "those or gemma4")
            self.gemma4.kv_roles(self._layer_kinds())  # refuses sharing with no layer to share from
        if self.gemma3n is not None:
            others = {name: getattr(self, name) for name in ("gemma4", "latent", "recurrent", "mixture")
                      if getattr(self, name) is not None}
            if others or self.mtp_depths:
                raise NotImplementedError(f"gemma3n with {sorted(others) or ['mtp_depths']} is not built in Dew: "
                                          "Gemma 3n's layers are dense grouped-query attention; drop those or gemma3n")
            if self.norm_placement != "sandwich" or not self.mlp_features:
                raise ValueError(f"gemma3n with norm_placement {self.norm_placement!r} and mlp_features "
                                 f"{self.mlp_features}: Gemma 3n's layers have the sandwich's norms and an MLP; use "
                                 "'sandwich' and a width above 0")
            self.gemma3n.kv_roles(self._layer_kinds())
            self.gemma3n.layer_sparsity(self.num_layers)
        if self.mtp_depths < 0:
            raise ValueError(f"mtp_depths is {self.mtp_depths}; it counts multi-token-prediction modules, 0 for none")
        if self.latent is not None:
            given = {name: getattr(self, name) for name, neutral in _NOT_LATENT.items() if getattr(self, name) != neutral}
            if given:
                raise ValueError(f"{given} shape grouped-query attention, and latent replaces it with latent "
                                 "attention, which has none of them: leave them at their defaults")

    def _layer_kinds(self) -> tuple[str, ...]:
        return tuple(FULL if self.layer_window(i) is None else SLIDING for i in range(self.num_layers))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward is the mixture of experts, in order (none without a mixture)."""
        if self.mixture is None:
            return ()
        return tuple(i for i in range(self.num_layers) if self.mixture.sparse(i))

    @functools.cached_property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Each layer's `LayerSpec`, as the flat knobs describe it."""
        dense = DenseSpec(self.mlp_features, self.activation, self.mlp_bias)
        sparse = None if self.mixture is None else SparseSpec(
            self.mixture, self.mixture.expert_features or self.mlp_features, self.activation)
        g, g3n = self.gemma4, self.gemma3n
        sharing = g or g3n
        roles = (None,) * self.num_layers if sharing is None else sharing.kv_roles(self._layer_kinds())
        specs = []
        for index in range(self.num_layers):
            theta, scaling = self.layer_rope(index)
            full = self.layer_window(index) is None
            if self.layer_types is not None and self.layer_types[index] == LINEAR:
                mixer = RecurrentSpec(self.recurrent)
            elif self.latent is not None:
                mixer = MLASpec(self.num_heads, self.latent, theta, scaling, bias=self.qkv_bias, o_bias=self.o_bias)
            else:
                nope = self.nope is not None and index in self.nope.layers
                kv_heads, head_dim = self.num_kv_heads, self.head_dim
                if g is not None and full:
                    kv_heads, head_dim = g.full_kv_heads or kv_heads, g.full_head_dim or head_dim
                mixer = AttentionSpec(
                    self.num_heads, kv_heads, head_dim, causal=self.causal,
                    window=self.layer_window(index), rope_theta=theta, rope_scaling=scaling,
                    qk_norm=self.qk_norm and not nope, qk_norm_scope=self.qk_norm_scope, qkv_bias=self.qkv_bias,
                    o_bias=self.o_bias, query_scale=self.query_scale, softcap=self.attn_softcap,
                    output_gate=self.attn_output_gate, rotary=not nope,
                    chunk=self.layer_chunk(index), temperature=self.nope.temperature() if nope else None,
                    value_norm=sharing is not None,
                    keys_as_values=g is not None and full and g.keys_as_values and roles[index] != REUSE,
                    shared_kv=roles[index],
                )
            feed_forward = sparse if index in self.sparse_layers else dense if self.mlp_features else None
            if g3n is not None:
                feed_forward = dataclasses.replace(dense, sparsity=g3n.layer_sparsity(self.num_layers)[index])
                specs.append(LayerSpec(mixer, feed_forward, self.norm_placement, self.norm_style, self.norm_eps,
                                       residual_scale=self.residual_scale, per_layer_input=g3n.per_layer_width,
                                       altup=g3n.altup, laurel_rank=g3n.laurel_rank))
                continue
            if g is None:
                specs.append(LayerSpec(mixer, feed_forward, self.norm_placement, self.norm_style, self.norm_eps,
                                       residual_scale=self.residual_scale))
                continue
            if g.double_wide_mlp and roles[index] == REUSE:
                feed_forward = dataclasses.replace(dense, features=2 * self.mlp_features)
            if index in self.sparse_layers:  # Gemma 4's experts sit beside the dense MLP
                feed_forward = DenseSparseSpec(dense if feed_forward is sparse else feed_forward, sparse)
            specs.append(LayerSpec(mixer, feed_forward, self.norm_placement, self.norm_style, self.norm_eps,
                                   output_scalar="layer_scalar", residual_scale=self.residual_scale,
                                   per_layer_input=g.per_layer_width))
        return tuple(specs)

    @property
    def three_axis_rotary(self) -> bool:
        """Whether the rotary reads three-axis positions (`rotary_positions`; Qwen 3.5's `mrope_section`)."""
        return any(spec.mixer.rope()[2].mrope_section is not None for spec in self.layer_specs)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is softmax attention (grouped-query or latent), in order: those that
        report `qk_max`; a recurrent layer has no attention logits."""
        return tuple(i for i, spec in enumerate(self.layer_specs) if isinstance(spec.mixer, (AttentionSpec, MLASpec)))

    @property
    def mtp_spec(self) -> LayerSpec:
        """The block of every multi-token-prediction depth: the last layer's, with the mixture of
        experts when the model has one (DeepSeek's depths are sparse whatever `first_k_dense_replace`)."""
        spec = self.layer_specs[-1]
        if self.mixture is None:
            return spec
        return dataclasses.replace(spec, feed_forward=SparseSpec(
            self.mixture, self.mixture.expert_features or self.mlp_features, self.activation))

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index`, None for full attention."""
        if self.layer_types is None or self.layer_types[index] == SLIDING:
            return self.sliding_window
        return None

    def layer_chunk(self, index: int) -> int | None:
        """The chunk of positions layer `index` attends within, None when it is not a chunked layer."""
        if self.layer_types is not None and self.layer_types[index] == CHUNKED:
            return self.attention_chunk_size
        return None

    def layer_rope_theta(self, index: int) -> float:
        return self.layer_rope(index)[0]

    def layer_rope(self, index: int) -> tuple[float, RopeScaling]:
        """The rotary base and scaling of layer `index`; sliding layers take the local ones where given."""
        sliding = self.layer_types is not None and self.layer_types[index] == SLIDING
        theta = self.local_rope_theta if sliding and self.local_rope_theta is not None else self.rope_theta
        scaling = self.local_rope_scaling if sliding and self.local_rope_scaling is not None else self.rope_scaling
        return theta, scaling


@struct.dataclass
class ModelOutput:
    """What the decoder returns with `head=False`: the final-norm hidden states `[B, S, E]` in the
    compute dtype, the output `head` (`Head`: capped float32 logits for any states), and `aux`, what
    layers report (`layers_N`: the output states of layer N when asked for with `layers=`, Gemma 3n's AltUp
    streams `[K, B, S, E]`;
    `routing`: with a mixture, a `dew.nn.moe.RouterRecord` whose leaves lead with the sparse
    layers, `[L, B, S, ...]`, in the order of `DecoderConfig.sparse_layers`; `qk_max`, float32
    `[L, B, H]` over `DecoderConfig.attention_layers`, when asked for with `qk_stats`)."""

    hidden: jax.Array
    head: Head
    aux: dict = struct.field(default_factory=dict)

    def logits(self) -> jax.Array:
        """float32 logits `[B, S, V]` of every position (`head.logits(hidden)`)."""
        return self.head.logits(self.hidden)


class ModelVariables:
    """What a model class adds to Flax's `init` and `apply`: variables in the model's own form, with
    logical axis names on request. The class defines `stack_variables` (any accepted form to its own)."""

    @nn.nowrap
    def init(self, rngs, *args, boxed: bool = False, **kwargs):
        """Fresh variables in the model's own form (scanned runs stacked); with `boxed`, each parameter
        wrapped in its logical axis names (`flax.linen.LogicallyPartitioned`), which `dew.sharding`
        maps onto a mesh."""
        variables = super().init(rngs, *args, **kwargs)
        return variables if boxed else nn.meta.unbox(variables)

    @nn.nowrap
    def logical_names(self):
        """The logical axis names of every parameter: a tree of `PartitionSpec`s like `init`'s."""
        return nn.get_partition_spec(boxed_shapes(self))

    @nn.nowrap
    def apply(self, variables, *args, **kwargs):
        """Apply to the model's own (stacked) variables, or to per-layer ones (stacked on the way in)."""
        return super().apply(self.stack_variables(variables), *args, **kwargs)

    @nn.nowrap
    def kept_description(self) -> str | None:
        """What a trace of this model is kept under between processes (`dew.compilation_cache.kept_trace`): a
        decoder's class and config, its one field; None for any other model, which is traced in each process."""
        if type(self) is not CausalTransformer:
            return None
        return f"{type(self).__module__}.{type(self).__qualname__} {self.config!r}"

    @nn.nowrap
    def variable_shapes(self):
        """`init`'s variables, every collection, as shapes (`jax.ShapeDtypeStruct`), without allocating them."""
        return nn.meta.unbox(boxed_shapes(self))


@kept(maxsize=8)
def boxed_shapes(model):
    """`model.init`'s variables, boxed with their logical axis names, as shapes. Tracing `init` takes a
    fraction of a second and a checkpoint's load or a fit asks several times (the shapes to read into,
    their axis names, the collections, the FLOPs), so a model (equal models are the same model: modules
    compare by their fields, a LoRA model by its decoder and adapters) is traced once; one whose config
    holds an unhashable value each time. A decoder's are also kept between processes beside JAX's cache
    (`dew.compilation_cache.kept_trace`), where one is set."""
    def trace():
        return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32), boxed=True))

    description = compilation_cache.described(model)
    if description is None:
        return trace()
    return compilation_cache.kept_trace("shapes", description, trace, _shapes_json, _shapes_from_json)


def _shapes_json(tree):
    """`boxed_shapes`' tree as JSON: each leaf its shape, dtype and logical axis names; None (not kept) for a
    tree that holds anything else."""
    if isinstance(tree, dict):
        encoded = {key: _shapes_json(value) for key, value in tree.items()}
        return None if any(not isinstance(key, str) or value is None for key, value in encoded.items()) else encoded
    if (isinstance(tree, nn.LogicallyPartitioned) and isinstance(tree.value, jax.ShapeDtypeStruct)
            and tree.mesh is None and tree.rules is None and type(tree) is nn.LogicallyPartitioned):
        leaf = tree.value
        if leaf.sharding is not None or leaf.weak_type:
            return None
        return {"shape": list(leaf.shape), "dtype": leaf.dtype.name, "names": list(tree.names)}
    return None


def _shapes_from_json(tree):
    if "dtype" in tree and isinstance(tree["dtype"], str):
        return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(tuple(tree["shape"]), jnp.dtype(tree["dtype"])),
                                       tuple(tree["names"]))
    return {key: _shapes_from_json(value) for key, value in tree.items()}


class CausalTransformer(ModelVariables, nn.Module):
    """A decoder-only transformer over int32 token ids `[B, S]` (or a `ModelInputs` holding them).

    `__call__` returns float32 logits `[B, S, vocab]`, or with `head=False` a `ModelOutput` (hidden
    states, the head, what layers report). `segment_ids` (1-based documents, 0 for padding) keep
    packed documents apart and `positions` restart the rotary angles per document;
    `attention_mask` (`[B, S]`, true for real tokens) marks padding, which reads and is read by no
    real token. `layers` lists layer numbers whose output states to keep in `aux` (`layers_N`).
    `routes` (`dew.nn.moe.Routes`, `[B, S, L, K]` over the sparse layers) replays recorded experts.
    `depths` runs the multi-token-prediction depths (`DecoderConfig.mtp_depths`) and reports their
    states in `aux["depths"]`; `indexer` reports each latent layer's lightning indexer in
    `aux["indexer"]` (`dew.nn.mla.IndexerRecord`, `[L, B, S, ...]`); `qk_stats` reports each
    attention layer's largest pre-softmax logit per row and head in `aux["qk_max"]`, float32
    `[L, B, H]` over `DecoderConfig.attention_layers` (`scale * q . k` before any softcap, over the
    real query/key pairs the mask allows; -inf for a row without a real token).

    With `cache` (from `init_cache`) each row's real tokens are written after the tokens it already
    holds (padding takes no slot) and read by every later token; the call returns `(output, cache)`.
    Positions then default to each row's filled length plus the real tokens before each slot.

    A decoder whose rotary has an `mrope_section` (Qwen 3.5) reads three-axis `rotary_positions`
    `[B, S, 3]` (time, height, width; the processor computes them around each image's grid) where given,
    and `positions` on all three axes where not. Its cache keeps each row's `rotary_delta`, so decode
    steps, given no rotary positions, continue from the last image-bearing call's.

    A multimodal model (`dew.nn.multimodal`) hands its encoded media in: `features` `[B, F, E]` in
    the compute dtype replace the embeddings (after any embedding scale) of the slots whose
    `feature_indices` `[B, S]` are at least 0 (the feature each reads; -1 for text), and
    `image_groups` `[B, S]` number the image behind each slot (-1 for text), whose tokens read each
    other in both directions (in a Gemma 4 decoder, in its sliding layers only, as transformers' Gemma 4 masks
    them); a cache with `groups` remembers them for later calls.
    """

    config: DecoderConfig

    @nn.nowrap
    def stack_variables(self, variables):
        """Per-layer variables (`layers_N`, as published checkpoints name them) in this model's own
        form, each scanned run stacked (see `dew.nn.stack`); the model's own form is returned as is."""
        c = self.config
        return stack_variables(c.layer_specs, c.scan_layers, variables)

    @nn.nowrap
    def unstack_variables(self, variables):
        """The per-layer form (`layers_N`) of this model's variables, for exports and per-layer reading."""
        return unstack_variables(variables)

    @nn.nowrap
    def init_cache(self, rows: int, capacity: int) -> Cache:
        """An empty cache of `capacity` slots per row."""
        c = self.config
        return Cache(
            runs=tuple(c.layer_specs[start].mixer.empty_cache(stop - start, rows, capacity, c.dtype)
                       for start, stop, _ in runs(c.layer_specs, c.scan_layers)),
            lengths=jnp.zeros((rows,), jnp.int32),
            rotary_delta=jnp.zeros((rows,), jnp.int32) if c.three_axis_rotary else None,
        )

    @nn.compact
    def __call__(self, tokens: jax.Array, **kwargs):
        # Every product traced inside takes the model's kernel policy (the head carries it out as well).
        with kernel_policy.using(self.config.kernels), accelerator_attention.using(self.config.attention):
            return self._forward(tokens, **kwargs)

    def _forward(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        rotary_positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: Cache | None = None,
        head: bool = True,
        layers: Sequence[int] = (),
        routes: Routes | None = None,
        depths: bool = False,
        indexer: bool = False,
        qk_stats: bool = False,
        features: jax.Array | None = None,
        feature_indices: jax.Array | None = None,
        image_groups: jax.Array | None = None,
        **media,
    ):
        if isinstance(tokens, ModelInputs):
            fields = text_fields(tokens.kwargs(), "CausalTransformer")
            return self(tokens.tokens, cache=cache, head=head, layers=layers, routes=routes, depths=depths,
                        indexer=indexer, qk_stats=qk_stats, **fields)
        if media:
            text_fields(media, "CausalTransformer")
        c = self.config
        specs = c.layer_specs
        B, S = tokens.shape
        keep = tuple(int(i) for i in layers)
        bad = [i for i in keep if not 0 <= i < c.num_layers]
        if bad:
            raise ValueError(f"layers {bad} are not layers of this {c.num_layers}-layer model")
        if depths and not c.mtp_depths:
            raise ValueError("depths=True runs the multi-token-prediction modules, and this model has none "
                             "(mtp_depths 0): build it with mtp_depths >= 1, or leave depths unset")
        if indexer and (c.latent is None or not c.latent.index_heads):
            raise ValueError("indexer=True reports the lightning indexer, and this model has none: build it with "
                             "latent=LatentAttention(index_heads=...), or leave indexer unset")
        if indexer and cache is not None:
            raise ValueError("indexer=True scores a whole sequence against its dense attention, not a cached "
                             "decode step: leave indexer unset when passing cache")
        if qk_stats and not c.attention_layers:
            raise ValueError("qk_stats=True reports the attention logits, and every layer of this model is recurrent: "
                             "leave qk_stats unset")
        if qk_stats and cache is not None:
            raise ValueError("qk_stats=True reports a whole sequence's attention logits, not a cached decode step: "
                             "leave qk_stats unset when passing cache")
        if depths and cache is not None:
            raise ValueError("depths=True scores a whole sequence; the multi-token-prediction modules do not decode "
                             "through a cache: leave depths unset when passing cache")
        if rotary_positions is not None and not c.three_axis_rotary:
            raise ValueError("rotary_positions are three-axis rotary positions, and this model's rotary has one axis "
                             "(no mrope_section): pass positions instead")
        real_BS = jnp.ones((B, S), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        segments_BS = real_BS if segment_ids is None else segment_ids.astype(jnp.int32) * real_BS
        if cache is None:
            slots_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            context_cache = {} if image_groups is None else {"groups_BS": image_groups.astype(jnp.int32)}
            if positions is None:
                positions = slots_BS if attention_mask is None else jnp.maximum(jnp.cumsum(real_BS, 1) - 1, 0)
        else:
            capacity = cache.capacity
            # Real tokens take consecutive slots after the row's filled ones; padding is sent past the end.
            before_BS = cache.lengths[:, None] + jnp.cumsum(real_BS, axis=1) - real_BS
            write_slots_BS = jnp.where(real_BS > 0, before_BS, capacity)
            lengths_B = cache.lengths + jnp.sum(real_BS, axis=1)
            slots_BS = jnp.minimum(before_BS, capacity - 1)
            filled_BT = (jnp.arange(capacity, dtype=jnp.int32)[None, :] < lengths_B[:, None]).astype(jnp.int32)
            context_cache = dict(write_slots_BS=write_slots_BS, filled_BT=filled_BT, fresh_cache=cache.fresh)
            if positions is None:
                positions = slots_BS
            if cache.groups is not None:
                cache, context_cache["groups_BS"], context_cache["key_groups_BT"] = _remember_groups(
                    cache, image_groups, write_slots_BS)
            elif image_groups is not None:
                raise ValueError("image_groups with a cache that keeps no image groups: make the cache with the "
                                 "multimodal model's init_cache")
            if cache.rotary_delta is not None:
                cache, rotary_positions = _continue_rotary(cache, rotary_positions, positions, real_BS, lengths_B)

        embed = nn.Embed(c.vocab_size, c.emb_features, dtype=c.dtype, param_dtype=c.param_dtype,
                         embedding_init=named(nn.initializers.normal(0.02), ("vocab", "embed")), name="embed_tokens")
        def embedded(ids_BS):
            if self.has_variable(QUANT_COLLECTION, EMBED_BLOCKS):  # a GGUF file's blocks: the rows asked for widen
                rows_BSXB = jnp.take(self.get_variable(QUANT_COLLECTION, EMBED_BLOCKS), ids_BS, axis=0)
                x_BSE = blocks.dequantize(rows_BSXB).astype(c.dtype)
            elif self.has_variable(QUANT_COLLECTION, EMBED_SCALE):  # int8 rows, scales per group of the width (dew.nn.quantize)
                scale_VG = self.get_variable(QUANT_COLLECTION, EMBED_SCALE)
                q_BSE = jnp.take(embed.embedding, ids_BS, axis=0)
                x_BSE = dequantize(q_BSE, scale_VG[ids_BS], axis=-1).astype(c.dtype)
            else:
                x_BSE = embed(ids_BS).astype(c.dtype)
            if c.scale_embeddings:
                x_BSE = x_BSE * jnp.asarray(c.emb_features**0.5, c.dtype)
            if c.embedding_scale != 1.0:
                x_BSE = x_BSE * jnp.asarray(c.embedding_scale, c.dtype)
            if c.gemma4 is not None or c.gemma3n is not None:  # the pad row (id 0) is frozen, as transformers'
                # padding_idx keeps it
                x_BSE = jnp.where((ids_BS == 0)[:, :, None], jax.lax.stop_gradient(x_BSE), x_BSE)
            return x_BSE

        if feature_indices is None:
            x_BSE = embedded(tokens)
        else:
            # a placeholder id may lie outside the vocabulary; its embedding is replaced anyway
            media_BS = feature_indices >= 0
            x_BSE = embedded(jnp.where(media_BS, 0, tokens))
            picked_BSE = jnp.take_along_axis(features, jnp.maximum(feature_indices, 0)[:, :, None], axis=1)
            x_BSE = jnp.where(media_BS[:, :, None], picked_BSE.astype(c.dtype), x_BSE)
        x_BSE = rows_split(x_BSE)  # under a trainer's mesh, each device's layers read its own rows

        per_layer = c.gemma4 or c.gemma3n
        if per_layer is not None and per_layer.per_layer_width:
            # Gemma 3n's per-layer inputs read the ids themselves, media slots too (ids past the table read
            # its row 0); Gemma 4's read id 0 at media slots
            keep_ids = feature_indices is None or c.gemma3n is not None
            ids_BS = tokens if keep_ids else jnp.where(feature_indices >= 0, 0, tokens)
            g = per_layer
            context_cache["per_layer_BSLP"] = PerLayerInputs(
                c.num_layers, g.per_layer_width, g.per_layer_vocab or c.vocab_size, c.norm_eps, c.dtype,
                c.param_dtype, name="per_layer_inputs")(ids_BS, x_BSE)
        tables, rotary = rotary_tables(specs, positions, rotary_positions)
        replay_LBSK = None
        if routes is not None:
            replay_LBSK, context_cache["covered_BS"] = self._replay(routes, B, S)
        context = LayerContext(rotary=rotary, slots_BS=slots_BS, segments_BS=segments_BS, report_indexer=indexer,
                               report_qk=qk_stats, positions_BS=jnp.asarray(positions, jnp.int32),
                               segmented=segment_ids is not None or attention_mask is not None,
                               sliding_groups=c.gemma4 is not None, **context_cache)

        altup = None if c.gemma3n is None else c.gemma3n.altup_inputs
        if altup is not None:  # Gemma 3n's residual: AltUp's streams [K, B, S, E]
            x_BSE = split_streams(x_BSE, self._altup_projections("altup_projections", altup))
        x_BSE, cache_runs, kept, routing, mixed = apply_layers(
            self, specs, x_BSE, context, None if cache is None else cache.runs, scan_from=c.scan_layers, remat=c.remat,
            keep=keep, tables=tables, dtype=c.dtype, param_dtype=c.param_dtype, replay_LBSK=replay_LBSK,
        )
        if altup is not None:
            x_BSE = merge_streams(x_BSE, self._altup_projections("altup_unembed_projections", altup))
        hidden_BSE = RMSNorm(c.norm_eps, c.norm_style, dtype=c.dtype, param_dtype=c.param_dtype, name="norm")(x_BSE)
        if c.tie_embeddings and self.has_variable(QUANT_COLLECTION, EMBED_BLOCKS):
            output_head = Head(self.get_variable(QUANT_COLLECTION, EMBED_BLOCKS), transposed=True,
                               softcap=c.logit_softcap, kernels=c.kernels, logit_divisor=c.logit_divisor)
        elif c.tie_embeddings:
            scale_V = self.get_variable(QUANT_COLLECTION, EMBED_SCALE)  # None unless the weights are int8
            output_head = Head(_compute(embed.embedding, c.dtype), transposed=True, softcap=c.logit_softcap,
                               scale=scale_V, kernels=c.kernels, logit_divisor=c.logit_divisor)
        else:
            kernel, scale_V = _Kernel(c.vocab_size, c.param_dtype, name="lm_head")(c.emb_features)
            # A GGUF file's blocks hold the head as [vocab, emb] rows, the transposed form.
            output_head = Head(_compute(kernel, c.dtype), transposed=kernel.dtype == jnp.uint8,
                               softcap=c.logit_softcap, scale=scale_V, kernels=c.kernels,
                               logit_divisor=c.logit_divisor)
        aux = {f"layers_{i}": states for i, states in zip(keep, kept)}
        if routing is not None:
            aux["routing"] = routing
        if indexer:
            aux["indexer"] = mixed["indexer"]
        if qk_stats:
            aux["qk_max"] = mixed["qk_max"]
        if c.mtp_depths and (depths or self.is_initializing()):
            bare = LayerContext(rotary={}, slots_BS=slots_BS, segments_BS=segments_BS)
            aux["depths"] = mtp_states(self, c.mtp_spec, c.mtp_depths, c.num_layers, hidden_BSE, tokens, positions,
                                       bare, embedded, c.dtype, c.param_dtype)
        output = output_head.logits(hidden_BSE) if head else ModelOutput(hidden_BSE, output_head, aux)
        if cache is None:
            return output
        return output, Cache(runs=cache_runs, lengths=lengths_B, groups=cache.groups, rotary_delta=cache.rotary_delta)


    @nn.nowrap
    def _altup_projections(self, name: str, streams: int) -> list[Linear]:
        """Gemma 3n's `name_0` ... maps `[E, E]`, one per AltUp stream after the first."""
        c = self.config
        return [Linear(c.emb_features, dtype=c.dtype, param_dtype=c.param_dtype, names=(None, "embed"),
                       name=f"{name}_{i}") for i in range(streams - 1)]

    @nn.nowrap
    def _replay(self, routes: Routes, rows: int, seq_len: int):
        """(the replayed experts as one `[layers, B, S, K]` entry per layer, a dense layer's unread,
        the covered tokens `[B, S]` or None)."""
        c = self.config
        sparse = c.sparse_layers
        if not sparse:
            raise ValueError("routes replay experts, and this model has no mixture of experts: leave routes unset")
        routes.check(rows, seq_len, len(sparse), c.mixture.top_k)
        position = [sparse.index(i) if i in sparse else 0 for i in range(c.num_layers)]
        replay_LBSK = jnp.moveaxis(routes.experts.astype(jnp.int32), 2, 0)[jnp.asarray(position)]
        covered = None if routes.covered is None else routes.covered.astype(bool)
        return replay_LBSK, covered


def _continue_rotary(cache: Cache, rotary_positions, positions_BS, real_BS, lengths_B):
    """(the cache with each row's rotary delta, this call's three-axis positions `[B, S, 3]`). Given
    positions set the delta of each row with a real token (one past its largest, less its filled
    length); without, the positions continue from the delta (equal on the three axes, as text's are)."""
    if rotary_positions is None:
        shifted_BS = jnp.asarray(positions_BS, jnp.int32) + cache.rotary_delta[:, None]
        return cache, jnp.broadcast_to(shifted_BS[:, :, None], (*shifted_BS.shape, 3))
    largest_B = jnp.max(jnp.where(real_BS[:, :, None] > 0, rotary_positions, -1), axis=(1, 2))
    delta_B = jnp.where(jnp.any(real_BS > 0, axis=1), largest_B + 1 - lengths_B, cache.rotary_delta)
    return cache.replace(rotary_delta=delta_B.astype(jnp.int32)), rotary_positions


def _remember_groups(cache: Cache, image_groups, write_slots_BS):
    """(the cache with this call's image groups written at its slots, the call's groups `[B, S]`, every
    cached slot's `[B, T]`). A row's groups are offset by its filled length, so they never meet the
    ids of an image an earlier call wrote (each image takes at least one slot)."""
    B, S = write_slots_BS.shape
    if image_groups is None:
        groups_BS = jnp.full((B, S), -1, jnp.int32)
    else:
        groups_BS = jnp.where(image_groups >= 0, image_groups.astype(jnp.int32) + cache.lengths[:, None], -1)
    rows_B1 = jnp.arange(B)[:, None]
    written_BT = cache.groups.at[rows_B1, write_slots_BS].set(groups_BS, mode="drop")
    return cache.replace(groups=written_BT), groups_BS, written_BT


class _Kernel(nn.Module):
    """Holds the untied output projection `kernel` `[emb, vocab]` under the name `lm_head`."""

    features: int
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array | None]:
        """(the kernel, its int8 scales per vocabulary column or None for float weights); a GGUF file's
        blocks `[vocab, emb / E, B]` and None where they are held instead."""
        if self.has_variable(QUANT_COLLECTION, KERNEL_BLOCKS):
            return self.get_variable(QUANT_COLLECTION, KERNEL_BLOCKS), None
        kernel = self.param("kernel", named(nn.initializers.normal(0.02), ("embed", "vocab")),
                            (in_features, self.features), self.param_dtype)
        return kernel, self.get_variable(QUANT_COLLECTION, KERNEL_SCALE)


def _compute(weight: jax.Array, dtype) -> jax.Array:
    """A head weight in the compute dtype, or left int8 or in blocks (the head converts it inside its product)."""
    return weight if weight.dtype in (jnp.int8, jnp.uint8) else weight.astype(dtype)
