"""Published checkpoints: `load_pretrained` reads a transformers decoder into a native Dew model,
`Pretrained.save` writes it back under the source tensor names, and `save_pretrained` writes any model
a family computes (one trained from scratch included) as a transformers checkpoint."""

from dew.interop.export import save_pretrained
from dew.interop.pretrained import Pretrained, generation_defaults, load_pretrained

__all__ = ["Pretrained", "generation_defaults", "load_pretrained", "save_pretrained"]
