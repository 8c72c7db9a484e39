"""`MultimodalTransformer`: the text decoder with a vision tower and projector in front of it.

Its variables are `language_model` (a `CausalTransformer`'s, in its own form), `tower` and
`projector` (registered by name in `dew.nn.vision`). A call encodes `pixel_values` `[B, images, C, H, W]`
(the processor's layout, padded to the row with the most images), projects each image to its soft
tokens, and the decoder takes those in place of the placeholder embeddings `image_indices` point at,
with an image's tokens reading each other in both directions (`image_groups`) where the model was trained
so (Gemma 3; Llama 4's read causally). A tiled model (Llama 4) takes each tile as one of the "images" of
this layout: `pixel_values [B, tiles, C, H, W]`, `tokens_per_image` soft tokens a tile. Qwen 3.5's tower
reads images of many sizes: `pixel_values [B, images, patches, C*T*p*p]` (each image's patch vectors, padded
to the call's largest) beside `image_grid_thw [B, images, 3]`, and `patches / merge**2` soft tokens an image
(its padding's unread); its decoder reads three-axis `rotary_positions`. Gemma 3n (`hard_ids`) also embeds
token ids through its embedders: ids in the vision projector's hard range, and in the audio embedder's
(`audio_embedder`, variables `audio_projector`), take that embedder's `embed` in place of the decoder's
embedding, at every call (a decode step's too); a placeholder with pixels behind it takes its soft token.
Media are encoded at
prefill only: a decode step passes no `pixel_values` and reads the cache, which remembers each slot's
image. Without media the call is the text decoder's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import linen as nn

from dew.data.inputs import MEDIA_CONDITIONING, MEDIA_FIELDS, TEXT_FIELDS, ModelInputs
from dew.nn.kv_cache import Cache
from dew.nn.transformer import CausalTransformer, DecoderConfig, ModelVariables

LANGUAGE_MODEL = "language_model"


@dataclasses.dataclass(frozen=True)
class MultimodalConfig:
    """A decoder `text` with a vision tower and projector: `tower` and `projector` are their configs
    (`dew.nn.vision`), registered as `tower_kind` and `projector_kind`; `image_token_id` is the id of
    an image's soft-token placeholders and `tokens_per_image` how many each image (or tile) fills (None where
    each image's patch grid decides, Qwen 3.5's). With
    `bidirectional_images` an image's soft tokens read each other in both directions (Gemma 3); without,
    they read causally as text does (Llama 4). With `hard_ids` (Gemma 3n) the ids of the projector's hard range
and of `audio_embedder`'s embed through them (see the module). The text knobs (`vocab_size`, `max_seq_len`, `dtype`, ...)
    read through from `text`."""

    text: DecoderConfig
    tower_kind: str
    tower: Any
    projector_kind: str
    projector: Any
    image_token_id: int
    tokens_per_image: int | None
    bidirectional_images: bool = True
    hard_ids: bool = False
    audio_embedder: Any = None

    def __getattr__(self, name: str):
        # only reached for names the dataclass lacks: the decoder's knobs
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.text, name)

    def replace_text(self, **changes) -> "MultimodalConfig":
        """This config with the decoder's fields `changes` replaced (dtypes, kernels, max_seq_len, ...)."""
        return dataclasses.replace(self, text=dataclasses.replace(self.text, **changes))


class MultimodalTransformer(ModelVariables, nn.Module):
    """Images in, text out: see the module. Call with token ids `[B, S]` (or a `ModelInputs`) and
    the token fields and conditioning of `dew.data.inputs` (`image_indices`, `image_groups`,
    `pixel_values`) beside the decoder's own (`attention_mask`, `positions`, `cache`, `head`, ...)."""

    config: MultimodalConfig

    def setup(self):
        c = self.config
        self.language_model = CausalTransformer(c.text)
        self.tower = c.tower.build(c.text.dtype, c.text.param_dtype)
        self.projector = c.projector.build(c.text.dtype, c.text.param_dtype)
        if c.audio_embedder is not None:
            self.audio_projector = c.audio_embedder.build(c.text.dtype, c.text.param_dtype)

    def __call__(self, tokens, *, image_indices=None, image_groups=None, pixel_values=None, image_grid_thw=None,
                 **kwargs):
        if isinstance(tokens, ModelInputs):
            return self(tokens.tokens, **tokens.kwargs(), **kwargs)
        unknown = sorted(set(kwargs) - set(TEXT_FIELDS) - _DECODER_KEYWORDS)
        if unknown:
            raise ValueError(f"MultimodalTransformer has no place for {unknown}: it reads the token fields "
                             f"{list(TEXT_FIELDS + MEDIA_FIELDS)} and the conditioning {list(MEDIA_CONDITIONING)}")
        if pixel_values is None and self.is_initializing():  # the media's parameters, from the smallest input
            self.encode(**self.config.tower.example(self.config.text.dtype))
        if pixel_values is not None:
            if image_indices is None or image_groups is None:
                raise ValueError("pixel_values need image_indices and image_groups beside them (the processor "
                                 "writes all three): which slot reads which soft token, and which image it is")
            kwargs.update(features=self.encode(pixel_values, image_grid_thw), feature_indices=image_indices)
            if self.config.bidirectional_images:
                kwargs["image_groups"] = image_groups
        if self.config.hard_ids:
            kwargs["features"], kwargs["feature_indices"] = self._hard_embedded(
                tokens, kwargs.get("features"), kwargs.get("feature_indices"))
        return self.language_model(tokens, **kwargs)

    def _hard_embedded(self, tokens, features, indices):
        """(features, feature_indices) with each slot whose id lies in an embedder's hard range reading that
        embedder's `embed` of it, appended after the soft `features` (where given); a slot `indices` already
        points at a soft token keeps it."""
        c = self.config
        B, S = tokens.shape
        embedders = [(self.projector, c.projector)]
        if c.audio_embedder is not None:
            embedders.append((self.audio_projector, c.audio_embedder))
            if self.is_initializing():  # the audio embedder's soft path, which no input here reaches yet
                self.audio_projector(jnp.zeros((1, 1, c.audio_embedder.hidden_size), c.text.dtype))
        hard_BSE, is_hard_BS = None, jnp.zeros((B, S), bool)
        for embedder, config in embedders:
            first, last = config.vocab_offset, config.vocab_offset + config.vocab_size - 1
            inside_BS = (tokens >= first) & (tokens <= last)
            embedded_BSE = embedder.embed(jnp.clip(tokens, first, last))
            hard_BSE = embedded_BSE if hard_BSE is None else jnp.where(inside_BS[..., None], embedded_BSE, hard_BSE)
            is_hard_BS = is_hard_BS | inside_BS
        start = 0 if features is None else features.shape[1]
        hard_BS = jnp.where(is_hard_BS, start + jnp.arange(S, dtype=jnp.int32), -1)
        if features is None:
            return hard_BSE.astype(c.text.dtype), hard_BS
        return (jnp.concatenate([features, hard_BSE.astype(features.dtype)], axis=1),
                jnp.where(indices >= 0, indices, hard_BS))

    def encode(self, pixel_values, image_grid_thw=None):
        """Each row's images as soft tokens `[B, images * tokens_per_image, E]` in the compute dtype (a
        tower reading grids gives `patches / merge**2` tokens an image, padding included)."""
        B, images = pixel_values.shape[:2]
        flat = pixel_values.reshape(B * images, *pixel_values.shape[2:]).astype(self.config.text.dtype)
        reads_grids = getattr(self.config.tower, "reads_grids", False)
        if reads_grids and image_grid_thw is None:
            raise ValueError(f"the {self.config.tower_kind} tower reads each image's patch grid: pass image_grid_thw "
                             "beside pixel_values, as the processor writes it")
        if not reads_grids and image_grid_thw is not None:
            raise ValueError(f"the {self.config.tower_kind} tower reads images of one size and no image_grid_thw: "
                             "leave it out")
        tower_NPE = self.tower(flat) if image_grid_thw is None else self.tower(flat, image_grid_thw.reshape(-1, 3))
        soft_NTE = self.projector(tower_NPE)
        return soft_NTE.reshape(B, images * soft_NTE.shape[1], soft_NTE.shape[2]).astype(self.config.text.dtype)

    # ---- the decoder's helpers, over the language model's part of the tree ------------------

    @nn.nowrap
    def _decoder(self) -> CausalTransformer:
        return CausalTransformer(self.config.text)

    @nn.nowrap
    def stack_variables(self, variables):
        """The decoder's part of `variables` in its own form (`CausalTransformer.stack_variables`)."""
        return _on_language_model(variables, self._decoder().stack_variables)

    @nn.nowrap
    def unstack_variables(self, variables):
        """The decoder's part of `variables` per layer (`layers_N`), for exports."""
        return _on_language_model(variables, self._decoder().unstack_variables)

    @nn.nowrap
    def init_cache(self, rows: int, capacity: int) -> Cache:
        """The decoder's empty cache, which also remembers the image behind each slot where images read
        themselves in both directions."""
        cache = self._decoder().init_cache(rows, capacity)
        if not self.config.bidirectional_images:
            return cache
        return cache.replace(groups=jnp.full((rows, capacity), -1, jnp.int32))


# The decoder's keywords a multimodal call passes through.
_DECODER_KEYWORDS = {"cache", "head", "layers", "routes", "depths", "indexer", "qk_stats"}


def _on_language_model(variables, convert):
    """`variables` with `convert` applied to each collection's `language_model` subtree together."""
    if not isinstance(variables, dict):
        return variables
    inner = {name: tree[LANGUAGE_MODEL] for name, tree in variables.items()
             if isinstance(tree, dict) and LANGUAGE_MODEL in tree}
    if not inner:
        return variables
    converted = convert(inner)
    return {name: ({**tree, LANGUAGE_MODEL: converted[name]} if name in converted else tree)
            for name, tree in variables.items()}


__all__ = ["LANGUAGE_MODEL", "MultimodalConfig", "MultimodalTransformer"]
