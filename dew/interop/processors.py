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
float32, which is exact.

It checks on the host what the compiled model never checks: token ids inside the vocabulary, each
row's placeholder runs against its pixel entries and `tokens_per_image`, and the images' shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dew.data.inputs import ModelInputs
from dew.data.rotary_positions import three_axis_positions

# What a transformers processor returns that Dew lays out; anything else is refused by name.
_KNOWN_OUTPUTS = {"input_ids", "attention_mask", "pixel_values", "token_type_ids", "mm_token_type_ids",
                  "aspect_ratios", "image_grid_thw"}


def load_reference(directory: Path):
    """The checkpoint's own transformers processor, built from its files (offline, PIL image backend)."""
    try:
        from transformers import AutoProcessor
    except ImportError as error:  # transformers is an optional extra
        raise ImportError(f"the processor of {directory} is transformers' own class, and transformers is not "
                          f"installed ({error}): pip install 'dew-ml[vision]'") from None
    try:
        return AutoProcessor.from_pretrained(str(directory), local_files_only=True, backend="pil")
    except ValueError as error:  # Llama 4's image processor, for one, exists only as a torchvision class
        if "torchvision" not in str(error):
            raise
        raise ImportError(f"the image processor of {directory} is a torchvision class in transformers, and "
                          "torchvision does not import here: install the torchvision build that matches your "
                          "torch (for a CPU torch, from PyTorch's CPU wheel index)") from error


@dataclasses.dataclass(frozen=True)
class Processor:
    """Text and images to `ModelInputs` (see the module): `processor(texts, images=[[...], ...])`.

    `reference` is the checkpoint's transformers processor; `image_token_id` the id of the soft-token
    placeholders it writes, `tokens_per_image` how many a pixel entry (an image or a tile) fills (None where
    each image's grid says, Qwen 3.5's), and `vocab_size` the model's.
    """

    reference: Any
    image_token_id: int
    tokens_per_image: int | None
    vocab_size: int

    @classmethod
    def of(cls, reference, config) -> "Processor":
        """The processor around `reference` for the multimodal model `config` (a `MultimodalConfig`: its
        placeholder id, soft tokens an image or tile, and vocabulary)."""
        return cls(reference, config.image_token_id, config.tokens_per_image, config.vocab_size)

    @property
    def tokenizer(self):
        return self.reference.tokenizer

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)

    def __call__(self, text: str | Sequence[str], *, images: Sequence[Sequence[Any]] | None = None) -> ModelInputs:
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(row, str) for row in texts):
            raise TypeError("Processor takes a string or a non-empty list of strings")
        if images is not None:
            images = [list(row) for row in images]
            if len(images) != len(texts):
                raise ValueError(f"images has {len(images)} row(s) for {len(texts)} text(s): give one list of images "
                                 "per text, [] for a row without any")
        rows = [self._row(index, row, None if images is None else images[index]) for index, row in enumerate(texts)]
        return self._laid_out(rows)

    def _row(self, index: int, text: str, images: list | None) -> dict:
        """One row through the reference processor: its ids and its images `[n, C, H, W]`."""
        placeholder = self._placeholder()
        asked = text.count(placeholder)
        given = len(images or ())
        if asked != given:
            raise ValueError(f"row {index} has {asked} image placeholder(s) {placeholder!r} and {given} image(s): "
                             "give one image per placeholder, in reading order")
        if images:
            outputs = self.reference(text=[text], images=[images], padding=False)
        else:
            outputs = self.reference(text=[text], padding=False)
        unknown = sorted(set(outputs) - _KNOWN_OUTPUTS)
        if unknown:
            raise ValueError(f"the checkpoint's processor returned {unknown}, which Dew does not lay out for this "
                             f"model (it reads {sorted(_KNOWN_OUTPUTS)})")
        ids = self._checked(index, np.asarray(outputs["input_ids"][0], np.int64))
        if not images:
            return {"ids": ids, "pixels": None, "owners": None}
        if "image_grid_thw" in outputs:
            grids = np.asarray(outputs["image_grid_thw"], np.int64).reshape(-1, 3)
            patches = np.asarray(_float32(outputs["pixel_values"]))
            entries = np.split(patches, np.cumsum(np.prod(grids, axis=1))[:-1])
            return {"ids": ids, "pixels": entries, "grids": grids, "owners": np.arange(len(grids), dtype=np.int32)}
        entries = [_entries(image) for image in outputs["pixel_values"]]
        owners = np.repeat(np.arange(len(entries), dtype=np.int32), [len(entry) for entry in entries])
        return {"ids": ids, "pixels": np.concatenate(entries), "owners": owners}

    def _laid_out(self, rows: list[dict]) -> ModelInputs:
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
            if self.merge is None:
                indices[b, where], groups[b, where] = self._image_slots(b, row)
        fields = {"positions": np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)}
        if not valid.all():
            fields["attention_mask"] = valid
        if self.merge is not None:
            return self._grid_laid_out(rows, tokens, valid, fields)
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

    def _image_slots(self, b: int, row: dict) -> tuple[np.ndarray, np.ndarray]:
        """(image_indices, image_groups) of one row's ids: each run of placeholders is one pixel entry."""
        entries = 0 if row["pixels"] is None else len(row["pixels"])
        return self._runs(b, row, [self.tokens_per_image] * entries, self.tokens_per_image)

    def _runs(self, b: int, row: dict, sizes: list[int], capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """(image_indices, image_groups) of one row's ids whose pixel entries fill `sizes` slots each, in order,
        entry `e`'s features starting at `e * capacity`."""
        ids = row["ids"]
        is_image = ids == self.image_token_id
        starts = np.flatnonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))
        ends = np.flatnonzero(is_image & ~np.concatenate([is_image[1:], [False]])) + 1
        if len(starts) != len(sizes):
            raise ValueError(f"row {b} holds {len(starts)} run(s) of image tokens (id {self.image_token_id}) for "
                             f"{len(sizes)} pixel entries (images, or tiles of them): the processor's expansion and "
                             "the model's image_token_id disagree")
        indices, groups = np.full(len(ids), -1, np.int32), np.full(len(ids), -1, np.int32)
        for entry, (start, end, size) in enumerate(zip(starts, ends, sizes)):
            if end - start != size:
                raise ValueError(f"row {b}'s pixel entry {entry} (of image {row['owners'][entry]}) fills "
                                 f"{end - start} slot(s); the model reads {size} soft tokens for it")
            indices[start:end] = entry * capacity + np.arange(end - start)
            groups[start:end] = row["owners"][entry]
        return indices, groups

    def from_ids(self, ids: Sequence[int], images: Sequence[Any] = ()) -> ModelInputs:
        """One row of token ids in which each image placeholder id (the id of the processor's placeholder
        text: `<start_of_image>` for Gemma 3, `<|image|>` for Llama 4, `<|image_pad|>` for Qwen 3.5, whose chat
        template wraps it in `<|vision_start|>...<|vision_end|>`) stands for the next image, as
        `ModelInputs`: each placeholder expanded to the ids the checkpoint's processor writes for that
        image (for Llama 4 they depend on the image's tiles, for Qwen 3.5 on its grid), with its pixels (and
        Qwen 3.5's grids and three-axis positions), as `__call__` lays out the prompt's text. The server's chat prompts
        come this way, encoded as text prompts are (special-token text in a message stays text)."""
        placeholder = self.tokenizer.convert_tokens_to_ids(self._placeholder())
        ids = [int(i) for i in ids]
        places = [at for at, i in enumerate(ids) if i == placeholder]
        if len(places) != len(images):
            raise ValueError(f"the prompt has {len(places)} image placeholder(s) {self._placeholder()!r} and "
                             f"{len(images)} image(s): give one image per placeholder, in reading order")
        pieces = [self._expansion(image) for image in images]
        expanded, at = [], 0
        for i in ids:
            if i == placeholder:
                expanded.extend(pieces[at]["ids"])
                at += 1
            else:
                expanded.append(i)
        row = {"ids": self._checked(0, np.asarray(expanded, np.int64)), "pixels": None, "owners": None}
        if pieces and self.merge is not None:  # one patch entry and one grid an image
            row.update(pixels=[piece["pixels"] for piece in pieces], grids=np.stack([piece["grid"] for piece in pieces]),
                       owners=np.arange(len(pieces), dtype=np.int32))
        elif pieces:
            row.update(pixels=np.concatenate([piece["pixels"] for piece in pieces]),
                       owners=np.repeat(np.arange(len(pieces), dtype=np.int32),
                                        [len(piece["pixels"]) for piece in pieces]))
        return self._laid_out([row])

    def _expansion(self, image) -> dict:
        """The ids the reference processor writes for one placeholder holding `image` and its pixel entries
        `[n, C, H, W]` (for a processor giving grids, its patch vectors `[patches, C*T*p*p]` and `grid`)."""
        outputs = self.reference(text=[self._placeholder()], images=[[image]], padding=False,
                                 add_special_tokens=False)
        ids = [int(i) for i in outputs["input_ids"][0]]
        if "image_grid_thw" in outputs:
            return {"ids": ids, "pixels": _float32(outputs["pixel_values"]),
                    "grid": np.asarray(outputs["image_grid_thw"], np.int64).reshape(3)}
        return {"ids": ids, "pixels": _entries(outputs["pixel_values"][0])}

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
