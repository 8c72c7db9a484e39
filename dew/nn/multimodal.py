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
(its padding's unread); its decoder reads three-axis `rotary_positions`. Gemma 4's tower reads padded patch
streams `pixel_values [B, images, X, 3*p*p]` beside each patch's (column, row) `image_position_ids [B, images,
X, 2]` ((-1, -1) for padding) and gives `X / k**2` soft tokens an image, its real ones first.

A model with an audio tower (`MultimodalConfig.audio`: Gemma 4's) also reads clips of log-mel frames
`input_features [B, clips, frames, mel]` with `input_features_mask` (true at real frames) and `audio_lengths
[B]` (the clips a row holds; later ones are padding); each clip's encoded frames, projected to the text width,
fill the slots `audio_indices` point at (`clip * encoded_frames + k` for its k-th real frame). Ids in
`pad_ids` (Gemma 4's image, video and audio placeholders) are read as id 0, the pad id, before embedding, as
the reference does: a video placeholder keeps the pad embedding. Gemma 3n (`hard_ids`) embeds token ids through
its embedders as well: ids in the vision projector's hard range, and in the audio projector's, take that
embedder's `embed` in place of the decoder's embedding, at every call (a decode step's too); a placeholder with
media behind it takes its soft token. Media are encoded at
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
class AudioPart:
    """An audio tower (`dew.nn.audio`, registered as `tower_kind`) and the projector of its encoded frames to the
    text width (`dew.nn.vision`'s `projector_kind`); `token_id` is the id of a clip's soft-token placeholders. A clip
    fills one placeholder per encoded frame, or with `tokens_per_clip` (Gemma 3n's) that many, its padding frames
    and the slots past its frames reading the projector's `embed` of `padding_id`."""

    tower_kind: str
    tower: Any
    projector_kind: str
    projector: Any
    token_id: int
    tokens_per_clip: int | None = None
    padding_id: int | None = None


@dataclasses.dataclass(frozen=True)
class MultimodalConfig:
    """A decoder `text` with a vision tower and projector: `tower` and `projector` are their configs
    (`dew.nn.vision`), registered as `tower_kind` and `projector_kind`; `image_token_id` is the id of
    an image's soft-token placeholders and `tokens_per_image` how many each image (or tile) fills (None where
    each image's patch grid decides, Qwen 3.5's). With
    `bidirectional_images` an image's soft tokens read each other in both directions (Gemma 3); without,
    they read causally as text does (Llama 4). `audio` adds an audio tower (see the module), and the ids in
    `pad_ids` are read as id 0; with `hard_ids` (Gemma 3n) the ids of the projectors' hard ranges embed
    through them (see the module). The text knobs (`vocab_size`, `max_seq_len`, `dtype`, ...) read through from
    `text`."""

    text: DecoderConfig
    tower_kind: str
    tower: Any
    projector_kind: str
    projector: Any
    image_token_id: int
    tokens_per_image: int | None
    bidirectional_images: bool = True
    audio: AudioPart | None = None
    pad_ids: tuple[int, ...] = ()
    hard_ids: bool = False

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
        if c.audio is not None:
            self.audio_tower = c.audio.tower.build(c.text.dtype, c.text.param_dtype)
            self.audio_projector = c.audio.projector.build(c.text.dtype, c.text.param_dtype)

    def __call__(self, tokens, *, image_indices=None, image_groups=None, pixel_values=None, image_grid_thw=None,
                 image_position_ids=None, audio_indices=None, input_features=None, input_features_mask=None,
                 audio_lengths=None, **kwargs):
        if isinstance(tokens, ModelInputs):
            return self(tokens.tokens, **tokens.kwargs(), **kwargs)
        c = self.config
        unknown = sorted(set(kwargs) - set(TEXT_FIELDS) - _DECODER_KEYWORDS)
        if unknown:
            raise ValueError(f"MultimodalTransformer has no place for {unknown}: it reads the token fields "
                             f"{list(TEXT_FIELDS + MEDIA_FIELDS)} and the conditioning {list(MEDIA_CONDITIONING)}")
        if self.is_initializing():  # the media's parameters, from the smallest inputs
            if pixel_values is None:
                self.encode(**c.tower.example(c.text.dtype))
            if c.audio is not None and input_features is None:
                self.encode_audio(*_smallest_clip(c.audio.tower, c.text.dtype))
        features, indices = [], None
        if pixel_values is not None:
            if image_indices is None or image_groups is None:
                raise ValueError("pixel_values need image_indices and image_groups beside them (the processor "
                                 "writes all three): which slot reads which soft token, and which image it is")
            features.append(self.encode(pixel_values, image_grid_thw, image_position_ids))
            indices = image_indices
        if input_features is not None:
            if c.audio is None:
                raise ValueError("input_features are audio clips, and this model has no audio tower: leave them out")
            if audio_indices is None or input_features_mask is None or audio_lengths is None:
                raise ValueError("input_features need input_features_mask, audio_lengths and audio_indices beside "
                                 "them (the processor writes all four)")
            # a clip's features follow the images'; its slots read them past those
            offset = features[0].shape[1] if features else 0
            features.append(self.encode_audio(input_features, input_features_mask, audio_lengths))
            shifted = jnp.where(audio_indices >= 0, audio_indices + offset, -1)
            indices = shifted if indices is None else jnp.where(audio_indices >= 0, shifted, indices)
        if features:
            kwargs.update(features=jnp.concatenate(features, axis=1), feature_indices=indices)
        if image_groups is not None and c.bidirectional_images:
            kwargs["image_groups"] = image_groups
        if c.hard_ids:
            kwargs["features"], kwargs["feature_indices"] = self._hard_embedded(
                tokens, kwargs.get("features"), kwargs.get("feature_indices"))
        if c.pad_ids:
            tokens = jnp.where(jnp.isin(tokens, jnp.asarray(c.pad_ids, tokens.dtype)), 0, tokens)
        return self.language_model(tokens, **kwargs)

    def _hard_embedded(self, tokens, features, indices):
        """(features, feature_indices) with each slot whose id lies in an embedder's hard range reading that
        embedder's `embed` of it, appended after the soft `features` (where given); a slot `indices` already
        points at a soft token keeps it."""
        c = self.config
        B, S = tokens.shape
        embedders = [(self.projector, c.projector)]
        if c.audio is not None:
            embedders.append((self.audio_projector, c.audio.projector))
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

    def encode(self, pixel_values, image_grid_thw=None, image_position_ids=None):
        """Each row's images as soft tokens `[B, images * tokens_per_image, E]` in the compute dtype (a
        tower reading grids gives `patches / merge**2` tokens an image, padding included, one reading patch
        positions `patches / k**2`)."""
        c = self.config
        B, images = pixel_values.shape[:2]
        flat = pixel_values.reshape(B * images, *pixel_values.shape[2:]).astype(c.text.dtype)
        for field, given, reads in (("image_grid_thw", image_grid_thw, getattr(c.tower, "reads_grids", False)),
                                    ("image_position_ids", image_position_ids,
                                     getattr(c.tower, "reads_positions", False))):
            if reads and given is None:
                raise ValueError(f"the {c.tower_kind} tower reads {field} beside pixel_values: pass it as the "
                                 "processor writes it")
            if given is not None and not reads:
                raise ValueError(f"the {c.tower_kind} tower reads no {field}: leave it out")
        if image_grid_thw is not None:
            tower_NPE = self.tower(flat, image_grid_thw.reshape(-1, 3))
        elif image_position_ids is not None:
            tower_NPE = self.tower(flat, image_position_ids.reshape(B * images, -1, 2))
        else:
            tower_NPE = self.tower(flat)
        soft_NTE = self.projector(tower_NPE)
        return soft_NTE.reshape(B, images * soft_NTE.shape[1], soft_NTE.shape[2]).astype(c.text.dtype)

    def encode_audio(self, input_features, input_features_mask, audio_lengths):
        """Each row's clips as soft tokens `[B, clips * encoded_frames, E]` in the compute dtype, a clip at or past
        its row's `audio_lengths` read as all padding."""
        c = self.config
        B, clips, T, F = input_features.shape
        real_BC = jnp.arange(clips)[None, :] < audio_lengths[:, None]
        mask_NT = (input_features_mask & real_BC[:, :, None]).reshape(B * clips, T)
        encoded = self.audio_tower(input_features.reshape(B * clips, T, F).astype(c.text.dtype), mask_NT)
        soft_NTE = self.audio_projector(encoded.features)
        if c.audio.tokens_per_clip is not None:
            soft_NTE = self._fixed_slots(soft_NTE, encoded.mask)
        return soft_NTE.reshape(B, clips * soft_NTE.shape[1], soft_NTE.shape[2]).astype(c.text.dtype)

    def _fixed_slots(self, soft_NTE, mask_NT):
        """Each clip's soft tokens in `tokens_per_clip` slots: padding frames, and the slots past the clip's frames,
        read the projector's embedding of `padding_id` (frames past the slots are padding: the processor refuses a
        clip whose real frames overflow them)."""
        part = self.config.audio
        K = part.tokens_per_clip
        padding_E = self.audio_projector.embed(jnp.full((1,), part.padding_id, jnp.int32))[0].astype(soft_NTE.dtype)
        soft_NTE = jnp.where(mask_NT[..., None], soft_NTE, padding_E)[:, :K]
        missing = K - soft_NTE.shape[1]
        if missing:
            fill = jnp.broadcast_to(padding_E, (soft_NTE.shape[0], missing, soft_NTE.shape[2]))
            soft_NTE = jnp.concatenate([soft_NTE, fill], axis=1)
        return soft_NTE

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


def _smallest_clip(tower, dtype):
    """One row of one clip long enough for every subsampling step, its mask and its count, which `init` builds an
    audio tower's parameters from."""
    frames = 4 * tower.frame_stride
    return (jnp.zeros((1, 1, frames, tower.mel_features or 128), dtype), jnp.ones((1, 1, frames), bool),
            jnp.ones((1,), jnp.int32))


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


__all__ = ["LANGUAGE_MODEL", "AudioPart", "MultimodalConfig", "MultimodalTransformer"]
