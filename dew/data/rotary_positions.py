"""Three-axis rotary positions (time, height, width) for prompts holding images, computed on the host the
way Qwen's vision-language models lay them out (transformers' `get_rope_index`).

Each row's real tokens are walked in order. A run of text continues one counter on all three axes. An
image of `grid_thw` `(t, h, w)` patches fills `t * h * w / merge**2` slots, in row-major order over its
merged grid `(t, h / merge, w / merge)`: slot `(i, j, k)` sits at `start + (i, j, k)`, `start` being the
counter where the image begins; the counter then moves on by the merged grid's longer side. Padding takes
position 0. A row's delta, one past its largest position less its real token count, is where its
decode steps continue from (`dew.nn.kv_cache.Cache.rotary_delta`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def three_axis_positions(images_BS, valid_BS, grids: Sequence[Sequence[Sequence[int]]],
                         merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions int32 `[B, S, 3]`, deltas int32 `[B]`) for rows whose slots `images_BS` marks as an
    image's soft tokens (true) or text (false), `valid_BS` marking real slots; `grids[b]` lists row
    `b`'s images' `(t, h, w)` patch grids in order (before merging `merge x merge` patches into one
    token). Two images must be parted by text (Qwen's prompts wrap each in its start and end tokens)."""
    images_BS = np.asarray(images_BS).astype(bool)
    valid_BS = np.asarray(valid_BS).astype(bool)
    B, S = images_BS.shape
    positions = np.zeros((B, S, 3), np.int32)
    deltas = np.zeros((B,), np.int32)
    for b in range(B):
        slots = np.flatnonzero(valid_BS[b])
        row = np.zeros((len(slots), 3), np.int64)
        flags = images_BS[b, slots]
        starts = [0, *np.flatnonzero(flags[1:] != flags[:-1]) + 1, len(slots)]
        images = iter(grids[b])
        counter = 0
        for start, stop in zip(starts[:-1], starts[1:]):
            if start == stop:
                continue
            if not flags[start]:
                row[start:stop] = counter + np.arange(stop - start)[:, None]
                counter += stop - start
                continue
            grid = next(images, None)
            if grid is None:
                raise ValueError(f"row {b} holds more image runs than its {len(grids[b])} image grid(s): give one "
                                 "(t, h, w) grid per image, in order")
            t, h, w = (int(n) for n in grid)
            if h % merge or w % merge:
                raise ValueError(f"image grid {(t, h, w)} of row {b} does not divide into {merge}x{merge} merged "
                                 "patches: the image processor's grids are multiples of the merge size")
            merged = (t, h // merge, w // merge)
            if stop - start != int(np.prod(merged)):
                raise ValueError(f"row {b} has a run of {stop - start} image tokens where its grid {(t, h, w)} "
                                 f"fills {int(np.prod(merged))}: the prompt's placeholders and the images disagree "
                                 "(or two images touch without text between)")
            cells = np.stack(np.meshgrid(*(np.arange(n) for n in merged), indexing="ij"), -1).reshape(-1, 3)
            row[start:stop] = counter + cells
            counter += max(merged[1], merged[2])
        if next(images, None) is not None:
            raise ValueError(f"row {b} was given {len(grids[b])} image grid(s) and holds fewer image runs: give one "
                             "grid per image the prompt shows")
        positions[b, slots] = row
        deltas[b] = (row.max() + 1 - len(slots)) if len(slots) else 0
    return positions, deltas


__all__ = ["three_axis_positions"]
