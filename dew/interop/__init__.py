"""Published checkpoints: `load_pretrained` reads a transformers decoder into a native Dew model,
`Pretrained.save` writes it back under the source tensor names."""

from dew.interop.pretrained import Pretrained, generation_defaults, load_pretrained

__all__ = ["Pretrained", "generation_defaults", "load_pretrained"]
