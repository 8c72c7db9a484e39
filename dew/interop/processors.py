"""`Processor`: a multimodal checkpoint's own processor, its outputs laid out row by row as `ModelInputs`.

The checkpoint's processor (transformers' class for it, built from the checkpoint's files; never
downloaded) resizes and normalizes images and expands each image placeholder into its soft tokens.
`Processor` runs it one row at a time, pads the rows on the host (the tokenizer's side and pad id),
and writes what the model reads:

- `tokens [B, S]`; `attention_mask` only when some slot is padding (an all-true mask would keep
  attention from running fused); `positions`, each real token's index among its row's real tokens;
- `image_indices [B, S]`: the soft feature a slot reads, `entry * tokens_per_image + k` for the k-th
  soft token of the row's pixel entry, -1 for text; `image_groups [B, S]`: the image behind each slot,
  -1 for text;
- conditioning `pixel_values [B, entries, C, H, W]`, zero-padded to the row with the most entries.

A pixel entry is an image (Gemma 3), or one tile of an image (Llama 4, whose processor gives each image
as its local tiles and a global tile, `[tiles, C, H, W]`); each fills one run of placeholders. Qwen 3.5's
processor gives images of many sizes as patch vectors with a grid each (`image_grid_thw`): its entries are
laid out `pixel_values [B, images, X, C*T*p*p]`, each image's patches padded to the call's most `X`, beside
`image_grid_thw [B, images, 3]` (a padding image's grid is zeros); an image fills `t * h * w / merge**2`
slots and `image_indices` count `X / merge**2` features an image; and the token field `rotary_positions
[B, S, 3]` holds the three-axis positions its decoder reads (`dew.data.rotary_positions`). Pixels the
processor normalized in bfloat16 (Llama 4's, as its original implementation does) are widened to
float32, which is exact. Gemma 4's processor gives each image as a padded patch stream `[X, 3*p*p]` with each
patch's (column, row) `[X, 2]` ((-1, -1) for padding): its entries are laid out `pixel_values [B, images, X,
3*p*p]` beside `image_position_ids [B, images, X, 2]`, an image fills its real patches over `k**2` slots and
`image_indices` count `X / k**2` features an image; its `image_groups` number each run of image (or video)
placeholders, as the processor's `mm_token_type_ids` mark them.

Audio (a model with an audio tower, Gemma 4's or Gemma 3n's): `audio=[waveform, ...]`, 16 kHz mono float arrays, one per audio
placeholder in reading order over the whole batch. The checkpoint's feature extractor turns each row's clips
into log-mel frames, laid out `input_features [B, clips, frames, mel]` (zero-padded to the call's longest clip
and the row with most clips) with `input_features_mask [B, clips, frames]` (true at real frames) and
`audio_lengths [B]` (the clips of each row); `audio_indices [B, S]` is `clip * encoded + k` at the k-th
placeholder of a clip (`encoded` the tower's frames for the padded length), -1 elsewhere. A model whose clips fill a
fixed number of slots (Gemma 3n's `AudioPart.tokens_per_clip`) reads `clip * tokens_per_clip + k` there, and a clip
too long for its slots is refused.

It checks on the host what the compiled model never checks: token ids inside the vocabulary, each
row's placeholder runs against its pixel entries and `tokens_per_image`, and the images' shapes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.inputs import ModelInputs
from dew.data.rotary_positions import three_axis_positions

# What a transformers processor returns that Dew lays out; anything else is refused by name.
_KNOWN_OUTPUTS = {"input_ids", "attention_mask", "pixel_values", "token_type_ids", "mm_token_type_ids",
                  "aspect_ratios", "image_grid_thw", "image_position_ids", "input_features", "input_features_mask"}
_VISION_TYPES = (1, 2)  # mm_token_type_ids of image and video placeholders (3: audio)


def load_reference(directory: Path):
    """The checkpoint's own transformers processor, built from its files (offline, PIL image backend)."""
    try:
        from transformers import AutoProcessor
    except ImportError as error:  # transformers is an optional extra
        raise ImportError(f"the processor of {directory} is transformers' own class, and transformers is not "
                          f"installed ({error}): pip install 'dew-ml[vision]'") from None
    try:
        return AutoProcessor.from_pretrained(str(directory), local_files_only=True, backend="pil")
    except (OSError, ValueError, ImportError) as error:
        # Gemma 4's and Qwen 3.5's video processors are torchvision classes: their processors are built without
        if "video" in str(error) and (Path(directory) / "processor_config.json").is_file():
            return _without_videos(Path(directory))
        # Llama 4's image processor, for one, exists only as a torchvision class
        if not isinstance(error, ValueError) or "torchvision" not in str(error):
            raise
        raise ImportError(f"the image processor of {directory} is a torchvision class in transformers, and "
                          "torchvision does not import here: install the torchvision build that matches your "
                          "torch (for a CPU torch, from PyTorch's CPU wheel index)") from error


def _without_videos(directory: Path):
    """The checkpoint's transformers processor class (processor_config.json's `processor_class`) over its other
    parts (tokenizer, PIL image processor, audio feature extractor) and no video processor, which transformers has
    only as a torchvision class: `videos=` is refused (`Processor`), everything else is the class's own."""
    import transformers

    record = json.loads((directory / "processor_config.json").read_text())
    reference_class = getattr(transformers, str(record.get("processor_class")), None)
    if reference_class is None or "video_processor" not in reference_class.get_attributes():
        raise ImportError(f"the processor of {directory} ({record.get('processor_class')}) needs a video processor, a "
                          "torchvision class in transformers: install the torchvision build that matches your torch")

    class WithoutVideos(reference_class):
        def check_argument_for_proper_class(self, name, argument):
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    WithoutVideos.__name__ = WithoutVideos.__qualname__ = reference_class.__name__
    where = {"local_files_only": True}
    parts = {"tokenizer": transformers.AutoTokenizer.from_pretrained(str(directory), **where),
             "image_processor": transformers.AutoImageProcessor.from_pretrained(str(directory), backend="pil", **where)}
    if "feature_extractor" in reference_class.get_attributes():
        parts["feature_extractor"] = transformers.AutoFeatureExtractor.from_pretrained(str(directory), **where)
    options = {name: value for name, value in record.items()
               if name not in {"processor_class", *reference_class.get_attributes()}}
    return WithoutVideos(**parts, video_processor=None, **options)


@dataclasses.dataclass(frozen=True)
class Processor:
    """Text, images and audio to `ModelInputs` (see the module): `processor(texts, images=[[...], ...], audio=[...])`.

    `reference` is the checkpoint's transformers processor; `image_token_id` the id of the soft-token
    placeholders it writes, `tokens_per_image` how many a pixel entry (an image or a tile) fills (None where
    each image's grid or patch count says, Qwen 3.5's and Gemma 4's), and `vocab_size` the model's; `model`, the
    `MultimodalConfig` it serves, says what else its tower reads (patch positions) and its audio tower, if any.
    """

    reference: Any
    image_token_id: int
    tokens_per_image: int | None
    vocab_size: int
    model: Any = None

    @classmethod
    def of(cls, reference, config) -> "Processor":
        """The processor around `reference` for the multimodal model `config` (a `MultimodalConfig`: its
        placeholder id, soft tokens an image or tile, vocabulary, tower and audio tower)."""
        return cls(reference, config.image_token_id, config.tokens_per_image, config.vocab_size, config)

    @property
    def audio(self):
        """The model's `AudioPart` (None without an audio tower)."""
        return getattr(self.model, "audio", None)

    @property
    def sampling_rate(self) -> int:
        """The rate, in Hz, of the waveforms the checkpoint's feature extractor reads (16 kHz where it names none)."""
        return int(getattr(getattr(self.reference, "feature_extractor", None), "sampling_rate", None) or 16_000)

    @property
    def reads_positions(self) -> bool:
        """Whether the tower reads padded patch streams with patch positions (Gemma 4's)."""
        return getattr(getattr(self.model, "tower", None), "reads_positions", False)

    @property
    def tokenizer(self):
        return self.reference.tokenizer

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    def __call__(self, text: str | Sequence[str], *, images: Sequence[Sequence[Any]] | None = None,
                 audio: Sequence[Any] | None = None, videos: Any = None) -> ModelInputs:
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(row, str) for row in texts):
            raise TypeError("Processor takes a string or a non-empty list of strings")
        if videos is not None:
            raise ValueError("videos are not built: transformers' video processors need torchvision, which Dew does "
                             "not depend on; a video placeholder in the text is read as the pad embedding")
        if images is not None:
            images = [list(row) for row in images]
            if len(images) != len(texts):
                raise ValueError(f"images has {len(images)} row(s) for {len(texts)} text(s): give one list of images "
                                 "per text, [] for a row without any")
        clips = self._clips_by_row(texts, audio)
        rows = [self._row(index, row, None if images is None else images[index], clips[index])
                for index, row in enumerate(texts)]
        return self._laid_out(rows)

    def _clips_by_row(self, texts: list[str], audio) -> list[list]:
        """The waveforms of `audio` (one per audio placeholder, in reading order over the batch) cut into rows."""
        if audio is None:
            audio = []
        audio = list(audio)
        if audio and self.audio is None:
            raise ValueError("audio was given, and this model has no audio tower: leave it out")
        placeholder = getattr(self.reference, "audio_token", None)
        asked = [text.count(placeholder) if placeholder and self.audio is not None else 0 for text in texts]
        if sum(asked) != len(audio):
            raise ValueError(f"the texts hold {sum(asked)} audio placeholder(s) {placeholder!r} and {len(audio)} "
                             "waveform(s) were given: give one 16 kHz mono waveform per placeholder, in reading order")
        ends = np.cumsum(asked)
        return [audio[end - count:end] for count, end in zip(asked, ends)]

    def _row(self, index: int, text: str, images: list | None, clips: list | None = None) -> dict:
        """One row through the reference processor: its ids, its images `[n, C, H, W]` (or patch entries) and
        its clips' frames."""
        placeholder = self._placeholder()
        asked = text.count(placeholder)
        given = len(images or ())
        if asked != given:
            raise ValueError(f"row {index} has {asked} image placeholder(s) {placeholder!r} and {given} image(s): "
                             "give one image per placeholder, in reading order")
        media = {}
        if images:
            media["images"] = [images]
        if clips:
            media["audio"] = [np.asarray(clip, np.float32) for clip in clips]
        outputs = self.reference(text=[text], padding=False, **media)
        unknown = sorted(set(outputs) - _KNOWN_OUTPUTS)
        if unknown:
            raise ValueError(f"the checkpoint's processor returned {unknown}, which Dew does not lay out for this "
                             f"model (it reads {sorted(_KNOWN_OUTPUTS)})")
        ids = self._checked(index, np.asarray(outputs["input_ids"][0], np.int64))
        row = {"ids": ids, "pixels": None, "owners": None}
        if "mm_token_type_ids" in outputs:
            row["types"] = np.asarray(outputs["mm_token_type_ids"][0], np.int64)
        if clips:
            row["features"], row["frames_mask"] = self._frames(clips, outputs)
        if not images:
            return row
        if "image_position_ids" in outputs:
            row.update(pixels=_float32(outputs["pixel_values"]),
                       positions=np.asarray(outputs["image_position_ids"], np.int32),
                       owners=np.arange(len(images), dtype=np.int32))
            return row
        if "image_grid_thw" in outputs:
            grids = np.asarray(outputs["image_grid_thw"], np.int64).reshape(-1, 3)
            patches = np.asarray(_float32(outputs["pixel_values"]))
            entries = np.split(patches, np.cumsum(np.prod(grids, axis=1))[:-1])
            return {**row, "pixels": entries, "grids": grids, "owners": np.arange(len(grids), dtype=np.int32)}
        entries = [_entries(image) for image in outputs["pixel_values"]]
        owners = np.repeat(np.arange(len(entries), dtype=np.int32), [len(entry) for entry in entries])
        return {**row, "pixels": np.concatenate(entries), "owners": owners}

    def _laid_out(self, rows: list[dict]) -> ModelInputs:
        inputs = self._images_laid_out(rows)
        if self.audio is None:
            return inputs
        return self._audio_laid_out(rows, inputs)

    def _images_laid_out(self, rows: list[dict]) -> ModelInputs:
        B, S = len(rows), max(len(row["ids"]) for row in rows)
        left = getattr(self.tokenizer, "padding_side", "left") == "left"
        tokens = np.full((B, S), self.pad_id, np.int32)
        valid = np.zeros((B, S), bool)
        indices = np.full((B, S), -1, np.int32)
        groups = np.full((B, S), -1, np.int32)
        for b, row in enumerate(rows):
            n = len(row["ids"])
            where = slice(S - n, S) if left else slice(0, n)
            tokens[b, where], valid[b, where] = row["ids"], True
            if self.merge is None and not self.reads_positions:
                indices[b, where], groups[b, where] = self._image_slots(b, row)
        fields = {"positions": np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)}
        if not valid.all():
            fields["attention_mask"] = valid
        if self.merge is not None:
            return self._grid_laid_out(rows, tokens, valid, fields)
        if self.reads_positions:
            return self._patch_laid_out(rows, tokens, fields)
        most = max(0 if row["pixels"] is None else len(row["pixels"]) for row in rows)
        if not most:
            return ModelInputs.of(tokens, **fields)
        shapes = {row["pixels"].shape[1:] for row in rows if row["pixels"] is not None}
        if len(shapes) != 1:
            raise ValueError(f"the processor gave images of shapes {sorted(shapes)}; one batch holds one image shape")
        pixels = np.zeros((B, most, *shapes.pop()), np.float32)
        for b, row in enumerate(rows):
            if row["pixels"] is not None:
                pixels[b, :len(row["pixels"])] = row["pixels"]
        inputs = ModelInputs.of(tokens, image_indices=indices, image_groups=groups, **fields)
        return inputs.replace(conditioning={"pixel_values": pixels})

    @property
    def merge(self) -> int | None:
        """Patches per side a soft token merges, for a processor that gives each image its grid (Qwen's)."""
        return getattr(self.reference.image_processor, "merge_size", None) if self.tokens_per_image is None else None

    def _grid_laid_out(self, rows: list[dict], tokens, valid, fields) -> ModelInputs:
        """`_laid_out` for images given as patch vectors with their grids (see the module)."""
        m2 = self.merge**2
        left = getattr(self.tokenizer, "padding_side", "left") == "left"
        B, S = tokens.shape
        grids = [[] if row["pixels"] is None else [tuple(map(int, grid)) for grid in row["grids"]] for row in rows]
        is_image = tokens == self.image_token_id
        fields["rotary_positions"], _ = three_axis_positions(is_image & valid, valid, grids, self.merge)
        most = max(map(len, grids))
        if not most:
            return ModelInputs.of(tokens, **fields)
        X = max(len(entry) for row in rows if row["pixels"] is not None for entry in row["pixels"])
        K = next(row["pixels"][0].shape[1] for row in rows if row["pixels"] is not None)
        pixels = np.zeros((B, most, X, K), np.float32)
        grid_thw = np.zeros((B, most, 3), np.int32)
        indices = np.full((B, S), -1, np.int32)
        groups = np.full((B, S), -1, np.int32)
        for b, row in enumerate(rows):
            if row["pixels"] is None:
                continue
            n = len(row["ids"])
            where = slice(S - n, S) if left else slice(0, n)
            sizes = [int(np.prod(grid)) // m2 for grid in grids[b]]
            indices[b, where], groups[b, where] = self._runs(b, row, sizes, X // m2)
            for entry, patches in enumerate(row["pixels"]):
                pixels[b, entry, :len(patches)] = patches
                grid_thw[b, entry] = grids[b][entry]
        inputs = ModelInputs.of(tokens, image_indices=indices, image_groups=groups, **fields)
        return inputs.replace(conditioning={"pixel_values": pixels, "image_grid_thw": grid_thw})

    def _patch_laid_out(self, rows: list[dict], tokens, fields) -> ModelInputs:
        """`_laid_out` for images given as padded patch streams with patch positions (see the module)."""
        left = getattr(self.tokenizer, "padding_side", "left") == "left"
        B, S = tokens.shape
        indices = np.full((B, S), -1, np.int32)
        groups = np.full((B, S), -1, np.int32)
        for b, row in enumerate(rows):
            n = len(row["ids"])
            groups[b, slice(S - n, S) if left else slice(0, n)] = _vision_runs(row.get("types"),
                                                                               row["ids"] == self.image_token_id)
        most = max(0 if row["pixels"] is None else len(row["pixels"]) for row in rows)
        if not most:  # video placeholders alone still read each other as a group
            return ModelInputs.of(tokens, image_indices=indices, image_groups=groups, **fields) if (
                groups >= 0).any() else ModelInputs.of(tokens, **fields)
        X, K = next(row["pixels"].shape[1:] for row in rows if row["pixels"] is not None)
        block = self.model.tower.block
        pixels = np.zeros((B, most, X, K), np.float32)
        positions = np.full((B, most, X, 2), -1, np.int32)
        for b, row in enumerate(rows):
            n = len(row["ids"])
            where = slice(S - n, S) if left else slice(0, n)
            if row["pixels"] is None:
                continue
            if row["pixels"].shape[1:] != (X, K):
                raise ValueError(f"the processor gave patch streams of shapes {(X, K)} and {row['pixels'].shape[1:]}; "
                                 "one batch holds one patch count (the processor's max_soft_tokens)")
            sizes = [int((entry != -1).all(-1).sum()) // block for entry in row["positions"]]
            indices[b, where], _ = self._runs(b, row, sizes, X // block)
            pixels[b, :len(row["pixels"])] = row["pixels"]
            positions[b, :len(row["pixels"])] = row["positions"]
        inputs = ModelInputs.of(tokens, image_indices=indices, image_groups=groups, **fields)
        return inputs.replace(conditioning={"pixel_values": pixels, "image_position_ids": positions})

    def _audio_laid_out(self, rows: list[dict], inputs: ModelInputs) -> ModelInputs:
        """`inputs` with the rows' clips laid out (see the module): frames, masks, clip counts, audio indices."""
        most = max(len(row.get("features", ())) for row in rows)
        if not most:
            return inputs
        left = getattr(self.tokenizer, "padding_side", "left") == "left"
        B, S = inputs.shape
        T = max(row["features"].shape[1] for row in rows if "features" in row)
        mel = next(row["features"].shape[2] for row in rows if "features" in row)
        fixed = self.audio.tokens_per_clip
        encoded = self.audio.tower.encoded_frames(T) if fixed is None else fixed
        features = np.zeros((B, most, T, mel), np.float32)
        masks = np.zeros((B, most, T), bool)
        lengths = np.zeros((B,), np.int32)
        indices = np.full((B, S), -1, np.int32)
        for b, row in enumerate(rows):
            if "features" not in row:
                continue
            n, (clips, frames) = len(row["ids"]), row["frames_mask"].shape
            features[b, :clips, :frames], masks[b, :clips, :frames] = row["features"], row["frames_mask"]
            lengths[b] = clips
            real = [self.audio.tower.encoded_frames(int(mask.sum())) for mask in row["frames_mask"]]
            if fixed is not None:  # a clip fills its fixed slots, padding after its frames
                for clip, frames in enumerate(real):
                    if frames > fixed:
                        raise ValueError(f"row {b}'s audio clip {clip} encodes to {frames} frames; the model reads "
                                         f"{fixed} soft tokens a clip: give a clip of at most {fixed} encoded frames "
                                         f"({fixed * self.audio.tower.frame_stride} feature frames)")
                real = [fixed] * len(real)
            where = slice(S - n, S) if left else slice(0, n)
            indices[b, where] = _placeholder_runs(b, row["ids"], self.audio.token_id, real, encoded, "audio clip")
        return inputs.replace(token_fields={**inputs.token_fields, "audio_indices": indices},
                              conditioning={**inputs.conditioning, "input_features": features,
                                            "input_features_mask": masks, "audio_lengths": lengths})

    def _image_slots(self, b: int, row: dict) -> tuple[np.ndarray, np.ndarray]:
        """(image_indices, image_groups) of one row's ids: each run of placeholders is one pixel entry."""
        entries = 0 if row["pixels"] is None else len(row["pixels"])
        return self._runs(b, row, [self.tokens_per_image] * entries, self.tokens_per_image)

    def _runs(self, b: int, row: dict, sizes: list[int], capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """(image_indices, image_groups) of one row's ids whose pixel entries fill `sizes` slots each, in order,
        entry `e`'s features starting at `e * capacity`."""
        indices = _placeholder_runs(b, row["ids"], self.image_token_id, sizes, capacity,
                                    "pixel entry (an image, or a tile of one)")
        if not sizes:
            return indices, np.full(len(indices), -1, np.int32)
        groups = np.where(indices >= 0, np.asarray(row["owners"], np.int32)[np.maximum(indices, 0) // capacity], -1)
        return indices, groups.astype(np.int32)

    def from_ids(self, ids: Sequence[int], images: Sequence[Any] = (), audio: Sequence[Any] = ()) -> ModelInputs:
        """One row of token ids in which each image placeholder id (the id of the processor's placeholder
        text: `<start_of_image>` for Gemma 3, `<|image|>` for Llama 4 and Gemma 4, `<|image_pad|>` for Qwen 3.5,
        whose chat template wraps it in `<|vision_start|>...<|vision_end|>`) stands for the next image, and each
        audio placeholder id (Gemma 4's `<|audio|>`) for the next waveform of `audio` (16 kHz mono), as
        `ModelInputs`: each placeholder expanded to the ids the checkpoint's processor writes for that
        image or clip (for Llama 4 they depend on the image's tiles, for Qwen 3.5 on its grid, for Gemma 4 on its
        size and on the clip's length), with its pixels or frames (and Qwen 3.5's grids and three-axis
        positions, Gemma 4's patch positions), as `__call__` lays out the prompt's text. The server's chat prompts
        come this way, encoded as text prompts are (special-token text in a message stays text)."""
        image_id = self.tokenizer.convert_tokens_to_ids(self._placeholder())
        audio_token = getattr(self.reference, "audio_token", None) if self.audio is not None else None
        audio_id = None if audio_token is None else self.tokenizer.convert_tokens_to_ids(audio_token)
        ids = [int(i) for i in ids]
        for placeholder, given, what in ((image_id, images, self._placeholder()), (audio_id, audio, audio_token)):
            places = sum(i == placeholder for i in ids) if placeholder is not None else 0
            if places != len(given):
                raise ValueError(f"the prompt has {places} {'image' if placeholder == image_id else 'audio'} "
                                 f"placeholder(s) {what!r} and {len(given)} "
                                 f"{'image' if placeholder == image_id else 'waveform'}(s): give one per "
                                 "placeholder, in reading order")
        pieces = {image_id: iter([self._expansion(image) for image in images]),
                  audio_id: iter([self._audio_expansion(clip) for clip in audio])}
        expanded, used = [], {image_id: [], audio_id: []}
        for i in ids:
            if i in pieces:
                piece = next(pieces[i])
                expanded.extend(piece["ids"])
                used[i].append(piece)
            else:
                expanded.append(i)
        row = {"ids": self._checked(0, np.asarray(expanded, np.int64)), "pixels": None, "owners": None}
        row["types"] = self._types(row["ids"])
        images_used, clips_used = used[image_id], used[audio_id] if audio_id is not None else []
        if images_used and self.merge is not None:  # one patch entry and one grid an image
            row.update(pixels=[piece["pixels"] for piece in images_used],
                       grids=np.stack([piece["grid"] for piece in images_used]),
                       owners=np.arange(len(images_used), dtype=np.int32))
        elif images_used and self.reads_positions:
            row.update(pixels=np.concatenate([piece["pixels"] for piece in images_used]),
                       positions=np.concatenate([piece["positions"] for piece in images_used]),
                       owners=np.arange(len(images_used), dtype=np.int32))
        elif images_used:
            row.update(pixels=np.concatenate([piece["pixels"] for piece in images_used]),
                       owners=np.repeat(np.arange(len(images_used), dtype=np.int32),
                                        [len(piece["pixels"]) for piece in images_used]))
        if clips_used:  # each clip's frames as the extractor gives it alone, padded here to the longest
            frames = max(piece["features"].shape[0] for piece in clips_used)
            features = np.zeros((len(clips_used), frames, clips_used[0]["features"].shape[1]), np.float32)
            masks = np.zeros((len(clips_used), frames), bool)
            for c, piece in enumerate(clips_used):
                features[c, :len(piece["features"])], masks[c, :len(piece["mask"])] = piece["features"], piece["mask"]
            row.update(features=features, frames_mask=masks)
        return self._laid_out([row])

    def _types(self, ids: np.ndarray) -> np.ndarray:
        """`mm_token_type_ids` of a row of ids as the reference processor marks them (image 1, video 2, audio 3)."""
        types = np.zeros(len(ids), np.int64)
        for value, name in ((1, "image_token_id"), (2, "video_token_id"), (3, "audio_token_id")):
            token = getattr(self.reference, name, None)
            if token is not None:
                types[ids == token] = value
        return types

    def _expansion(self, image) -> dict:
        """The ids the reference processor writes for one placeholder holding `image` and its pixel entries
        `[n, C, H, W]` (for a processor giving grids, its patch vectors `[patches, C*T*p*p]` and `grid`; for one
        giving patch streams, `[1, X, 3*p*p]` and `positions` `[1, X, 2]`)."""
        outputs = self.reference(text=[self._placeholder()], images=[[image]], padding=False,
                                 add_special_tokens=False)
        ids = [int(i) for i in outputs["input_ids"][0]]
        if "image_grid_thw" in outputs:
            return {"ids": ids, "pixels": _float32(outputs["pixel_values"]),
                    "grid": np.asarray(outputs["image_grid_thw"], np.int64).reshape(3)}
        if "image_position_ids" in outputs:
            return {"ids": ids, "pixels": _float32(outputs["pixel_values"]),
                    "positions": np.asarray(outputs["image_position_ids"], np.int32)}
        return {"ids": ids, "pixels": _entries(outputs["pixel_values"][0])}

    def _audio_expansion(self, clip) -> dict:
        """The ids the reference processor writes for one audio placeholder holding `clip`, with its frames
        `[frames, mel]` and their mask."""
        outputs = self.reference(text=[self.reference.audio_token], audio=[np.asarray(clip, np.float32)],
                                 padding=False, add_special_tokens=False)
        features, mask = self._frames([clip], outputs)
        return {"ids": [int(i) for i in outputs["input_ids"][0]], "features": features[0], "mask": mask[0]}

    def _frames(self, clips, outputs) -> tuple[np.ndarray, np.ndarray]:
        """A row's clips as frames `[clips, frames, mel]` and their mask. Where each clip fills a fixed number of
        slots (Gemma 3n), each clip's frames come from the checkpoint's extractor alone, under its own padding
        (the waveform zero-padded to a multiple of 128 samples, its last part-frame kept, as transformers'
        processor gives a clip), not the `padding=False` call's, which drops that frame; a row's clips are then
        padded to the longest as frames, masked."""
        if self.audio is None or getattr(self.audio, "tokens_per_clip", None) is None:
            return _clip_frames(outputs["input_features"], outputs["input_features_mask"])
        extractor = self.reference.feature_extractor
        alone = [extractor([np.asarray(clip, np.float32)], return_tensors="np") for clip in clips]
        return _clip_frames([one["input_features"][0] for one in alone],
                            [one["input_features_mask"][0] for one in alone])

    def _checked(self, index: int, ids: np.ndarray) -> np.ndarray:
        """A row's ids, refused when empty or outside the model's vocabulary (naming the row and column)."""
        if ids.size == 0:
            raise ValueError(f"text {index} encodes to no tokens; every row needs at least one")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise ValueError(f"row {index} holds token id {int(ids[bad[0]])} at column {int(bad[0])}, outside the "
                             f"model's vocab_size {self.vocab_size}: the processor's tokenizer belongs to another model")
        return ids

    def _placeholder(self) -> str:
        return getattr(self.reference, "image_token", None) or self.reference.boi_token

    def chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **template_options) -> str:
        """The conversation as the checkpoint's chat template writes it (images as their placeholders)."""
        return self.reference.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **template_options)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the processor's files (its config, the tokenizer's) into `directory`."""
        self.reference.save_pretrained(str(directory))


def _runs_of(marked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the runs of true in `marked`."""
    starts = np.flatnonzero(marked & ~np.concatenate([[False], marked[:-1]]))
    ends = np.flatnonzero(marked & ~np.concatenate([marked[1:], [False]])) + 1
    return starts, ends


def _placeholder_runs(b: int, ids: np.ndarray, token_id: int, sizes: list[int], capacity: int, what: str) -> np.ndarray:
    """The feature each of a row's slots reads: its runs of `token_id` filled by `what`s of `sizes` slots each, in
    order, entry `e`'s features starting at `e * capacity` (-1 elsewhere); refused where the runs disagree."""
    starts, ends = _runs_of(ids == token_id)
    if len(starts) != len(sizes):
        raise ValueError(f"row {b} holds {len(starts)} run(s) of placeholder tokens (id {token_id}) for {len(sizes)} "
                         f"{what}(s): the processor's expansion and the model's placeholder id disagree")
    indices = np.full(len(ids), -1, np.int32)
    for entry, (start, end, size) in enumerate(zip(starts, ends, sizes)):
        if end - start != size:
            raise ValueError(f"row {b}'s {what} {entry} fills {end - start} slot(s); the model reads {size} soft "
                             "tokens for it")
        indices[start:end] = entry * capacity + np.arange(end - start)
    return indices


def _vision_runs(types: np.ndarray | None, is_image: np.ndarray) -> np.ndarray:
    """Each slot's vision group: the runs of image or video placeholders (`mm_token_type_ids` 1 or 2; without
    them, of `is_image`) numbered in order, -1 elsewhere; an image run meeting a video run is one group."""
    vision = is_image if types is None else np.isin(types, _VISION_TYPES)
    starts, _ = _runs_of(vision)
    opened = np.zeros(len(vision), np.int32)
    opened[starts] = 1
    return np.where(vision, np.cumsum(opened) - 1, -1).astype(np.int32)


def _clip_frames(features, masks) -> tuple[np.ndarray, np.ndarray]:
    """A row's clips as float32 frames `[clips, frames, mel]` and their mask: an extractor that leaves them unpadded
    under `padding=False` (Gemma 3n's, a list of `[frames, mel]`) is zero-padded here to the row's longest."""
    if not isinstance(features, (list, tuple)):
        return _float32(features), np.asarray(masks, bool)
    clips = [_float32(clip) for clip in features]
    T = max(len(clip) for clip in clips)
    frames = np.zeros((len(clips), T, clips[0].shape[-1]), np.float32)
    mask = np.zeros((len(clips), T), bool)
    for n, (clip, clip_mask) in enumerate(zip(clips, masks)):
        frames[n, :len(clip)], mask[n, :len(clip)] = clip, np.asarray(clip_mask, bool)
    return frames, mask


def _float32(pixels) -> np.ndarray:
    """Pixels from the processor as float32; a torch tensor is widened in torch (numpy has no bfloat16, in
    which Llama 4's processor normalizes), exactly."""
    if hasattr(pixels, "detach"):
        pixels = pixels.detach().float().numpy()
    return np.asarray(pixels, np.float32)


def _entries(image) -> np.ndarray:
    """One image's pixels from the processor as float32 entries `[n, C, H, W]`: an image `[C, H, W]` is one,
    a stack of tiles `[tiles, C, H, W]` is one a tile."""
    pixels = _float32(image)
    return pixels[None] if pixels.ndim == 3 else pixels


__all__ = ["Processor", "load_reference"]
