"""Gemma 4's text decoder layers (`DecoderConfig.gemma4`): what its layers compute beyond Gemma 3's.

- Full-attention layers have their own head width and key/value heads (`full_head_dim`,
  `full_kv_heads`) and may read their values from the key projection (`keys_as_values`); every layer
  divides its value heads by their rms without a scale and scores unscaled (`query_scale` 1).
- Each layer multiplies its output by a frozen scalar (`layer_scalar`, in the `constants` collection).
- Per-layer inputs (`per_layer_width` P > 0): a table `embed_tokens_per_layer` `[V', L * P]` gives each token
  a P-wide input per layer, scaled by `sqrt(P)` (its pad row, id 0, takes no gradient, as neither does the
  token embedding's: transformers builds both with `padding_idx`, and a multimodal model's placeholders read it); the embeddings, projected by `per_layer_model_projection`
  (times `E ** -0.5`) and normed per layer (`per_layer_projection_norm`), are added and the sum halved in
  variance (times `2 ** -0.5`). Layer l gates its output with them: `x + norm(proj(act(gate(x)) * inputs_l))`.
- The last `kv_shared_layers` layers compute no keys or values: each reads those of the last earlier layer
  of its type (which `kv_roles` marks "store"), so they keep no cache; with `double_wide_mlp` their MLP is
  twice as wide.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear, named
from dew.nn.norms import RMSNorm

STORE, REUSE = "store", "reuse"


@dataclasses.dataclass(frozen=True)
class Gemma4Layers:
    """Gemma 4's layer options (see the module). `per_layer_vocab` is the per-layer table's rows (None: the
    model's vocabulary)."""

    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    keys_as_values: bool = False
    per_layer_width: int = 0
    per_layer_vocab: int | None = None
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False

    def __post_init__(self):
        for name in ("full_head_dim", "full_kv_heads", "per_layer_vocab"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"gemma4 {name} is {value}; it must be at least 1, or None for the model's own")
        for name in ("per_layer_width", "kv_shared_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"gemma4 {name} is {getattr(self, name)}; it is a count, 0 for none")

    def kv_roles(self, kinds: tuple[str, ...]) -> tuple[str | None, ...]:
        """Each layer's part in sharing keys and values (`kv_roles`)."""
        return kv_roles(kinds, self.kv_shared_layers, "gemma4")


def kv_roles(kinds: tuple[str, ...], shared: int, owner: str) -> tuple[str | None, ...]:
    """Each layer's part in sharing keys and values, given each layer's kind (its attention type) and how many
    last layers share: "reuse" for those `shared` layers, "store" for the last layer of each kind before them, None
    otherwise. A kind of reusing layer with no earlier layer of its kind is refused (`owner` names the options)."""
    layers = len(kinds)
    if not shared:
        return (None,) * layers
    first = layers - shared
    if first < 1:
        raise ValueError(f"{owner} kv_shared_layers is {shared} of {layers} layers: at least the first layer must "
                         "compute its own keys and values")
    roles: list[str | None] = [None] * first + [REUSE] * shared
    for kind in set(kinds[first:]):
        earlier = [i for i in range(first) if kinds[i] == kind]
        if not earlier:
            raise ValueError(f"{owner} kv_shared_layers {shared}: the shared {kind} layers have no earlier {kind} "
                             "layer to read keys and values from")
        roles[earlier[-1]] = STORE
    return tuple(roles)


class PerLayerInputs(nn.Module):
    """float `[B, S, L, P]`: each layer's input from the token ids `[B, S]` and their scaled embeddings
    `[B, S, E]` (see the module)."""

    layers: int
    width: int
    vocab: int
    norm_eps: float
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, ids_BS, embedded_BSE):
        B, S, E = embedded_BSE.shape
        L, P = self.layers, self.width
        table = nn.Embed(self.vocab, L * P, dtype=self.dtype, param_dtype=self.param_dtype,
                         embedding_init=named(nn.initializers.normal(0.02), ("vocab", "embed")),
                         name="embed_tokens_per_layer")
        # ids past the table (Gemma 3n's media ids beyond vocab_size_per_layer_input) read its row 0
        ids_BS = jnp.where((ids_BS >= 0) & (ids_BS < self.vocab), ids_BS, 0)
        tokens_BSLP = table(ids_BS).astype(self.dtype) * jnp.asarray(P ** 0.5, self.dtype)
        # the pad row (id 0, which placeholder slots read) is frozen, as transformers' padding_idx keeps it
        tokens_BSLP = jnp.where((ids_BS == 0)[:, :, None], jax.lax.stop_gradient(tokens_BSLP), tokens_BSLP)
        projected = Linear(L * P, dtype=self.dtype, param_dtype=self.param_dtype, names=("embed", "mlp"),
                           name="per_layer_model_projection")(embedded_BSE)
        projected_BSLP = (projected * jnp.asarray(E ** -0.5, self.dtype)).reshape(B, S, L, P)
        projected_BSLP = RMSNorm(self.norm_eps, "olmo", dtype=self.dtype, param_dtype=self.param_dtype,
                                 name="per_layer_projection_norm")(projected_BSLP)
        return (projected_BSLP + tokens_BSLP.reshape(B, S, L, P)) * jnp.asarray(2.0 ** -0.5, self.dtype)


def layer_inputs(per_layer_BSLP: jax.Array, index) -> jax.Array:
    """Layer `index`'s inputs `[B, S, P]` (`index` may be traced, inside a scanned run)."""
    return jnp.take(per_layer_BSLP, index, axis=2)
