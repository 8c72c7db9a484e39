"""DiffusionGemma's text model: a causal encoder over the prompt and a bidirectional denoiser over canvases,
one stack of Gemma-4 layers serving both.

The encoder reads clean tokens (the prompt, then each committed canvas) and writes their keys and values
into a `PrefixCache`; the denoiser refines a canvas of `canvas_length` tokens attending to that cache and
to the whole canvas, its input embeddings mixed with a self-conditioning signal made from the previous
refinement's logits. Both share every parameter (transformers ties the encoder's to the decoder's), except
the per-layer output scalars, which the checkpoint stores once per side and Dew keeps in the `constants`
collection (frozen, as transformers keeps its buffers).

The layers are the shared decoder's (`dew.nn.layer.LayerSpec`, run by `dew.nn.stack.apply_layers`), each
as transformers' `DiffusionGemmaDecoderTextLayer` computes it: attention with RMS-normed queries and keys
(scores scaled by 1) and scale-free normed values, full layers with their own head width and key/value
heads reading the key projection as values, sliding layers windowing the prompt; Gemma 4's feed-forward,
a dense MLP beside a mixture of experts (`dew.nn.moe.DenseSparseSpec`, its router on the un-normed
residual with `per_expert_scale`); sandwich norms that multiply by `scale`; partial ("proportional")
rotary on full layers. The encoder's layers are causal and the denoiser's bidirectional, each multiplying
its output by its side's scalar. What is DiffusionGemma's own is here: the config, the cache of clean
tokens, the self-conditioning mix and the wiring of encoder and denoiser over the shared layers.

Images (`DiffusionGemmaConfig.vision`, a `DiffusionGemmaVision`) run at the prompt's prefill only: the encoder
call that writes the prompt also takes `pixel_values` with the tower's other inputs, encodes each image with the
registered tower and projector (`dew.nn.vision`: Gemma 4's), and reads each soft token in place of the
placeholder embedding `image_indices` points at, unscaled; with `bidirectional_images` an image's tokens read
each other in both directions there, in every layer (transformers' `use_bidirectional_attention` "vision").
The cache then holds the image's keys and values like any clean token's, so committed canvases and every
refinement read them without running the tower again. An image whose tokens outnumber the sliding window
reads, in sliding layers, its own tokens within the window behind each and all those ahead; transformers'
mask lets it read every token of its image (released images fill 280 tokens, windows 1024).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from dew.kernels import accelerator_attention
from dew.kernels import policy as kernel_policy
from dew.nn.attention import AttentionSpec
from dew.nn.head import cap_logits, vocab_logits
from dew.nn.layer import CONSTANTS, LayerContext, LayerSpec
from dew.nn.mlp import DenseSpec, GatedMLP
from dew.nn.moe import DenseSparseSpec, Mixture, SparseSpec
from dew.nn.norms import RMSNorm, normalize
from dew.nn.rotary import RopeScaling
from dew.nn.stack import apply_layers, rotary_tables, runs
from dew.nn.transformer import FULL, SLIDING, as_dtype

F32 = jnp.float32
ENCODER_SCALAR, DECODER_SCALAR = "encoder_layer_scalar", "decoder_layer_scalar"
# Every layer runs on its own (`layers_N`), under the checkpoint's per-layer names.
UNROLLED = 0


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaVision:
    """The image side of a DiffusionGemma: a vision `tower` and `projector` (configs of `dew.nn.vision`,
    registered as `tower_kind` and `projector_kind`), the id of an image's soft-token placeholders, and whether an
    image's tokens read each other in both directions at the prefill (`bidirectional_images`)."""

    tower_kind: str
    tower: Any
    projector_kind: str
    projector: Any
    image_token_id: int
    bidirectional_images: bool = False

    def __post_init__(self):
        if not getattr(self.tower, "reads_positions", False):
            raise ValueError(f"the {self.tower_kind} tower reads whole images; DiffusionGemma's prefill takes padded "
                             "patch streams with patch positions (Gemma 4's tower, 'gemma4')")

    @classmethod
    def from_json(cls, fields) -> "DiffusionGemmaVision":
        """The vision side from its fields as a run's record holds them (the tower's and projector's as objects)."""
        from dew.nn.vision import projector_class, tower_class  # the towers load only for a model with images

        values = dict(fields)
        values["tower"] = tower_class(values["tower_kind"])(**values["tower"])
        values["projector"] = projector_class(values["projector_kind"])(**values["projector"])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text model's shape (see the module). `layer_types` holds FULL or SLIDING per layer;
    `head_dims` and `kv_heads` each layer's head width and key/value heads; `rotary` gives each layer
    type its base and `RopeScaling`, as `(layer_type, theta, scaling)` (a tuple, so the config hashes).
    `canvas_length` is the denoiser's block; `max_seq_len` bounds prompt plus canvases. `kernels` is the
    kernel policy of its products (`dew.kernels.policy`, as `DecoderConfig.kernels`), `attention` the kernel
    of its attention (`dew.kernels.accelerator_attention`, as `DecoderConfig.attention`); `vision` the image side
    (None: text only)."""

    vocab_size: int
    emb_features: int
    mlp_features: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    sliding_window: int
    rotary: tuple[tuple[str, float, RopeScaling], ...]
    experts: int
    top_k: int
    expert_features: int
    canvas_length: int
    max_seq_len: int
    norm_eps: float = 1e-6
    logit_softcap: float | None = 30.0
    activation: str = "gelu_tanh"
    trainable_scalars: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    kernels: str = "auto"
    vision: DiffusionGemmaVision | None = None
    attention: str = "auto"

    def __post_init__(self):
        kernel_policy.check(self.kernels)
        accelerator_attention.check(self.attention)
        layers = len(self.layer_types)
        for name in ("head_dims", "kv_heads"):
            if len(getattr(self, name)) != layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {layers} layers: give one per layer")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not built; layers are {FULL!r} or {SLIDING!r}")
        for kv in self.kv_heads:
            if self.num_heads % kv:
                raise ValueError(f"{kv} key/value heads do not divide the {self.num_heads} query heads")
        missing = sorted(set(self.layer_types) - {layer_type for layer_type, _, _ in self.rotary})
        if missing:
            raise ValueError(f"rotary gives no setting for the {missing} layers: give one per layer type")
        self.layer_specs(encoder=True)  # the shared specs check the rest (activation, top_k)

    @classmethod
    def from_json(cls, fields) -> "DiffusionGemmaConfig":
        """The config from its fields as JSON holds them (a run's record): lists as tuples, each rotary
        scaling's dict as a `RopeScaling`, dtype names as dtypes; an unknown field is refused by name."""
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise TypeError(f"DiffusionGemmaConfig has no fields {unknown}; its fields are {known}")
        required = [field.name for field in dataclasses.fields(cls) if field.default is dataclasses.MISSING]
        missing = [name for name in required if name not in fields]
        if missing:
            raise TypeError(f"DiffusionGemmaConfig needs the fields {missing}: a DiffusionGemma comes from its checkpoint "
                            "(load_pretrained, the recipe's --pretrained) or a block-diffusion run's record, which "
                            "name them all")
        values = dict(fields)
        for name in ("layer_types", "head_dims", "kv_heads"):
            values[name] = tuple(values[name])
        values["rotary"] = tuple((layer_type, float(theta), RopeScaling(**scaling) if isinstance(scaling, dict)
                                  else scaling) for layer_type, theta, scaling in values["rotary"])
        for name in ("dtype", "param_dtype"):
            if name in values:
                values[name] = as_dtype(values[name])
        if isinstance(values.get("vision"), dict):
            values["vision"] = DiffusionGemmaVision.from_json(values["vision"])
        return cls(**values)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layer_specs(self, encoder: bool) -> tuple[LayerSpec, ...]:
        """Each layer as the encoder (causal, `encoder_layer_scalar`) or the denoiser (bidirectional,
        `decoder_layer_scalar`) runs it; both sides' specs describe the same parameters."""
        rotary = {layer_type: (theta, scaling) for layer_type, theta, scaling in self.rotary}
        mixture = Mixture(self.experts, self.top_k, self.expert_features, router_norm=True, expert_scale=True)
        feed_forward = DenseSparseSpec(DenseSpec(self.mlp_features, self.activation),
                                       SparseSpec(mixture, self.expert_features, self.activation))
        specs = []
        for layer_type, head_dim, kv_heads in zip(self.layer_types, self.head_dims, self.kv_heads):
            theta, scaling = rotary[layer_type]
            mixer = AttentionSpec(self.num_heads, kv_heads, head_dim, causal=encoder,
                                  window=self.sliding_window if layer_type == SLIDING else None, rope_theta=theta,
                                  rope_scaling=scaling, qk_norm=True, query_scale=1.0, value_norm=True,
                                  keys_as_values=layer_type == FULL)
            specs.append(LayerSpec(mixer, feed_forward, "sandwich", "olmo", self.norm_eps,
                                   output_scalar=ENCODER_SCALAR if encoder else DECODER_SCALAR,
                                   trainable_scalar=self.trainable_scalars))
        return tuple(specs)


@struct.dataclass
class PrefixCache:
    """The clean tokens' keys and values, one `dew.nn.kv_cache.AttentionCache` per layer (`[1, B, kv_heads,
    T, head_dim]`; widths differ by layer type), with `valid_BT` marking filled slots, `positions_BT` their
    positions and `length_B` each row's count of cached tokens (the next position). Slots fill left to
    right; a row's padding sits before its first token and is never valid."""

    runs: tuple
    valid_BT: jax.Array
    positions_BT: jax.Array
    length_B: jax.Array

    @classmethod
    def empty(cls, config: DiffusionGemmaConfig, rows: int, capacity: int) -> "PrefixCache":
        specs = config.layer_specs(encoder=True)
        caches = tuple(specs[start].mixer.empty_cache(stop - start, rows, capacity, config.dtype)
                       for start, stop, _ in runs(specs, UNROLLED))
        return cls(runs=caches, valid_BT=jnp.zeros((rows, capacity), bool),
                   positions_BT=jnp.zeros((rows, capacity), jnp.int32), length_B=jnp.zeros((rows,), jnp.int32))


class _SelfConditioning(nn.Module):
    config: DiffusionGemmaConfig

    @nn.compact
    def __call__(self, embedded_BCE, soft_BCE):
        c = self.config
        normed = RMSNorm(c.norm_eps, "olmo", dtype=c.dtype, param_dtype=c.param_dtype, name="pre_norm")(soft_BCE)
        signal = GatedMLP(c.mlp_features, c.activation, dtype=c.dtype, param_dtype=c.param_dtype,
                          name="mlp")(normed)
        return normalize(embedded_BCE + signal, c.norm_eps)


class DiffusionGemma(nn.Module):
    """The model (see the module): `encode` writes clean tokens (at the prefill, with their images) into a
    `PrefixCache`, `denoise` returns a canvas's float32 logits, `logits` caps the head's output. With
    `config.vision` its variables hold the `tower` and `projector` beside the text model's."""

    config: DiffusionGemmaConfig

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(c.vocab_size, c.emb_features, param_dtype=c.param_dtype,
                                     embedding_init=nn.initializers.normal(1.0))
        self.norm = RMSNorm(c.norm_eps, "olmo", dtype=c.dtype, param_dtype=c.param_dtype)
        self.self_conditioning = _SelfConditioning(c)
        if c.vision is not None:
            self.tower = c.vision.tower.build(c.dtype, c.param_dtype)
            self.projector = c.vision.projector.build(c.dtype, c.param_dtype)

    @nn.compact
    def _layers(self, x_BSE, specs, tables, context, cache_runs):
        """The shared layers (`layers_N`) over `x_BSE`: the output states and the cache runs."""
        c = self.config
        with kernel_policy.using(c.kernels), accelerator_attention.using(c.attention):
            x_BSE, cache_runs, _, _, _ = apply_layers(self, specs, x_BSE, context, cache_runs, scan_from=UNROLLED,
                                                      remat="none", keep=(), tables=tables, dtype=c.dtype,
                                                      param_dtype=c.param_dtype)
        return x_BSE, cache_runs

    def _embed(self, tokens):
        c = self.config
        table = self.embed_tokens.embedding
        return (jnp.take(table, tokens, axis=0) * jnp.asarray(c.emb_features ** 0.5, table.dtype)).astype(c.dtype)

    def encode_images(self, pixel_values, image_position_ids):
        """Each row's images, padded patch streams `[B, images, X, P]` with each patch's (column, row) `[B, images,
        X, 2]`, as soft tokens `[B, images * T, E]` in the compute dtype (the tower's `T` an image, its real ones
        first)."""
        c = self.config
        B, images = pixel_values.shape[:2]
        flat = pixel_values.reshape(B * images, *pixel_values.shape[2:]).astype(c.dtype)
        tokens_NTC = self.tower(flat, image_position_ids.reshape(B * images, -1, 2))
        soft_NTE = self.projector(tokens_NTC)
        return soft_NTE.reshape(B, images * soft_NTE.shape[1], soft_NTE.shape[2]).astype(c.dtype)

    def encode(self, tokens_BS, valid_BS, cache: PrefixCache, start, *, pixel_values=None, image_position_ids=None,
               image_indices=None, image_groups=None) -> tuple[jax.Array, PrefixCache]:
        """Encode clean tokens `[B, S]` (`valid_BS` False for padding) written at cache slots `start ..
        start + S`; their positions continue each row's count. Returns the final-normed hidden states
        `[B, S, E]` and the cache holding them.

        With images (the prefill's): `pixel_values` and `image_position_ids` as `encode_images` takes them,
        `image_indices [B, S]` the soft token each placeholder slot reads (-1 for text) and `image_groups [B, S]`
        the image behind each slot (-1 for text), as `dew.interop.processors.Processor` writes them."""
        c = self.config
        B, S = tokens_BS.shape
        x_BSE = self._embed(tokens_BS)
        groups = {}
        if pixel_values is not None:
            if c.vision is None:
                raise ValueError("pixel_values were given, and this DiffusionGemma has no vision tower: leave them out")
            if image_position_ids is None or image_indices is None or image_groups is None:
                raise ValueError("pixel_values need image_position_ids, image_indices and image_groups beside them "
                                 "(the checkpoint's processor writes all four)")
            features_BFE = self.encode_images(pixel_values, image_position_ids)
            picked_BSE = jnp.take_along_axis(features_BFE, jnp.maximum(image_indices, 0)[:, :, None], axis=1)
            x_BSE = jnp.where((image_indices >= 0)[:, :, None], picked_BSE, x_BSE)
            if c.vision.bidirectional_images:  # the groups of this call's slots; cached slots hold text
                groups_BS = image_groups.astype(jnp.int32)
                key_groups_BT = jax.lax.dynamic_update_slice_in_dim(
                    jnp.full(cache.valid_BT.shape, -1, jnp.int32), groups_BS, start, axis=1)
                groups = dict(groups_BS=groups_BS, key_groups_BT=key_groups_BT)
        positions_BS = cache.length_B[:, None] + jnp.cumsum(valid_BS, axis=1, dtype=jnp.int32) - 1
        positions_BS = jnp.maximum(positions_BS, 0)
        update = lambda buffer, chunk: jax.lax.dynamic_update_slice_in_dim(buffer, chunk.astype(buffer.dtype),
                                                                            start, axis=1)
        valid_BT = update(cache.valid_BT, valid_BS)
        positions_BT = update(cache.positions_BT, positions_BS)
        specs = c.layer_specs(encoder=True)
        tables, rotary = rotary_tables(specs, positions_BS)
        # The mask rule reads positions: a token reads the valid cached tokens at or before its position
        # (sliding layers, fewer than `sliding_window` back).
        context = LayerContext(rotary=rotary, slots_BS=positions_BS, segments_BS=valid_BS.astype(jnp.int32),
                               write_slots_BS=jnp.broadcast_to(start + jnp.arange(S, dtype=jnp.int32), (B, S)),
                               filled_BT=valid_BT.astype(jnp.int32), key_slots_BT=positions_BT, **groups)
        x_BSE, cache_runs = self._layers(x_BSE, specs, tables, context, cache.runs)
        cache = PrefixCache(cache_runs, valid_BT, positions_BT,
                            cache.length_B + jnp.sum(valid_BS, axis=1, dtype=jnp.int32))
        return self.norm(x_BSE), cache

    def denoise(self, canvas_BC, cache: PrefixCache, self_conditioning_BCV=None, conditioned_B=None) -> jax.Array:
        """float32 logits `[B, C, V]` for a canvas after the cached tokens: every canvas position sees the
        whole canvas and the cache (sliding layers its last `sliding_window - 1` tokens). The logits of the
        previous refinement (`self_conditioning_BCV`; None at the first) condition the input, rows where
        `conditioned_B` is False getting none."""
        c = self.config
        B, C = canvas_BC.shape
        embedded = self._embed(canvas_BC)
        table = self.embed_tokens.embedding
        if self_conditioning_BCV is None:
            soft = jnp.zeros_like(embedded)
        else:
            probs = jax.nn.softmax(self_conditioning_BCV.astype(F32), axis=-1).astype(table.dtype)
            soft = jnp.einsum("bcv,ve->bce", probs, table, preferred_element_type=F32)
            soft = (soft.astype(table.dtype) * jnp.asarray(c.emb_features ** 0.5, table.dtype)).astype(c.dtype)
            if conditioned_B is not None:
                soft = soft * conditioned_B.astype(soft.dtype)[:, None, None]
        x_BCE = self.self_conditioning(embedded, soft)
        positions_BC = cache.length_B[:, None] + jnp.arange(C, dtype=jnp.int32)
        specs = c.layer_specs(encoder=False)
        tables, rotary = rotary_tables(specs, positions_BC)
        # For the mask every canvas token sits at the position after the cache, so the window counts back
        # from the canvas: sliding layers read the cache's last `sliding_window - 1` tokens, which is what
        # transformers' sliding cache keeps.
        context = LayerContext(rotary=rotary, slots_BS=jnp.broadcast_to(cache.length_B[:, None], (B, C)),
                               segments_BS=jnp.ones((B, C), jnp.int32), filled_BT=cache.valid_BT.astype(jnp.int32),
                               key_slots_BT=cache.positions_BT, read_only_cache=True)
        x_BCE, _ = self._layers(x_BCE, specs, tables, context, cache.runs)
        return self.logits(self.norm(x_BCE))

    def logits(self, hidden_BSE) -> jax.Array:
        """Capped float32 logits of final-normed hidden states (the head is the tied embedding)."""
        c = self.config
        lead = hidden_BSE.shape[:-1]
        table = self.embed_tokens.embedding.astype(c.dtype)
        logits_NV = vocab_logits(hidden_BSE.reshape(-1, c.emb_features), table, transposed=True)
        return cap_logits(logits_NV, c.logit_softcap).reshape(*lead, c.vocab_size)

    def __call__(self, tokens_BS, canvas_BC):
        """Initialise every parameter: encode `tokens_BS` into a fresh cache, denoise `canvas_BC` after it (and
        encode the tower's smallest image, whose soft tokens nothing reads)."""
        B, S = tokens_BS.shape
        if self.config.vision is not None and self.is_initializing():
            self.encode_images(**self.config.vision.tower.example(self.config.dtype))
        cache = PrefixCache.empty(self.config, B, S)
        hidden, cache = self.encode(tokens_BS, jnp.ones((B, S), bool), cache, 0)
        return self.logits(hidden), self.denoise(canvas_BC, cache, jnp.zeros(canvas_BC.shape + (self.config.vocab_size,)))


def scalars_as(variables, trainable: bool) -> dict:
    """`variables` with the per-layer scalars moved into `params` (`trainable`) or into `constants`; any other
    collection is kept as it is."""
    variables = {name: dict(tree) for name, tree in variables.items()}
    source, target = (CONSTANTS, "params") if trainable else ("params", CONSTANTS)
    moved = variables.setdefault(target, {})
    for scope, leaves in list(variables.get(source, {}).items()):
        scalars = {name: leaves[name] for name in (ENCODER_SCALAR, DECODER_SCALAR) if name in leaves}
        if not scalars:
            continue
        rest = {name: leaf for name, leaf in leaves.items() if name not in scalars}
        if rest:
            variables[source][scope] = rest
        else:
            del variables[source][scope]
        moved[scope] = {**moved.get(scope, {}), **scalars}
    if not variables.get(CONSTANTS):
        variables.pop(CONSTANTS, None)
    return variables


__all__ = ["CONSTANTS", "FULL", "SLIDING", "DiffusionGemma", "DiffusionGemmaConfig", "DiffusionGemmaVision", "PrefixCache",
           "scalars_as"]
