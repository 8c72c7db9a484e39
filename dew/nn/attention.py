"""Grouped-query self-attention with causal, segment and sliding-window masks, and a KV cache.

One mask rule serves training and decoding: a query may read a key when the key's slot is not after
the query's (causal models) or both belong to the same image (an image's soft tokens see each other in
both directions, Gemma 3), both carry the same segment id (documents in a packed row never see each
other; padding, segment 0, reads only padding so no row is empty), and, with a sliding window, the
key lies fewer than `window` slots behind the query, and, with chunks (Llama 4's local layers), both
positions fall in the same chunk of `chunk` positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dew.kernels import accelerator_attention as accelerator
from dew.kernels import decode_attention as decode_kernel
from dew.kernels import prefill_attention as prefill_kernel
from dew.kernels import softmax as fast_softmax
from dew.kernels.matmul import dot
from dew.kernels.softmax import MASKED
from dew.nn.kv_cache import AttentionCache, loaded
from dew.nn.linear import Linear
from dew.nn.norms import RMSNorm, normalize
from dew.nn.rotary import RopeScaling, apply_partial_rotary, rotated_width



def attention_mask(
    q_slots_BS: jax.Array,
    k_slots_BT: jax.Array,
    q_segments_BS: jax.Array,
    k_segments_BT: jax.Array,
    *,
    causal: bool,
    window: jax.Array | int | None,
    q_groups_BS: jax.Array | None = None,
    k_groups_BT: jax.Array | None = None,
    chunk: int | None = None,
    q_positions_BS: jax.Array | None = None,
    k_positions_BT: jax.Array | None = None,
) -> jax.Array:
    """Boolean `[B, S, T]`: which key slot each query slot may read (`window` may be traced).

    `q_groups_BS` and `k_groups_BT` (both or neither) number the image each slot belongs to, -1 for
    text: a query reads every key of its own image, later ones included. With `chunk`, a query reads
    only keys whose position (`q_positions_BS`, `k_positions_BT`) lies in its own chunk,
    `position // chunk`."""
    q, k = q_slots_BS[:, :, None], k_slots_BT[:, None, :]
    allowed = q_segments_BS[:, :, None] == k_segments_BT[:, None, :]
    if causal:
        ordered = k <= q
        if q_groups_BS is not None:
            q_group = q_groups_BS[:, :, None]
            ordered |= (q_group >= 0) & (q_group == k_groups_BT[:, None, :])
        allowed &= ordered
    if window is not None:
        allowed &= q - k < window
    if chunk is not None:
        allowed &= (q_positions_BS[:, :, None] // chunk) == (k_positions_BT[:, None, :] // chunk)
    return allowed


# The window of a layer that does not slide: wider than any sequence.
NO_WINDOW = np.iinfo(np.int32).max
BLOCK = 128  # query rows a block of a causal pass (`attend`'s `block`)
# The fused kernel's blocks: smaller blocks compute fewer masked scores, and inside one call smaller
# products cost no extra thunks (docs/performance.md). For every real token the same result as `attend`'s
# 128 but for the order of sums: it reads only keys at or before itself, and without a cache it may always
# read its own slot, so its row is never all masked and a masked score's exp(MASKED - max) is exactly 0
# however many of them a block computes. (A padding query may score other keys with 64 than with 128;
# nothing reads it.)
FUSED_BLOCK = 64


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _prefill_attention(q_BHSD, keys, values, layer, mask_BST, scale: float) -> jax.Array:
    """`prefill_kernel.prefill_attention`, differentiated as `attend` over layer `layer` of the cache (the
    kernel has no backward; a cached pass may be trained through, as block diffusion's encoder is)."""
    return prefill_kernel.prefill_attention(q_BHSD, keys, values, layer, mask_BST, scale)


def _prefill_attention_forward(q_BHSD, keys, values, layer, mask_BST, scale):
    return _prefill_attention(q_BHSD, keys, values, layer, mask_BST, scale), (q_BHSD, keys, values, layer, mask_BST)


def _prefill_attention_backward(scale, saved, out_BSHD):
    q_BHSD, keys, values, layer, mask_BST = saved
    B = q_BHSD.shape[0]
    reference = lambda q, k, v: attend(q, loaded(k[layer, :B]), loaded(v[layer, :B]), mask_BST, scale=scale,  # noqa: E731
                                       heads_major=True)
    _, pull = jax.vjp(reference, q_BHSD, keys, values)
    return (*pull(out_BSHD), None, None)


_prefill_attention.defvjp(_prefill_attention_forward, _prefill_attention_backward)


def attend(q_BSHD, k_BKTD, v_BKTD, mask_BST, *, causal_blocks: bool = False, scale: float | None = None,
           softcap: float | None = None, block: int = BLOCK, heads_major: bool = False) -> jax.Array:
    """Softmax attention in float32 for `H` query heads over `K` shared key/value heads.

    Queries are `[B, S, H, D]` (with `heads_major`, `[B, H, S, D]`), keys heads-major `[B, K, T, D]` (the
    KV cache's layout) and values `[B, K, T, Dv]` (latent attention's values are narrower than its keys);
    the result is `[B, S, H, Dv]`.

    Scores are `q . k` times `scale` (default `head_dim ** -0.5`), then, with `softcap`, squashed
    to `softcap * tanh(scores / softcap)` (Gemma 2).

    With `causal_blocks` (a causal pass whose query slot `i` is key slot `i`) the queries go in
    blocks of `block`, each scoring only the keys up to its end: the masked upper triangle is mostly
    never computed, and each block's scores stay in cache.
    """
    K = k_BKTD.shape[1]
    if heads_major:
        B, H, S, D = q_BSHD.shape
        q_BKGSD = q_BSHD.reshape(B, K, H // K, S, D)
    else:
        B, S, H, D = q_BSHD.shape
        q_BKGSD = q_BSHD.reshape(B, S, K, H // K, D).transpose(0, 2, 3, 1, 4)
    scale = D**-0.5 if scale is None else scale
    starts = range(0, S, block) if causal_blocks else (0,)
    outputs = []
    for start in starts:
        stop = min(start + block, S) if causal_blocks else S
        end = stop if causal_blocks else k_BKTD.shape[2]
        rows = H // K * (stop - start)  # a group's queries of the block, one matrix per (row, kv head)
        q_BKRD = q_BKGSD[:, :, :, start:stop].reshape(B, K, rows, D)
        scores_BKGST = dot(q_BKRD, k_BKTD[:, :, :end], transpose_b=True).reshape(B, K, H // K, stop - start, end)
        if softcap is None and fast_softmax.usable(v_BKTD.dtype):
            probs_BHRT = fast_softmax.masked_softmax(scores_BKGST.reshape(B, H, stop - start, end),
                                                     mask_BST[:, start:stop, :end], scale, v_BKTD.dtype)
            probs_BKGST = probs_BHRT.reshape(scores_BKGST.shape)
        else:
            scores_BKGST = scores_BKGST * scale
            if softcap is not None:
                scores_BKGST = softcap * jnp.tanh(scores_BKGST / softcap)
            scores_BKGST = jnp.where(mask_BST[:, None, None, start:stop, :end], scores_BKGST, MASKED)
            probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BKTD.dtype)
        out_BKRD = dot(probs_BKGST.reshape(B, K, rows, end), v_BKTD[:, :, :end], out_dtype=q_BSHD.dtype)
        outputs.append(out_BKRD.reshape(B, K, H // K, stop - start, v_BKTD.shape[-1]))
    out_BKGSD = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=3)
    return out_BKGSD.transpose(0, 3, 1, 2, 4).reshape(B, S, H, v_BKTD.shape[-1]).astype(q_BSHD.dtype)


def score_max(q_BSHD, k_BKTD, allowed_BST, scale: float, block: int = BLOCK) -> jax.Array:
    """float32 `[B, H]`: each row's and head's largest attention logit, `scale * q . k` before any
    softcap, over the query/key pairs `allowed_BST` marks (-inf for a row with none). Queries and keys
    are detached (a statistic to watch, not a loss), and scored `block` queries at a time, so a pass
    holds `[B, H, block, T]` scores: the extra pass `qk_stats` asks for when attention runs fused."""
    B, S, H, D = q_BSHD.shape
    K = k_BKTD.shape[1]
    q_BKGSD = jax.lax.stop_gradient(q_BSHD).astype(jnp.float32).reshape(B, S, K, H // K, D).transpose(0, 2, 3, 1, 4)
    k_BKTD = jax.lax.stop_gradient(k_BKTD).astype(jnp.float32)
    largest_BKG = jnp.full((B, K, H // K), -jnp.inf, jnp.float32)
    for start in range(0, S, block):
        stop = min(start + block, S)
        scores_BKGST = jnp.einsum("bkgsd,bktd->bkgst", q_BKGSD[:, :, :, start:stop], k_BKTD,
                                  preferred_element_type=jnp.float32) * scale
        scores_BKGST = jnp.where(allowed_BST[:, None, None, start:stop], scores_BKGST, -jnp.inf)
        largest_BKG = jnp.maximum(largest_BKG, jnp.max(scores_BKGST, axis=(3, 4)))
    return largest_BKG.reshape(B, H)


def decode_attend(q_BSHD, cache: AttentionCache, knobs, slots_BS, segments_BS, spec: "AttentionSpec") -> jax.Array:
    """`attend` of one query a row `[B, 1, H, D]` under the decode mask, in Dew's decode kernel
    (`dew.kernels.decode_attention`), reading layer `knobs.local` of `cache` in place. A real query
    (segment 1, as the cache's filled slots are) at slot `p` reads the filled slots up to its own,
    `[max(p + 1 - window, 0), p + 1)`; a padding query reads nothing (zeros; nothing reads it)."""
    ends_B = jnp.where(segments_BS[:, 0] == 1, slots_BS[:, 0] + 1, 0)
    starts_B = jnp.zeros_like(ends_B) if knobs.window is None else jnp.maximum(ends_B - knobs.window, 0)
    scale = spec.head_dim**-0.5 if spec.query_scale is None else spec.query_scale
    out_BHD = decode_kernel.decode_attention(q_BSHD[:, 0], cache.keys, cache.values, knobs.local, starts_B, ends_B,
                                             scale, spec.softcap)
    return out_BHD[:, None].astype(q_BSHD.dtype)


def _batch_mask(cache, q_groups, spec: "AttentionSpec", knobs) -> bool:
    """Whether an accelerator kernel reads a pass's mask whole (`[B, S, T]`, per row) rather than as a
    static structure: a prefill's slots, image spans, chunks of positions, or a window it cannot pick."""
    return (cache is not None or q_groups is not None or spec.chunk is not None
            or (knobs.window is not None and not knobs.windows))


def accelerated_attention(kernel: str, q_BSHD, k_BSKD, v_BSKV, *, scale: float, causal: bool, knobs,
                          softcap: float | None = None, mask_BST=None, segments_BS=None,
                          heads_major: bool = False) -> jax.Array:
    """`[B, S, H, V]`: a pass's attention over its own keys in the accelerator kernel `kernel` ("splash" or
    "cudnn", `dew.kernels.accelerator_attention.choose`), under the whole mask `mask_BST` where it depends on
    the batch, else the static one: causal or full, the layer's window (`knobs`), and with `segments_BS`
    each query's own document. In a run whose layers slide by different windows (the window traced), one
    static kernel per window, the layer's picked by `lax.switch`. With `heads_major` (splash only) the queries
    are `[B, H, S, D]`."""
    if mask_BST is not None:
        return accelerator.splash_attention(q_BSHD, k_BSKD, v_BSKV, scale=scale, softcap=softcap, mask_BST=mask_BST,
                                            heads_major=heads_major)

    def static(window):
        window = None if window == NO_WINDOW else window
        if kernel == "cudnn":
            return accelerator.cudnn_attention(q_BSHD, k_BSKD, v_BSKV, scale=scale, causal=causal, window=window)
        return accelerator.splash_attention(q_BSHD, k_BSKD, v_BSKV, scale=scale, causal=causal, window=window,
                                            softcap=softcap, segments_BS=segments_BS, heads_major=heads_major)

    windows = knobs.windows if knobs.window is not None else (NO_WINDOW,)
    if len(windows) == 1:
        return static(windows[0])
    index = sum(jnp.where(knobs.window == w, i, 0) for i, w in enumerate(windows))
    return jax.lax.switch(index, [functools.partial(static, w) for w in windows])


@dataclasses.dataclass(frozen=True)
class NoPE:
    """Layers without rotary positions (Llama 4's global layers, `no_rope_layers`): `layers` rotate nothing
    and normalise no queries or keys (Llama 4 norms only its rotated layers'). With `floor_scale`, their
    queries are multiplied by `1 + attn_scale * log1p(floor((position + 1) / floor_scale))`, a temperature
    rising with the position (transformers' `attn_temperature_tuning`)."""

    layers: tuple[int, ...]
    floor_scale: float | None = None
    attn_scale: float = 0.1

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if len(set(self.layers)) != len(self.layers) or any(i < 0 for i in self.layers):
            raise ValueError(f"nope layers is {self.layers}: list distinct layer numbers >= 0")
        if self.floor_scale is not None and not self.floor_scale > 0:
            raise ValueError(f"nope floor_scale is {self.floor_scale}; it is a number of positions above 0, or None "
                             "for no temperature")

    def temperature(self) -> tuple[float, float] | None:
        """`(floor_scale, attn_scale)` of the layers' query temperature, None without one."""
        return None if self.floor_scale is None else (float(self.floor_scale), float(self.attn_scale))


def query_temperature(positions_BS: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """float32 `[B, S]`: `log1p(floor((position + 1) / floor_scale)) * attn_scale + 1`, in transformers' order."""
    steps_BS = jnp.floor((positions_BS.astype(jnp.float32) + 1.0) / jnp.float32(floor_scale))
    return jnp.log1p(steps_BS) * jnp.float32(attn_scale) + 1.0


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query self-attention: full, sliding-window (`window`) or bidirectional (`causal=False`).

    `num_heads` query heads share `num_kv_heads` key/value heads of `head_dim` features; rotary
    angles use `rope_theta` and `rope_scaling`. `qk_norm` normalises queries and keys before the
    rotation, per head (`qk_norm_scope="head"`, Qwen 3, Gemma 3) or over the whole projection
    (`"projection"`, OLMo 2), or per head without a scale after the rotation (`"l2"`, Llama 4);
    `qkv_bias`/`o_bias` add biases; `query_scale` replaces
    `head_dim ** -0.5`; `softcap` caps the scores (Gemma 2). Gemma 4: `value_norm` divides each value
    head by its rms (no scale), and `keys_as_values` reads the values from the key projection (before
    its norm and rotation), so the layer has no `v_proj`. Qwen3-Next: `output_gate` doubles `q_proj`
    (per head, the query's features then a gate's) and multiplies the attention's output by
    `sigmoid(gate)` before `o_proj`; a default rotary with a `rotated_fraction` turns only the first
    features of each head (`dew.nn.rotary.rotated_width`). Without `rotary` the layer rotates nothing
    (NoPE: Llama 4's global layers, SmolLM3's `no_rope_layers`); Llama 4: `chunk` lets a query read only
    keys in its own chunk of positions, and `temperature` `(floor_scale, attn_scale)` scales queries by
    `query_temperature` of their positions. Gemma 4's shared keys and values (`shared_kv`): a "store"
    layer reports the keys and values it attends over (`{"shared_kv": (keys, values)}`: this call's
    `[B, S, K, D]` without a cache, the cache's `[B, K, T, D]` with one), and a "reuse" layer has no key
    or value projections and attends over those of `LayerContext.shared_kv` (its cache is empty). `window`
    and the rotary setting may
    differ between the layers of one scanned run; everything else shapes the parameters or the
    program and may not.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    window: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    qkv_bias: bool = False
    o_bias: bool = False
    query_scale: float | None = None
    softcap: float | None = None
    value_norm: bool = False
    keys_as_values: bool = False
    output_gate: bool = False
    rotary: bool = True
    chunk: int | None = None
    temperature: tuple[float, float] | None = None
    shared_kv: str | None = None

    def __post_init__(self):
        if self.shared_kv not in (None, "store", "reuse"):
            raise ValueError(f"shared_kv is {self.shared_kv!r}; it is None, 'store' or 'reuse'")

    def rope(self) -> tuple[int, float | None, RopeScaling]:
        """The rotary table this mixer reads: (rotated features, base, scaling); base None for the
        identity table of a layer without rotary positions (as wide as its rotating neighbours')."""
        if not self.rotary:
            return rotated_width(self.head_dim, self.rope_scaling), None, RopeScaling()
        return rotated_width(self.head_dim, self.rope_scaling), self.rope_theta, self.rope_scaling

    def scan_key(self) -> "AttentionSpec":
        """This spec with the per-layer values erased (the rotated width kept, which shapes the program):
        layers with equal keys scan together."""
        partial = self.rope_scaling.rotated_fraction if self.rope_scaling.kind == "default" else 1.0
        # layers sharing keys and values share them by kind (windowed or not): kinds never scan together
        return dataclasses.replace(self, window=self.window if self.shared_kv else None, rope_theta=0.0,
                                   rope_scaling=RopeScaling(rotated_fraction=partial), rotary=True)

    def empty_cache(self, layers: int, rows: int, capacity: int, dtype) -> AttentionCache:
        # a layer reusing another's keys and values keeps none of its own
        layers = 0 if self.shared_kv == "reuse" else layers
        return AttentionCache.empty(layers, rows, capacity, self.num_kv_heads, self.head_dim, dtype)

    def module(self, *, norm_style: str, norm_eps: float, dtype, param_dtype, name: str) -> "Attention":
        return Attention(self, norm_style, norm_eps, dtype, param_dtype, name=name)


class Attention(nn.Module):
    """Self-attention with the projections named as in transformers (`q_proj` ... `o_proj`)."""

    spec: AttentionSpec
    norm_style: str = "llama"
    norm_eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSE: jax.Array, rotary: tuple[jax.Array, jax.Array], context, knobs,
                 cache: AttentionCache | None = None) -> tuple[jax.Array, AttentionCache | None, dict | None]:
        """`context` is the stack's `LayerContext` (slots, segments, the cache's filled slots) and
        `knobs` this layer's `LayerKnobs` (its window and its index in the cache). The third result
        is what the mixer reports: with `context.report_qk`, `{"qk_max": [B, H]}` (`score_max` over
        the real query/key pairs the mask allows), else None."""
        s = self.spec
        B, S, E = x_BSE.shape
        H, D = s.num_heads, s.head_dim
        dense = lambda features, bias, names, name: Linear(features, use_bias=bias, dtype=self.dtype,
                                                           param_dtype=self.param_dtype, names=names, name=name)
        q_BSF = dense(H * D * (2 if s.output_gate else 1), s.qkv_bias, ("embed", "heads"), "q_proj")(x_BSE)
        if s.output_gate:
            q_BSHF, gate_BSHD = jnp.split(q_BSF.reshape(B, S, H, 2 * D), 2, axis=-1)
            q_BSF = q_BSHF.reshape(B, S, H * D)
        norm = lambda name: RMSNorm(self.norm_eps, self.norm_style, dtype=self.dtype, param_dtype=self.param_dtype,
                                    name=name)
        reuse = s.shared_kv == "reuse"
        if reuse:
            # the keys and values of an earlier layer (`LayerContext.shared_kv`), normed and rotated there
            q_BSHD = q_BSF.reshape(B, S, H, D)
            if s.qk_norm:
                q_BSHD = norm("q_norm")(q_BSHD)
            k_BSKD, v_BSKD = context.shared_kv
        else:
            q_BSHD, k_BSKD, v_BSKD = self._project(x_BSE, q_BSF, rotary, dense, norm)

        q_groups, k_groups = context.groups_BS, context.groups_BS
        if q_groups is not None and context.sliding_groups:
            # Gemma 4: an image's tokens read each other in both directions in sliding layers only
            if knobs.window is None:
                q_groups = k_groups = None
            else:  # a scanned run may mix kinds: a full layer's window is NO_WINDOW
                q_groups = k_groups = jnp.where(knobs.window < NO_WINDOW, q_groups, -1)
        if cache is None:
            k_slots, k_segments = context.slots_BS, context.segments_BS
            k_positions = context.positions_BS
        else:
            k_groups = None if q_groups is None else context.key_groups_BT
            if not context.read_only_cache and not reuse:
                cache = cache.write(knobs.local, context.write_slots_BS, k_BSKD, v_BSKD)
            k_segments = context.filled_BT
            k_slots = context.key_slots_BT
            if k_slots is None:
                k_slots = jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32), k_segments.shape)
            # a cached key's position is its slot: a row's real tokens fill the cache from slot 0, each at
            # its default position (only the chunk mask reads them)
            k_positions = k_slots
            if context.read_only_cache:  # this call's own keys follow the cached ones
                k_slots = jnp.concatenate([k_slots, context.slots_BS], axis=1)
                k_segments = jnp.concatenate([k_segments, context.segments_BS], axis=1)
                if s.chunk is not None:
                    k_positions = jnp.concatenate([k_positions, context.positions_BS], axis=1)
        mask_BST = attention_mask(context.slots_BS, k_slots, context.segments_BS, k_segments, causal=s.causal,
                                  window=knobs.window, q_groups_BS=q_groups, k_groups_BT=k_groups,
                                  chunk=s.chunk, q_positions_BS=context.positions_BS, k_positions_BT=k_positions)
        # An image's tokens read its later tokens too, so no block of queries may skip the keys after it.
        ordered = s.causal and q_groups is None
        # One new token a row, appended to the cache and reading only its filled slots (the decode mask in
        # ranges: no images, chunks, prefixes or custom key slots, whose masks are not ranges). A layer
        # reusing an earlier layer's keys and values (Gemma 4) keeps no cache layer of its own to read.
        one_query = (cache is not None and S == 1 and ordered and s.chunk is None and not context.read_only_cache
                     and context.key_slots_BT is None and k_groups is None and not reuse)
        decode = one_query and decode_kernel.usable(cache.keys, cache.values)
        # A pass over this call's own keys (none cached, or a prefill into a fresh cache: the cache then holds
        # exactly this call's real tokens) may run in an accelerator's kernel (dew.kernels.accelerator_attention).
        own_prefill = (cache is not None and not decode and context.fresh_cache and not context.read_only_cache
                       and not reuse and context.key_slots_BT is None)
        kernel, dynamic = "xla", _batch_mask(cache, q_groups, s, knobs)
        if cache is None or own_prefill:
            kernel = accelerator.choose(accelerator.requested(), q_BSHD.dtype, q_width=D, v_width=D,
                                        softcap=s.softcap, segmented=context.segmented, dynamic=dynamic)
        fused = (kernel == "xla" and not decode and cache is None and s.softcap is None
                 and fast_softmax.attention_usable(q_BSHD, k_BSKD, v_BSKD))
        # With a cache (a prefill), `attend` reads its queries heads-major `[B, H, S, D]`, laid out so before
        # they are rotated: XLA's CPU backend runs a rotation fused into the transpose after it element by
        # element, at several times the cost of the transpose fused into the rotation's reads. (A pass without
        # a cache may be differentiated, where this order would put the slow transpose in the backward.)
        heads_major = kernel == "splash" or (kernel == "xla" and not decode and not fused and cache is not None)
        # [B, H, S, D] with heads_major, else [B, S, H, D]
        q = self._finish_queries(q_BSHD, rotary, context.positions_BS, heads_major, reuse)
        report = None
        scale = D**-0.5 if s.query_scale is None else s.query_scale
        if context.report_qk:  # whole sequences only: the decoder refuses it with a cache
            # a real query's allowed keys share its segment, so are real too; padding reads only padding
            real_BST = mask_BST & (context.segments_BS > 0)[:, :, None]
            q_seen = q.transpose(0, 2, 1, 3) if heads_major else q
            report = {"qk_max": score_max(q_seen, k_BSKD.transpose(0, 2, 1, 3), real_BST, scale)}
        if kernel != "xla":
            if cache is not None:  # the prefill's own keys, under the mask its cache would give them
                mask_BST = attention_mask(context.slots_BS, context.slots_BS, context.segments_BS, context.segments_BS,
                                          causal=s.causal, window=knobs.window, q_groups_BS=q_groups,
                                          k_groups_BT=q_groups, chunk=s.chunk, q_positions_BS=context.positions_BS,
                                          k_positions_BT=context.positions_BS)
            out_BSHD = accelerated_attention(kernel, q, k_BSKD, v_BSKD, scale=scale, causal=s.causal, knobs=knobs,
                                             softcap=s.softcap, mask_BST=mask_BST if dynamic else None,
                                             segments_BS=context.segments_BS if context.segmented else None,
                                             heads_major=heads_major)
        elif decode:
            out_BSHD = decode_attend(q, cache, knobs, context.slots_BS, context.segments_BS, s)
        elif fused:
            # Training's pass (and any without a cache), float32: scores, softmax and weighted values in one
            # kernel, keys and values as the projections laid them out.
            out_BSHD = fast_softmax.attention(q, k_BSKD, v_BSKD, mask_BST, scale, ordered, FUSED_BLOCK)
        elif (cache is not None and not reuse and not context.read_only_cache and s.softcap is None
              and prefill_kernel.usable(q, cache.keys, cache.values)):
            # A prefill over this layer's cache, read in place: each block of queries scores only the keys its
            # mask allows, from the first to the last (the filled slots at an offset, not the capacity).
            out_BSHD = _prefill_attention(q, cache.keys, cache.values, knobs.local, mask_BST, scale)
        else:
            if cache is None:
                keys, values = k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3)
            else:
                keys, values = (k_BSKD, v_BSKD) if reuse else cache.read(knobs.local, B)
                if context.read_only_cache:
                    own = lambda x_BSKD, cached: x_BSKD.transpose(0, 2, 1, 3).astype(cached.dtype)
                    keys = jnp.concatenate([keys, own(k_BSKD, keys)], axis=2)
                    values = jnp.concatenate([values, own(v_BSKD, values)], axis=2)
            # Without a cache, or with one that held nothing, query `i` may read key slots up to `i` only (a
            # row's real tokens fill slots from 0 in order, and a padding query's slot is at most its index),
            # so a causal pass can skip each query block's later keys: the mask holds them out anyway. (A
            # padding query that may read nothing averages the keys it scores; nothing reads its output.)
            blocks = ordered and (cache is None or context.fresh_cache)
            out_BSHD = attend(q, keys, values, mask_BST, causal_blocks=blocks, scale=s.query_scale,
                              softcap=s.softcap, heads_major=heads_major)
        if s.output_gate:
            out_BSHD = (out_BSHD.astype(jnp.float32) * jax.nn.sigmoid(gate_BSHD.astype(jnp.float32))).astype(self.dtype)
        if s.shared_kv == "store":
            shared = (k_BSKD, v_BSKD) if cache is None else cache.read(knobs.local, B)
            report = {**(report or {}), "shared_kv": shared}
        return dense(E, s.o_bias, ("heads", "embed"), "o_proj")(out_BSHD.reshape(B, S, H * D)), cache, report

    def _finish_queries(self, q_BSHD, rotary, positions_BS, heads_major: bool, reuse: bool) -> jax.Array:
        """The queries `_project` gives (normed, not rotated), rotated, normed after the rotation (`"l2"`) and
        scaled by their temperature: `[B, S, H, D]`, or `[B, H, S, D]` with `heads_major`."""
        s = self.spec
        heads_axis = 1 if heads_major else 2
        q = q_BSHD.transpose(0, 2, 1, 3) if heads_major else q_BSHD
        if s.rotary:
            q = apply_partial_rotary(q, *rotary, heads_axis)
        if s.qk_norm and s.qk_norm_scope == "l2" and not reuse:
            q = normalize(q, self.norm_eps)
        if s.temperature is not None:
            scale_BS = query_temperature(positions_BS, *s.temperature)
            q = (q.astype(jnp.float32) * jnp.expand_dims(scale_BS, (heads_axis, 3))).astype(q.dtype)
        return q

    def _project(self, x_BSE, q_BSF, rotary, dense, norm):
        """This layer's queries `[B, S, H, D]`, normed (`_finish_queries` rotates them in the layout attention
        reads), and keys and values `[B, S, K, D]`, normed and rotated."""
        s = self.spec
        B, S, _ = x_BSE.shape
        H, K, D = s.num_heads, s.num_kv_heads, s.head_dim
        k_BSF = dense(K * D, s.qkv_bias, ("embed", "kv"), "k_proj")(x_BSE)
        v_BSF = k_BSF if s.keys_as_values else dense(K * D, s.qkv_bias, ("embed", "kv"), "v_proj")(x_BSE)
        v_BSKD = v_BSF.reshape(B, S, K, D)
        if s.value_norm:
            v_BSKD = normalize(v_BSKD, self.norm_eps)
        if s.qk_norm and s.qk_norm_scope == "projection":
            q_BSF, k_BSF = norm("q_norm")(q_BSF), norm("k_norm")(k_BSF)
        q_BSHD, k_BSKD = q_BSF.reshape(B, S, H, D), k_BSF.reshape(B, S, K, D)
        if s.qk_norm and s.qk_norm_scope == "head":
            q_BSHD, k_BSKD = norm("q_norm")(q_BSHD), norm("k_norm")(k_BSKD)
        if s.rotary:
            k_BSKD = apply_partial_rotary(k_BSKD, *rotary)
        if s.qk_norm and s.qk_norm_scope == "l2":
            k_BSKD = normalize(k_BSKD, self.norm_eps)
        return q_BSHD, k_BSKD, v_BSKD
