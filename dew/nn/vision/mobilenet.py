"""Gemma 3n's vision tower, MobileNet-v5 (timm's `mobilenetv5_300m_enc`, which transformers' `Gemma3nVisionConfig`
names): pixels `[N, 3, H, W]` to soft tokens `[N, R*R, hidden_size]`, R = `msfa_output_resolution`.

A convolutional stem (3x3, stride 2, biased), then stages of blocks written in timm's block notation
(`"uir_r1_a3_k5_s2_e6_c256"`: type, repeats, kernels, stride, expansion, channels):

- `er`, edge residual: a full `k x k` expansion convolution, norm + GELU, a 1x1 projection, norm;
- `uir`, universal inverted residual: an optional depthwise `a x a` convolution and norm, a 1x1 expansion,
  norm + GELU, an optional depthwise `k x k` convolution, norm + GELU, a 1x1 projection, norm, a per-channel
  layer scale;
- `mqa`, mobile multi-query attention: a norm, `h` query heads of width `d` over one shared key and value
  head, whose inputs are first shrunk by a depthwise `k x k` convolution of stride `v` (and a norm) where
  `v > 1`, then a 1x1 output projection and a layer scale.

A block adds its input back where it keeps the shape. Every norm is an RMSNorm over channels (`x / rms(x) *
weight`, eps 1e-6), every activation GELU (tanh form), every strided or spatial convolution TF-style SAME
padded (the extra row and column at the end), and no convolution but the stem's has a bias. The multi-scale
fusion adapter (`msfa`) takes the features `msfa_indices` picks (0 the stem, s + 1 stage s), resizes the
coarser to the finest by nearest neighbour, concatenates their channels, runs a 1x1 expansion (x2, norm, GELU),
a 1x1 projection to `hidden_size` and a norm, average-pools to R x R and norms again.

The parameter tree keeps timm's names: `conv_stem/{conv,bn}`, `blocks_{s}_{i}/...` for `blocks.{s}.{i}.*`,
`msfa/{ffn,norm}`; kernels in flax's HWIO layout, 1x1 ones `[1, 1, in, out]`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from dew.kernels.matmul import dot
from dew.nn.attention import attend
from dew.nn.linear import named
from dew.nn.mlp import ACTIVATIONS
from dew.nn.norms import RMSNorm
from dew.nn.vision.base import TowerGeometry, TowerPart, require_positive_ints

MODEL_TYPE = "gemma3n_vision"
ARCHITECTURE = "mobilenetv5_300m_enc"
HIDDEN_SIZE = 2048  # timm's MobileNet-v5 encoder fixes its output width (`num_features`)
EPS = 1e-6  # timm's RmsNorm2d default, which every norm of the tower keeps
_GELU = ACTIVATIONS["gelu_tanh"]


def _stage(*blocks: tuple[str, int]) -> tuple[str, ...]:
    return tuple(block for block, count in blocks for _ in range(count))


# The published 300M encoder's stages (timm `_gen_mobilenet_v5`), every block written once.
PUBLISHED_STAGES: tuple[tuple[str, ...], ...] = (
    _stage(("er_r1_k3_s2_e4_c128", 1), ("er_r1_k3_s1_e4_c128", 2)),
    _stage(("uir_r1_a3_k5_s2_e6_c256", 1), ("uir_r1_a5_k0_s1_e4_c256", 1), ("uir_r1_a3_k0_s1_e4_c256", 1),
           ("uir_r1_a5_k0_s1_e4_c256", 1), ("uir_r1_a3_k0_s1_e4_c256", 1)),
    _stage(("uir_r1_a5_k5_s2_e6_c640", 1), ("uir_r1_a5_k0_s1_e4_c640", 7), ("uir_r1_a0_k0_s1_e1_c640", 1))
    + ("mqa_r1_k3_h12_v2_s1_d64_c640", "uir_r1_a0_k0_s1_e2_c640") * 14,
    ("uir_r1_a5_k5_s2_e6_c1280",) + ("mqa_r1_k3_h16_s1_d96_c1280", "uir_r1_a0_k0_s1_e2_c1280") * 19,
)

# The options each block type reads (timm's letters); any other is refused by name.
_OPTIONS = {"er": {"r", "k", "s", "e", "c"}, "uir": {"r", "a", "k", "s", "e", "c"},
            "mqa": {"r", "k", "h", "v", "s", "d", "c"}}
_REQUIRED = {"er": {"r", "k", "s", "e", "c"}, "uir": {"r", "k", "s", "e", "c"}, "mqa": {"r", "k", "h", "s", "d", "c"}}


def divisible(value: float, divisor: int = 8) -> int:
    """A channel count as timm rounds one: to the nearest multiple of `divisor` (at least `divisor`), one
    multiple up where that lost more than a tenth."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a stage, as its notation says: `kind` ("er", "uir", "mqa"), output `channels` (before
    rounding), `stride`, `expansion`, and the kernels: `kernel` (er's expansion, uir's middle depthwise, mqa's
    key/value shrinking; 0 none), `start` (uir's first depthwise, 0 none); mqa's `heads`, `key_dim` (also the
    value width) and `kv_stride`."""

    kind: str
    channels: int
    stride: int
    expansion: float = 1.0
    kernel: int = 0
    start: int = 0
    heads: int = 0
    key_dim: int = 0
    kv_stride: int = 1

    def __post_init__(self):
        needed = {"channels": self.channels, "stride": self.stride, "kv_stride": self.kv_stride,
                  **({"kernel": self.kernel} if self.kind == "er" else {}),
                  **({"heads": self.heads, "key_dim": self.key_dim} if self.kind == "mqa" else {})}
        for name, value in needed.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"a MobileNet-v5 {self.kind} block's {name} is {value!r}; it must be a positive integer")
        if not self.expansion > 0:
            raise ValueError(f"a MobileNet-v5 {self.kind} block's expansion is {self.expansion}; it must be positive")
        if self.kind == "mqa" and self.kv_stride > 1 and not self.kernel:
            raise ValueError(f"a MobileNet-v5 mqa block shrinks its keys by {self.kv_stride} with no kernel (k0): give "
                             "the depthwise kernel, as k3")

    @classmethod
    def parse(cls, text: str) -> tuple["Block", int]:
        """The block `text` notes (`"mqa_r1_k3_h12_v2_s1_d64_c640"`) and its repeat count."""
        kind, *ops = text.split("_")
        if kind not in _OPTIONS:
            raise ValueError(f"block {text!r} is of type {kind!r}; Dew builds MobileNet-v5 blocks {sorted(_OPTIONS)}")
        options = {}
        for op in ops:
            match = re.fullmatch(r"([a-z]+)(\d+(?:\.\d+)?)", op)
            if match is None or match[1] not in _OPTIONS[kind]:
                raise ValueError(f"block {text!r} has option {op!r}, which Dew does not build; a {kind} block reads "
                                 f"{sorted(_OPTIONS[kind])} (timm's letters, each followed by its number)")
            options[match[1]] = match[2]
        missing = _REQUIRED[kind] - set(options)
        if missing:
            raise ValueError(f"block {text!r} lacks option(s) {sorted(missing)}, which a {kind} block needs")
        integer = lambda key, default=0: int(options[key]) if key in options else default
        try:
            block = cls(kind, integer("c"), integer("s"), float(options.get("e", 1.0)), integer("k"), integer("a"),
                        integer("h"), integer("d"), integer("v", 1))
        except ValueError as error:
            raise ValueError(f"block {text!r}: {error}") from None
        if integer("r") < 1:
            raise ValueError(f"block {text!r} repeats {integer('r')} times; give r1 or more")
        if block.stride not in (1, 2):
            raise ValueError(f"block {text!r} has stride {block.stride}; a MobileNet-v5 block strides 1 or 2")
        if block.kind == "uir" and block.stride > 1 and not (block.kernel or block.start):
            raise ValueError(f"block {text!r} strides with no depthwise convolution (a0, k0): give it a kernel")
        return block, integer("r")

    def text(self) -> str:
        """The block in timm's notation (one repeat)."""
        expansion = f"{self.expansion:g}"
        if self.kind == "er":
            return f"er_r1_k{self.kernel}_s{self.stride}_e{expansion}_c{self.channels}"
        if self.kind == "uir":
            return f"uir_r1_a{self.start}_k{self.kernel}_s{self.stride}_e{expansion}_c{self.channels}"
        kv = f"_v{self.kv_stride}" if self.kv_stride > 1 else ""
        return f"mqa_r1_k{self.kernel}_h{self.heads}{kv}_s{self.stride}_d{self.key_dim}_c{self.channels}"

    def timm_args(self) -> dict[str, Any]:
        """The block as timm's `decode_arch_def` writes it (what transformers' `model_args["block_args"]` holds)."""
        common = {"block_type": self.kind, "out_chs": self.channels, "stride": self.stride, "act_layer": None}
        if self.kind == "er":
            return {**common, "exp_kernel_size": self.kernel, "pw_kernel_size": 1, "exp_ratio": self.expansion,
                    "force_in_chs": 0, "se_ratio": 0.0, "noskip": False}
        if self.kind == "uir":
            return {**common, "dw_kernel_size_start": self.start, "dw_kernel_size_mid": self.kernel,
                    "dw_kernel_size_end": 0, "exp_ratio": self.expansion, "se_ratio": 0.0, "noskip": False}
        return {**common, "dw_kernel_size": self.kernel, "num_heads": self.heads, "key_dim": self.key_dim,
                "value_dim": self.key_dim, "kv_stride": self.kv_stride, "noskip": False}

    @classmethod
    def from_timm(cls, args: Mapping[str, Any], where: str) -> "Block":
        """The block one of timm's decoded block dicts describes, refusing a dict that is not exactly what a
        block of this kind decodes to (a squeeze-excite ratio, a forced skip, another activation...)."""
        kind = args.get("block_type")
        if kind not in _OPTIONS:
            raise ValueError(f"{where} has block_type {kind!r}; Dew builds MobileNet-v5 blocks {sorted(_OPTIONS)}")
        kernel = args.get({"er": "exp_kernel_size", "uir": "dw_kernel_size_mid", "mqa": "dw_kernel_size"}[kind], 0)
        try:
            block = cls(kind, args.get("out_chs"), args.get("stride"), args.get("exp_ratio", 1.0), kernel,
                        args.get("dw_kernel_size_start", 0) if kind == "uir" else 0, args.get("num_heads", 0),
                        args.get("key_dim", 0), args.get("kv_stride", 1))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None
        if dict(args) != block.timm_args():
            theirs = {key: value for key, value in args.items() if block.timm_args().get(key, object()) != value}
            raise ValueError(f"{where} = {dict(args)} sets {theirs}, which Dew's MobileNet-v5 does not build: Dew "
                             f"reads the blocks timm decodes from notation such as {block.text()!r}")
        return block


@dataclasses.dataclass(frozen=True)
class MobileNetV5Config:
    """The MobileNet-v5 encoder: `stages` of blocks in timm's notation (`PUBLISHED_STAGES`, the 300M encoder, by
    default), the stem's `stem_size` channels, the features the fusion adapter reads (`msfa_indices`, Python-style
    into `[stem, stage 0, ...]`), its output grid `msfa_output_resolution` and width `hidden_size`, and the square
    `image_size` (Gemma 3n's processor gives 768) of `num_channels` channels.

    Each stage starts with a stride-2 `er` or `uir` block and the others keep the size (as the published encoder
    does): timm's feature list and its stride limit (32, where it would dilate instead) then hold at once."""

    stages: tuple[tuple[str, ...], ...] = PUBLISHED_STAGES
    stem_size: int = 64
    msfa_indices: tuple[int, ...] = (-2, -1)
    msfa_output_resolution: int = 16
    hidden_size: int = HIDDEN_SIZE
    image_size: int = 768
    num_channels: int = 3

    def __post_init__(self):
        if isinstance(self.stages, str) or any(isinstance(stage, str) for stage in self.stages):
            raise ValueError(f"stages is {self.stages!r}; give a sequence of stages, each a sequence of blocks in "
                             "timm's notation, as (('er_r1_k3_s2_e4_c128',), ...)")
        object.__setattr__(self, "stages", tuple(tuple(stage) for stage in self.stages))
        object.__setattr__(self, "msfa_indices", tuple(self.msfa_indices))
        require_positive_ints(self, ("stem_size", "msfa_output_resolution", "hidden_size", "image_size",
                                     "num_channels"))
        if not 1 <= len(self.stages) <= 4 or not all(self.stages):
            raise ValueError(f"MobileNet-v5 has 1 to 4 non-empty stages (the stem and each stage halve the image, "
                             f"and timm stops striding at 32); {len(self.stages)} were given")
        for s, stage in enumerate(self.blocks):
            for i, block in enumerate(stage):
                if (block.stride == 2) != (i == 0) or (i == 0 and block.kind == "mqa"):
                    raise ValueError(f"stage {s} block {i} ({block.text()}): each stage starts with a stride-2 er or "
                                     "uir block and every other block has stride 1, as the published encoder does")
        features = len(self.stages) + 1
        if not self.msfa_indices or any(not -features <= index < features for index in self.msfa_indices):
            raise ValueError(f"msfa_indices {self.msfa_indices} must pick among the {features} features "
                             f"(stem and {len(self.stages)} stages), counted from either end")
        if sorted(set(self.fusion_features)) != list(self.fusion_features):
            raise ValueError(f"msfa_indices {self.msfa_indices} must name distinct features, finest first")
        stride = 2 ** (len(self.stages) + 1)
        finest = self.image_size // self.feature_stride(self.fusion_features[0])
        if self.image_size % stride or finest % self.msfa_output_resolution:
            raise ValueError(f"image_size {self.image_size} must be a multiple of {stride} (the encoder's stride) whose "
                             f"finest fused feature grid ({finest}) pools evenly to msfa_output_resolution "
                             f"{self.msfa_output_resolution}: Dew does not build timm's bilinear resize for the rest")

    @property
    def blocks(self) -> tuple[tuple[Block, ...], ...]:
        """Every stage's blocks, repeats spelt out."""
        stages = []
        for stage in self.stages:
            blocks = []
            for text in stage:
                block, repeats = Block.parse(text)
                # timm strides only a repeated block's first copy
                blocks += [dataclasses.replace(block, stride=block.stride if r == 0 else 1) for r in range(repeats)]
            stages.append(tuple(blocks))
        return tuple(stages)

    @property
    def fusion_features(self) -> tuple[int, ...]:
        """The fused features' indices into `[stem, stage 0, ...]`, non-negative."""
        return tuple(index % (len(self.stages) + 1) for index in self.msfa_indices)

    def feature_stride(self, feature: int) -> int:
        return 2 ** (feature + 1)

    def channels(self) -> list[int]:
        """Each feature's channel count, the stem's first (timm's rounding applied)."""
        return [divisible(self.stem_size)] + [divisible(stage[-1].channels) for stage in self.blocks]

    @classmethod
    def from_hf(cls, record: Mapping[str, Any], where: str) -> "MobileNetV5Config":
        """The tower a Gemma 3n `vision_config` record describes: timm's `architecture` (only
        "mobilenetv5_300m_enc") and its `model_args`, which may replace the encoder's `block_args` (as timm's
        `decode_arch_def` gives them), `stem_size`, `msfa_indices` and `msfa_output_resolution`; any other
        argument is refused by name. `hidden_size` must be timm's fixed 2048. The embedder's fields
        (`vocab_size`, `vocab_offset`, `rms_norm_eps`) belong to `Gemma3nEmbedderConfig`."""
        model_type = record.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"{where} has model_type {model_type!r}; Gemma 3n's vision tower is {MODEL_TYPE!r}")
        for name, value in record.items():
            if name not in _RECORD_FIELDS and name not in _INERT:
                raise ValueError(f"{where} field {name!r} = {value!r} is not a field of transformers' "
                                 "Gemma3nVisionConfig that Dew computes: remove it if the tower was trained without it")
        architecture = record.get("architecture", ARCHITECTURE)
        if architecture != ARCHITECTURE:
            raise ValueError(f"{where} architecture is {architecture!r}; Dew builds timm's {ARCHITECTURE!r} only")
        if record.get("hidden_size", HIDDEN_SIZE) != HIDDEN_SIZE:
            raise ValueError(f"{where} hidden_size is {record['hidden_size']}, but timm's {ARCHITECTURE} always "
                             f"outputs {HIDDEN_SIZE} channels: set hidden_size {HIDDEN_SIZE}")
        args = dict(record.get("model_args") or {})
        unknown = sorted(set(args) - {"block_args", "stem_size", "msfa_indices", "msfa_output_resolution"})
        if unknown:
            raise ValueError(f"{where} model_args {unknown} are timm arguments Dew's MobileNet-v5 does not build; it "
                             "reads block_args, stem_size, msfa_indices and msfa_output_resolution")
        fields = {}
        if "block_args" in args:
            fields["stages"] = tuple(tuple(Block.from_timm(block, f"{where} model_args block_args[{s}][{i}]").text()
                                           for i, block in enumerate(stage))
                                     for s, stage in enumerate(args.pop("block_args")))
        try:
            return cls(**fields, **args)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: {error}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` record of this tower (its embedder fields are `Gemma3nEmbedderConfig.to_hf`'s):
        `model_args` holds what differs from the published encoder. A record cannot say `image_size` (the
        processor's size) nor a `hidden_size` other than 2048, so a config with those is refused."""
        if self.hidden_size != HIDDEN_SIZE or self.num_channels != 3:
            raise ValueError(f"transformers' Gemma3nVisionConfig holds a {HIDDEN_SIZE}-wide tower over 3 channels; this "
                             f"one is {self.hidden_size} wide over {self.num_channels}")
        defaults, args = MobileNetV5Config(), {}
        if self.stages != defaults.stages:
            args["block_args"] = [[block.timm_args() for block in stage] for stage in self.blocks]
        for name in ("stem_size", "msfa_indices", "msfa_output_resolution"):
            if getattr(self, name) != getattr(defaults, name):
                args[name] = list(getattr(self, name)) if name == "msfa_indices" else getattr(self, name)
        return {"model_type": MODEL_TYPE, "architecture": ARCHITECTURE, "hidden_size": HIDDEN_SIZE,
                "do_pooling": False, "model_args": args or None}

    def geometry(self) -> TowerGeometry:
        """Images of `image_size` pixels a side; each of the R x R soft tokens covers `image_size / R` of them."""
        return TowerGeometry(self.image_size, self.image_size // self.msfa_output_resolution, self.num_channels)

    def example(self, dtype) -> dict:
        return self.geometry().example(dtype)

    def build(self, dtype=jnp.float32, param_dtype=jnp.float32) -> "MobileNetV5Tower":
        """The tower computing in `dtype` with parameters stored in `param_dtype`."""
        return MobileNetV5Tower(self, dtype, param_dtype)


_RECORD_FIELDS = frozenset({"model_type", "architecture", "hidden_size", "model_args"})
# Keys of a vision_config record that change nothing the tower computes: transformers' bookkeeping, the
# embedder's fields, timm's classifier labels (the encoder has no classifier) and `do_pooling`, which Gemma 3n
# overrides with False on every call.
_INERT = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "architectures", "dtype", "torch_dtype",
    "initializer_range", "vocab_size", "vocab_offset", "rms_norm_eps", "do_pooling", "num_classes", "label_names",
    "num_labels", "id2label", "label2id", "output_hidden_states", "output_attentions", "return_dict", "torchscript",
    "use_bfloat16", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "tie_word_embeddings",
    "pretrained_cfg", "_attn_implementation_autoset",
})


class Conv(TowerPart):
    """A convolution over NHWC features with a flax-layout kernel `[k, k, in / groups, out]`, TF-style SAME
    padding; a 1x1 unstrided one is a product `[N*H*W, in] @ [in, out]`."""

    features: int = 0
    kernel: int = 1
    stride: int = 1
    depthwise: bool = False
    bias: bool = False

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        C = x_NHWC.shape[-1]
        groups = C if self.depthwise else 1
        k = self.param("kernel", named(nn.initializers.lecun_normal(), (None, None, None, "embed")),
                       (self.kernel, self.kernel, C // groups, self.features), self.param_dtype).astype(self.dtype)
        x = x_NHWC.astype(self.dtype)
        if self.kernel == 1 and self.stride == 1 and groups == 1:
            N, H, W, _ = x.shape
            y = dot(x.reshape(N * H * W, C), k.reshape(C, self.features)).reshape(N, H, W, self.features)
        else:
            # "highest": float32 operands stay float32 on accelerators that would round them to TF32
            y = jax.lax.conv_general_dilated(x, k, (self.stride,) * 2, "SAME", feature_group_count=groups,
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest",
                                             preferred_element_type=jnp.float32)
        if self.bias:
            y = y + self.param("bias", named(nn.initializers.zeros_init(), ("embed",)), (self.features,),
                               self.param_dtype).astype(jnp.float32)
        return y.astype(self.dtype)


def _norm(part: TowerPart, name: str) -> RMSNorm:
    """timm's RmsNorm2d over the channels: `x / rms(x) * weight` in float32, rounded once."""
    return RMSNorm(EPS, "olmo", dtype=part.dtype, param_dtype=part.param_dtype, name=name)


class ConvNorm(TowerPart):
    """timm's ConvNormAct: `conv`, the norm `bn`, and GELU where `act`."""

    features: int = 0
    kernel: int = 1
    stride: int = 1
    depthwise: bool = False
    act: bool = True
    bias: bool = False

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        x = Conv(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype, features=self.features,
                 kernel=self.kernel, stride=self.stride, depthwise=self.depthwise, bias=self.bias, name="conv")(x_NHWC)
        x = _norm(self, "bn")(x)
        return _GELU(x.astype(jnp.float32)).astype(self.dtype) if self.act else x


class LayerScale(TowerPart):
    """A learned per-channel factor (`gamma`)."""

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        gamma = self.param("gamma", named(nn.initializers.constant(1e-5), ("embed",)), (x_NHWC.shape[-1],),
                           self.param_dtype)
        return (x_NHWC * gamma.astype(self.dtype)).astype(self.dtype)


class EdgeResidual(TowerPart):
    """A full expansion convolution (`conv_exp`, norm + GELU `bn1`) and a 1x1 projection (`conv_pwl`, norm `bn2`)."""

    block: Block = None
    out: int = 0

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        b, C = self.block, x_NHWC.shape[-1]
        parts = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
        h = Conv(**parts, features=divisible(C * b.expansion), kernel=b.kernel, stride=b.stride, name="conv_exp")(x_NHWC)
        h = _GELU(_norm(self, "bn1")(h).astype(jnp.float32)).astype(self.dtype)
        h = _norm(self, "bn2")(Conv(**parts, features=self.out, name="conv_pwl")(h))
        return h + x_NHWC if b.stride == 1 and C == self.out else h


class UniversalInvertedResidual(TowerPart):
    """`dw_start` (where `a` > 0), `pw_exp`, `dw_mid` (where `k` > 0), `pw_proj`, `layer_scale`; the stride sits
    on `dw_mid`, else on `dw_start`. The fusion adapter's `ffn` is one without a layer scale or a shortcut."""

    block: Block = None
    out: int = 0
    layer_scale: bool = True
    skip: bool = True

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        b, C = self.block, x_NHWC.shape[-1]
        parts = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
        h = x_NHWC
        if b.start:
            h = ConvNorm(**parts, features=C, kernel=b.start, stride=1 if b.kernel else b.stride, depthwise=True,
                         act=False, name="dw_start")(h)
        mid = divisible(C * b.expansion)
        h = ConvNorm(**parts, features=mid, name="pw_exp")(h)
        if b.kernel:
            h = ConvNorm(**parts, features=mid, kernel=b.kernel, stride=b.stride, depthwise=True, name="dw_mid")(h)
        h = ConvNorm(**parts, features=self.out, act=False, name="pw_proj")(h)
        if self.layer_scale:
            h = LayerScale(**parts, name="layer_scale")(h)
        return h + x_NHWC if self.skip and b.stride == 1 and C == self.out else h


class MultiQueryAttention(TowerPart):
    """`heads` query heads over one key and one value head, whose inputs are first shrunk (a depthwise
    convolution of stride `kv_stride` and a norm) where `kv_stride > 1`; 1x1 projections (`query/proj`,
    `key/proj`, `value/proj`, `output/proj`), scores scaled by `key_dim ** -0.5`."""

    block: Block = None
    out: int = 0

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        b = self.block
        N, H, W, C = x_NHWC.shape
        parts = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)

        def shared(name: str) -> jax.Array:  # the one key (or value) head: [N, 1, h*w, d]
            y = x_NHWC
            if b.kv_stride > 1:
                y = Conv(**parts, features=C, kernel=b.kernel, stride=b.kv_stride, depthwise=True,
                         name=f"{name}_down_conv")(y)
                y = _norm(self, f"{name}_norm")(y)
            return Conv(**parts, features=b.key_dim, name=f"{name}_proj")(y).reshape(N, 1, -1, b.key_dim)

        q_NPHD = Conv(**parts, features=b.heads * b.key_dim, name="query_proj")(x_NHWC)
        q_NPHD = q_NPHD.reshape(N, H * W, b.heads, b.key_dim)  # channel = head * key_dim + d, as timm splits it
        k_N1TD, v_N1TD = shared("key"), shared("value")
        everything_NPT = jnp.ones((N, H * W, k_N1TD.shape[2]), bool)
        o_NPHD = attend(q_NPHD, k_N1TD, v_N1TD, everything_NPT).astype(self.dtype)
        return Conv(**parts, features=self.out, name="output_proj")(o_NPHD.reshape(N, H, W, b.heads * b.key_dim))


class MobileAttention(TowerPart):
    """A norm, multi-query attention (`attn`) and a layer scale, added to the input where the width is kept."""

    block: Block = None
    out: int = 0

    @nn.compact
    def __call__(self, x_NHWC: jax.Array) -> jax.Array:
        parts = dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype)
        h = MultiQueryAttention(**parts, block=self.block, out=self.out, name="attn")(_norm(self, "norm")(x_NHWC))
        h = LayerScale(**parts, name="layer_scale")(h)
        return h + x_NHWC if x_NHWC.shape[-1] == self.out else h


_BLOCKS = {"er": EdgeResidual, "uir": UniversalInvertedResidual, "mqa": MobileAttention}


class FusionAdapter(TowerPart):
    """timm's MobileNetV5MultiScaleFusionAdapter: the picked features at the finest grid, one channel stack,
    a 1x1 inverted bottleneck to `hidden_size` (`ffn`), an average pool to R x R and a norm (`norm`)."""

    @nn.compact
    def __call__(self, features: list[jax.Array]) -> jax.Array:
        c = self.config
        N, H, W, _ = features[0].shape
        resized = []
        for x in features:  # nearest neighbour: each coarse position repeated over the finer ones it covers
            rows, cols = x.shape[1], x.shape[2]
            resized.append(jnp.repeat(jnp.repeat(x, H // rows, axis=1), W // cols, axis=2))
        x = jnp.concatenate(resized, axis=-1)
        ffn = Block("uir", c.hidden_size, 1, 2.0)
        x = UniversalInvertedResidual(c, self.dtype, self.param_dtype, ffn, c.hidden_size, layer_scale=False,
                                      skip=False, name="ffn")(x)
        R = c.msfa_output_resolution
        if H != R:
            x = x.astype(jnp.float32).reshape(N, R, H // R, R, W // R, c.hidden_size).mean(axis=(2, 4))
        return _norm(self, "norm")(x)


class MobileNetV5Tower(TowerPart):
    """Pixels `[N, C, H, W]` (H = W = image_size, channels first as transformers' processor gives them) to soft
    tokens `[N, R*R, hidden_size]` in `dtype`, R = msfa_output_resolution, in row-major grid order."""

    @nn.compact
    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        c = self.config
        c.geometry().check(pixel_values, "MobileNet-v5", "images",
                           f"resize the images to {c.image_size} pixels a side (the processor's size)")
        parts = dict(config=c, dtype=self.dtype, param_dtype=self.param_dtype)
        channels = c.channels()
        x = ConvNorm(**parts, features=channels[0], kernel=3, stride=2, bias=True,
                     name="conv_stem")(jnp.transpose(pixel_values, (0, 2, 3, 1)))
        features = [x]
        for s, stage in enumerate(c.blocks):
            for i, block in enumerate(stage):
                x = _BLOCKS[block.kind](**parts, block=block, out=divisible(block.channels), name=f"blocks_{s}_{i}")(x)
            features.append(x)
        x = FusionAdapter(**parts, name="msfa")([features[index] for index in c.fusion_features])
        N = x.shape[0]
        return x.reshape(N, -1, c.hidden_size).astype(self.dtype)
