"""The model registry: `build(name, **kwargs)` makes a registered model, `register(name)` adds one."""

from __future__ import annotations

from collections.abc import Callable

from flax import linen as nn

from dew.nn.diffusion_gemma import DiffusionGemma, DiffusionGemmaConfig
from dew.nn.transformer import CausalTransformer, DecoderConfig

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register(name: str):
    """Decorate a builder `(**kwargs) -> flax Module` to make it `build(name, ...)`-able."""

    def add(builder):
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = builder
        return builder

    return add


def build(name: str, **kwargs) -> nn.Module:
    """Build the registered model `name` with its keyword configuration."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered models are {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def names() -> list[str]:
    return sorted(_REGISTRY)


@register("causal_transformer")
def causal_transformer(**kwargs) -> CausalTransformer:
    """`CausalTransformer(DecoderConfig(**kwargs))`; an unknown keyword is refused by name."""
    try:
        config = DecoderConfig(**kwargs)
    except TypeError as error:
        fields = sorted(DecoderConfig.__dataclass_fields__)
        raise TypeError(f"causal_transformer: {error}; its keywords are {fields}") from None
    return CausalTransformer(config)


@register("diffusion_gemma")
def diffusion_gemma(**kwargs) -> DiffusionGemma:
    """`DiffusionGemma` from its config's fields, as given or as a run's record holds them
    (`DiffusionGemmaConfig.from_json`)."""
    return DiffusionGemma(DiffusionGemmaConfig.from_json(kwargs))
