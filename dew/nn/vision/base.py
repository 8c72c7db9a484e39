"""What every tower and projector config shares: the images a tower takes (`TowerGeometry`, for the processor
that prepares them and the projector after it) and the check of their sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import jax.numpy as jnp
from flax import linen as nn

from dew.nn.linear import Linear, named


def require_positive_ints(config, fields: tuple[str, ...]) -> None:
    """Refuse a config whose `fields` are not each a positive integer (a bool is not one), naming the field."""
    for field in fields:
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} is {value!r}; it must be a positive integer")


@dataclasses.dataclass(frozen=True)
class TowerGeometry:
    """Square images of `image_size` pixels a side and `channels` channels, cut into square patches of
    `patch_size` pixels a side (a remainder under one patch is dropped, as a VALID convolution does)."""

    image_size: int
    patch_size: int
    channels: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patches(self) -> int:
        """The tower's output positions per image, `P = patches_per_side ** 2`."""
        return self.patches_per_side**2

    def example(self, dtype) -> dict:
        """The smallest input of a model over these images (one row of one image), which `init` builds the
        parameters from."""
        return {"pixel_values": jnp.zeros((1, 1, self.channels, self.image_size, self.image_size), dtype)}

    def check(self, pixel_values, tower: str, unit: str, fix: str) -> None:
        """Refuse pixels other than `[N, channels, image_size, image_size]`, naming the `tower`, what one of the
        N is (`unit`: images, tiles) and the `fix`."""
        expected = (self.channels, self.image_size, self.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values have shape {tuple(pixel_values.shape)}; this {tower} tower reads "
                             f"[{unit}, {', '.join(map(str, expected))}]: {fix} and put channels first")


def layer_norm(eps: float, param_dtype, name: str) -> nn.LayerNorm:
    """torch's LayerNorm: a two-pass variance and the affine map in float32 (the caller rounds once)."""
    return nn.LayerNorm(eps, dtype=jnp.float32, param_dtype=param_dtype, use_fast_variance=False,
                        scale_init=named(nn.initializers.ones_init(), ("norm",)),
                        bias_init=named(nn.initializers.zeros_init(), ("norm",)), name=name)


class TowerPart(nn.Module):
    """A module of a tower: its config, the dtype it computes in and the dtype of its parameters."""

    config: Any
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def linear(self, features: int, names: tuple[str, str], name: str) -> Linear:
        """A biased linear map to `features`, called from a compact method."""
        return Linear(features, use_bias=True, dtype=self.dtype, param_dtype=self.param_dtype, names=names, name=name)


def read_axial_record(cls, record: Mapping[str, Any], where: str, model_types: tuple[str, ...], reference: str,
                      inert: Collection[str], default_theta: float):
    """The tower config `cls` (whose `rope_theta` field is the record's `rope_parameters["rope_theta"]`, an "axial"
    rotary) that a `vision_config` record describes, transformers' defaults for absent fields. Another model
    type, another rotary or a field that is neither one of `cls`'s nor `inert` is refused by name (`where` names
    the record, `reference` transformers' class)."""
    model_type = record.get("model_type", model_types[0])
    if model_type not in model_types:
        raise ValueError(f"{where} has model_type {model_type!r}; this tower is transformers' one of {list(model_types)}")
    fields = {field.name for field in dataclasses.fields(cls)} - {"rope_theta"}
    for name, value in record.items():
        if name not in fields | {"rope_parameters"} and name not in inert:
            raise ValueError(f"{where} field {name!r} = {value!r} is not a field of transformers' {reference} that Dew "
                             "computes: remove it if the tower was trained without it")
    rope = dict(record.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
        raise ValueError(f"{where} rope_parameters {rope}: this tower turns by an axial rotary with a rope_theta and "
                         "nothing else")
    try:
        return cls(**{name: record[name] for name in fields if name in record},
                   rope_theta=float(rope.get("rope_theta", default_theta)))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def axial_record(config, model_type: str) -> dict[str, Any]:
    """The `vision_config` record of a tower config read by `read_axial_record`, for a config.json."""
    record = {name: value for name, value in dataclasses.asdict(config).items() if name != "rope_theta"}
    return {"model_type": model_type, **record, "rope_parameters": {"rope_type": "axial", "rope_theta": config.rope_theta}}
