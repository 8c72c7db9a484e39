"""SigLIP's vision tower, as Gemma 3 runs it: pixels `[N, C, H, W]` to patch states `[N, P, hidden]`.

transformers' `SiglipVisionModel` (`siglip/modeling_siglip.py`) without its pooling head: a patch
embedding (a convolution whose kernel and stride are one patch, with a bias), a learned position
embedding per patch (no class token), pre-norm blocks of bidirectional multi-head attention and a
`fc1 -> activation -> fc2` MLP, every linear and LayerNorm biased, and a last LayerNorm. The parameter
tree keeps transformers' names: `embeddings/{patch_embedding,position_embedding}`,
`encoder/layers_0to{L-1}/{layer_norm1,self_attn/{q,k,v,out}_proj,layer_norm2,mlp/{fc1,fc2}}` (the
layers scanned, stacked on a leading axis) and `post_layernorm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import dot
from dew.nn.attention import attend
from dew.nn.linear import named
from dew.nn.mlp import ACTIVATIONS
from dew.nn.vision.base import TowerGeometry, TowerPart, layer_norm, require_positive_ints

MODEL_TYPE = "siglip_vision_model"
# transformers' activation names (`hidden_act`) and the Dew activation (dew.nn.mlp) each one is.
HIDDEN_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# Keys a vision_config record may hold that change nothing the tower computes: transformers' bookkeeping
# (4.x and 5.x), the weights' dtype (the loader chooses Dew's), initialisers, and the pooling head Gemma 3
# never runs (`vision_use_head`: its tensors, where a checkpoint holds them, are left unread).
_INERT = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "name_or_path", "_commit_hash",
    "dtype", "torch_dtype", "use_bfloat16", "initializer_range", "initializer_factor", "vision_use_head",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "attn_implementation",
    "_attn_implementation_autoset", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tie_word_embeddings",
})


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """The fields of transformers' `SiglipVisionConfig` that shape the computation, with its defaults.

    `attention_dropout` is recorded (and written back) only: Dew's tower drops no attention weights."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0

    def __post_init__(self):
        require_positive_ints(self, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_channels", "image_size", "patch_size"))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} does not split into num_attention_heads "
                             f"{self.num_attention_heads} equal heads: give a head count that divides it")
        if self.patch_size > self.image_size:
            raise ValueError(f"patch_size {self.patch_size} is larger than image_size {self.image_size}: "
                             "an image must hold at least one patch")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act is {self.hidden_act!r}; Dew computes a SigLIP tower with "
                             f"{sorted(HIDDEN_ACTS)} (transformers' names)")
        if not isinstance(self.layer_norm_eps, (int, float)) or not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps is {self.layer_norm_eps!r}; it must be a positive number")
        if not isinstance(self.attention_dropout, (int, float)) or not 0 <= self.attention_dropout < 1:
            raise ValueError(f"attention_dropout is {self.attention_dropout!r}; it must lie in [0, 1)")

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "SiglipConfig":
        """The config a `vision_config` record (a dict, as config.json holds it) describes; transformers'
        defaults stand for absent fields. A field that would change the computation and is not one of
        these is refused by name, as is another `model_type`; `where` names the record in errors."""
        model_type = record.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"{where} has model_type {model_type!r}; a SigLIP tower is transformers' "
                             f"{MODEL_TYPE!r}")
        fields = {field.name for field in dataclasses.fields(cls)}
        for name, value in record.items():
            if name not in fields and name not in _INERT and not (name == "pruned_heads" and not value):
                raise ValueError(f"{where} field {name!r} = {value!r} is not a field of transformers' "
                                 "SiglipVisionConfig that Dew computes: remove it if the tower was trained without it")
        try:
            return cls(**{name: record[name] for name in fields if name in record})
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` record of this tower, for a config.json. It says `vision_use_head: false`:
        Dew's tower has no pooling head, and writes none of its tensors."""
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self), "vision_use_head": False}

    def geometry(self) -> TowerGeometry:
        return TowerGeometry(self.image_size, self.patch_size, self.num_channels)

    def example(self, dtype) -> dict:
        return self.geometry().example(dtype)

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "SiglipTower":
        """The tower computing in `dtype` with parameters stored in `param_dtype`."""
        return SiglipTower(self, dtype, param_dtype)


def _layer_norm(config: SiglipConfig, param_dtype, name: str) -> nn.LayerNorm:
    return layer_norm(config.layer_norm_eps, param_dtype, name)


class PatchEmbedding(TowerPart):
    """transformers' patch convolution (kernel = stride = one patch, VALID, biased) as one product
    `[N*P, p*p*C] @ [p*p*C, hidden]` over a flax-layout (HWIO) kernel `[p, p, C, hidden]`: float32
    `[N, P, hidden]`, patches in row-major order."""

    @nn.compact
    def __call__(self, pixels_NCHW: jax.Array) -> jax.Array:
        c = self.config
        p, t, C, E = c.patch_size, c.image_size // c.patch_size, c.num_channels, c.hidden_size
        kernel = self.param("kernel", named(nn.initializers.lecun_normal(), (None, None, None, "embed")),
                            (p, p, C, E), self.param_dtype)
        bias = self.param("bias", named(nn.initializers.zeros_init(), ("embed",)), (E,), self.param_dtype)
        N = pixels_NCHW.shape[0]
        pixels = pixels_NCHW[:, :, :t * p, :t * p].reshape(N, C, t, p, t, p)
        patches_XK = pixels.transpose(0, 2, 4, 3, 5, 1).reshape(N * t * t, p * p * C)  # each row (kh, kw, C)
        x_XE = dot(patches_XK.astype(self.dtype), kernel.reshape(p * p * C, E).astype(self.dtype))
        return (x_XE + bias.astype(jnp.float32)).reshape(N, t * t, E)


class SiglipEmbeddings(TowerPart):
    """Each patch's vector plus its learned position vector (`position_embedding`, `[P, hidden]`)."""

    @nn.compact
    def __call__(self, pixels_NCHW: jax.Array) -> jax.Array:
        c = self.config
        patches = c.geometry().patches
        x_NPE = PatchEmbedding(c, self.dtype, self.param_dtype, name="patch_embedding")(pixels_NCHW)
        position_PE = nn.Embed(patches, c.hidden_size, dtype=jnp.float32, param_dtype=self.param_dtype,
                               embedding_init=named(nn.initializers.normal(c.hidden_size**-0.5), (None, "embed")),
                               name="position_embedding")(jnp.arange(patches))
        return (x_NPE + position_PE).astype(self.dtype)


class SiglipAttention(TowerPart):
    """Multi-head self-attention in which every patch reads every patch; biased projections."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array) -> jax.Array:
        N, P, E = x_NPE.shape
        H = self.config.num_attention_heads
        heads = lambda name: self.linear(E, ("embed", "heads"), name)(x_NPE).reshape(N, P, H, E // H)
        q_NPHD = heads("q_proj")
        k_NHPD, v_NHPD = heads("k_proj").transpose(0, 2, 1, 3), heads("v_proj").transpose(0, 2, 1, 3)
        everything_NPP = jnp.ones((N, P, P), bool)
        out_NPHD = attend(q_NPHD, k_NHPD, v_NHPD, everything_NPP)
        return self.linear(E, ("heads", "embed"), "out_proj")(out_NPHD.reshape(N, P, E))


class SiglipMLP(TowerPart):
    """`fc2(act(fc1(x)))`, the activation in float32 rounded once."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array) -> jax.Array:
        c = self.config
        h_NPF = self.linear(c.intermediate_size, ("embed", "mlp"), "fc1")(x_NPE)
        h_NPF = ACTIVATIONS[HIDDEN_ACTS[c.hidden_act]](h_NPF.astype(jnp.float32)).astype(self.dtype)
        return self.linear(c.hidden_size, ("mlp", "embed"), "fc2")(h_NPF)


class SiglipLayer(TowerPart):
    """One pre-norm block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`; a scan step (carry, nothing)."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array, _) -> tuple[jax.Array, None]:
        c, dtype, param_dtype = self.config, self.dtype, self.param_dtype
        norm = lambda name, x: _layer_norm(c, param_dtype, name)(x).astype(dtype)
        x_NPE = x_NPE + SiglipAttention(c, dtype, param_dtype, name="self_attn")(norm("layer_norm1", x_NPE))
        x_NPE = x_NPE + SiglipMLP(c, dtype, param_dtype, name="mlp")(norm("layer_norm2", x_NPE))
        return x_NPE, None


class SiglipEncoder(TowerPart):
    """The blocks as one `nn.scan` named `layers_0to{L-1}`: compile time does not grow with depth."""

    @nn.compact
    def __call__(self, x_NPE: jax.Array) -> jax.Array:
        layers = self.config.num_hidden_layers
        stack = nn.scan(SiglipLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        x_NPE, _ = stack(self.config, self.dtype, self.param_dtype, name=f"layers_0to{layers - 1}")(x_NPE, None)
        return x_NPE


class SiglipTower(TowerPart):
    """Pixels `[N, C, H, W]` (NCHW, as transformers' image processors give them, H = W = image_size) to
    the last hidden states after `post_layernorm`, `[N, P, hidden]` in `dtype`, P = (image/patch)^2."""

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        c.geometry().check(pixel_values, "SigLIP", "images",
                           f"resize the images to {c.image_size} pixels a side (the processor's size)")
        x_NPE = SiglipEmbeddings(c, self.dtype, self.param_dtype, name="embeddings")(pixel_values)
        x_NPE = SiglipEncoder(c, self.dtype, self.param_dtype, name="encoder")(x_NPE)
        return _layer_norm(c, self.param_dtype, "post_layernorm")(x_NPE).astype(self.dtype)
