"""Llama 4 with images against transformers' `Llama4ForConditionalGeneration` on the same weights
(tests/fixtures/hf/llama4-native-tiny, made by tools/make_llama4_fixtures.py), in float32: the processor's
tile layout against transformers' `Llama4Processor`, logits of text-only and image batches (one image of
3 tiles; two images of 1 and 3 tiles; left padding), cached greedy continuations, the pixel gradient, one
SGD step, and save -> transformers reload.

transformers' `Llama4ImageProcessor` needs torchvision, whose PyPI wheels are CUDA builds that do not
load beside the CPU torch these tests run on; `Tiles` stands in for it, cutting images whose sides are
multiples of the tile into tiles and a global tile, normalized in bfloat16 as transformers' does, and
`Llama4Processor` (transformers' own) expands the placeholders around them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data.dataset import Dataset
from dew.interop import load_pretrained
from dew.interop.processors import Processor
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling
from dew.serve import Engine, Request
from dew.training import Layout, MeshSpec, Trainer
from tests.compiled import compiled
from tests.interop.multimodal_checks import (check_greedy_matches_generate, check_row_logits, check_save_reloads,
                                             check_stepped_logits, targets)
from tests.interop.test_llama4_text import llama4_ulps
from tests.nn.test_vision_llama4 import _bound as tower_bound
from tests.serve.test_engine import Collect
from tests.tolerances import assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "llama4-native-tiny"
TILE = 28
PROMPTS = ["token20 <|image|> token21", "token30 <|image|> token31 <|image|> token32 token33"]
TEXT = ["token20 token21 token22 token23", "token30 token31"]


class Tiles(transformers.image_processing_utils.BaseImageProcessor):
    """Images `[H, W, 3]` uint8 with H and W multiples of the tile, as `[tiles, 3, TILE, TILE]` bfloat16: the
    local tiles row by row, then (where there are several) the image subsampled to one global tile;
    `x / 255` then `(x - 0.5) / 0.5`, each rounded to bfloat16, as transformers' Llama 4 processor does."""

    model_input_names = ["pixel_values"]

    def __call__(self, images, **_):
        pixels, ratios = [], []
        for image in images:
            rows, cols = image.shape[0] // TILE, image.shape[1] // TILE
            x = torch.tensor(np.asarray(image)).permute(2, 0, 1).to(torch.bfloat16) * (1 / 255)
            x = (x - 0.5) / 0.5
            tiles = [x[:, r * TILE:(r + 1) * TILE, c * TILE:(c + 1) * TILE] for r in range(rows) for c in range(cols)]
            if rows * cols > 1:
                tiles.append(x[:, ::rows, ::cols])
            pixels.append(torch.stack(tiles))
            ratios.append(torch.tensor([rows, cols]))
        return transformers.image_processing_utils.BatchFeature({"pixel_values": pixels, "aspect_ratios": ratios})


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", max_seq_len=96)


@pytest.fixture(scope="module")
def hf_processor():
    tokenizer = transformers.AutoTokenizer.from_pretrained(FIXTURE)
    return transformers.Llama4Processor(image_processor=Tiles(), tokenizer=tokenizer, patch_size=7,
                                        pixel_shuffle_ratio=0.5)


@pytest.fixture(scope="module")
def processor(bundle, hf_processor):
    return Processor.of(hf_processor, bundle.model.config)


@pytest.fixture(scope="module")
def reference():
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                        attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(903)
    draw = lambda h, w: rng.integers(0, 256, (h * TILE, w * TILE, 3), dtype=np.uint8)
    return [[draw(2, 1)], [draw(1, 1), draw(1, 2)]]  # 3 tiles; 1 and 3 tiles


def logit_bound(bundle, magnitude: float, seq_len: int) -> float:
    """The text decoder's ulps (`llama4_ulps`) plus what soft tokens carry in: the tower's ulps (relative to
    its own outputs, which the 32-term projection carries forward at their size)."""
    text = transformers.Llama4TextConfig(**json.loads((FIXTURE / "config.json").read_text())["text_config"])
    tower = tower_bound(bundle.model.config.tower, 1.0) / float(jnp.finfo(jnp.float32).eps)
    return ulp_bound(llama4_ulps(text, seq_len) + tower + np.sqrt(6 * 32), magnitude)


def _their_row(hf_processor, text, images):
    outputs = hf_processor(text=[text], images=None if images is None else [images], padding=False)
    row = {"input_ids": torch.tensor(outputs["input_ids"])}
    if images is not None:
        row["pixel_values"] = torch.cat(list(outputs["pixel_values"])).float()
    return row


def test_processor_lays_out_tiles_as_transformers_expands_them(processor, hf_processor, images):
    inputs = processor(PROMPTS, images=images)
    mask = inputs.token_fields["attention_mask"]
    for row, (prompt, row_images) in enumerate(zip(PROMPTS, images)):
        theirs = hf_processor(text=[prompt], images=[row_images], padding=False)
        ids = np.asarray(theirs["input_ids"][0])
        np.testing.assert_array_equal(inputs.tokens[row][mask[row]], ids)
        slots = inputs.token_fields["image_indices"][row][mask[row]]
        np.testing.assert_array_equal(slots >= 0, ids == 7)  # <|patch|> slots read soft tokens, in order
        np.testing.assert_array_equal(slots[slots >= 0], np.arange((slots >= 0).sum()))
        tiles = torch.cat(list(theirs["pixel_values"]))
        assert tiles.dtype == torch.bfloat16
        # bfloat16 widened to float32 exactly, tile by tile
        np.testing.assert_array_equal(inputs.conditioning["pixel_values"][row, :len(tiles)], tiles.float().numpy())
        counts = [len(t) for t in theirs["pixel_values"]]
        groups = inputs.token_fields["image_groups"][row][mask[row]]
        np.testing.assert_array_equal(groups[slots >= 0], np.repeat(np.arange(len(counts)), 4 * np.array(counts)))
    assert inputs.conditioning["pixel_values"].shape == (2, 4, 3, TILE, TILE)
    assert not inputs.conditioning["pixel_values"][0, 3].any()  # the shorter row's padding tile
    with pytest.raises(ValueError, match=r"row 0 has 1 image placeholder\(s\) '<\|image\|>' and 2 image"):
        processor(PROMPTS[:1], images=[images[1]])


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here")
def test_a_missing_torchvision_is_named(bundle):
    """transformers' Llama 4 image processor is a torchvision class; without torchvision the checkpoint's
    processor is refused naming what to install."""
    with pytest.raises(ImportError, match="torchvision build that matches your torch"):
        bundle.processor


@pytest.mark.parametrize("with_images", [True, False], ids=["images", "text"])
def test_logits_match_transformers(bundle, processor, hf_processor, reference, images, with_images):
    prompts = PROMPTS if with_images else TEXT
    inputs = processor(prompts, images=images if with_images else None)
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, inputs.tokens, **inputs.kwargs()))
    their_rows = [_their_row(hf_processor, prompt, images[row] if with_images else None)
                  for row, prompt in enumerate(prompts)]
    # largest differences observed: 7.8e-6 with images (logits up to 5.5, bound 2.0e-3), 3.2e-6 text only
    # (up to 5.2, bound 5.5e-4)
    bound = lambda magnitude, seq_len: logit_bound(bundle, magnitude, seq_len)
    check_row_logits(ours, inputs, reference, their_rows, bound, 2.0)


@pytest.fixture(scope="module")
def greedy(bundle, processor, images):
    """text_generation's greedy continuations of PROMPTS with their images, 6 tokens a row."""
    inputs = processor(PROMPTS, images=images)
    return bundle.text_generation(sampling=Sampling(temperature=0))(inputs, 6, seed=1).continuations()


def test_cached_greedy_continuation_matches_generate(bundle, processor, hf_processor, reference, images, greedy):
    check_greedy_matches_generate(bundle, processor(PROMPTS, images=images), reference,
                                  [_their_row(hf_processor, prompt, images[row]) for row, prompt in enumerate(PROMPTS)],
                                  continuations=greedy)


def test_prompt_ids_with_placeholders_are_served_as_text_generation_answers(bundle, processor, images, greedy):
    """A chat prompt comes to the server as token ids, one `<|image|>` an image: `from_ids` expands each to
    that image's tiles and separators as the processor expands the text, and the serving engine, with
    rows of 3 and 4 tiles in flight together, draws what text_generation draws."""
    requests = []
    for row, (prompt, row_images) in enumerate(zip(PROMPTS, images)):
        ours = processor.from_ids(processor.tokenizer(prompt)["input_ids"], row_images)
        theirs = processor([prompt], images=[row_images])
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        for name in ("positions", "image_indices", "image_groups"):
            np.testing.assert_array_equal(ours.token_fields[name], theirs.token_fields[name], err_msg=name)
        np.testing.assert_array_equal(ours.conditioning["pixel_values"], theirs.conditioning["pixel_values"])
        media = {name: np.asarray(ours.token_fields[name][0]) for name in ("image_indices", "image_groups")}
        media["pixel_values"] = np.asarray(ours.conditioning["pixel_values"][0])
        requests.append(Request([int(i) for i in ours.tokens[0]], 6, Sampling(temperature=0), 1, Collect(), row,
                                media=media))
    with pytest.raises(ValueError, match=r"the prompt has 1 image placeholder\(s\) '<\|image\|>' and 2 image"):
        processor.from_ids(processor.tokenizer(PROMPTS[0])["input_ids"], images[1])
    engine = Engine(bundle.model, bundle.variables, slots=2, capacity=64, prefill_rows=1)
    engine.start()
    try:
        engine.submit(requests)
        for request in requests:
            assert request.consumer.done.wait(120), "the engine did not finish the request"
    finally:
        engine.close()
    # text_generation fed both rows together, left-padded; the engine one row at a time (the seed draws
    # nothing at temperature 0)
    assert [request.consumer.tokens for request in requests] == greedy


def _their_loss(model, inputs, pixels):
    """transformers' mean cross entropy over the same targets, each row fed alone (transformers' NoPE
    temperature reads the padded slot index), `pixels` the rows' tiles in order."""
    tokens, weights = targets(inputs)
    valid = np.asarray(inputs.token_fields["attention_mask"])
    total, used = 0, 0
    for row in range(tokens.shape[0]):
        ids = torch.tensor(tokens[row][valid[row]][None], dtype=torch.long)
        tiles = int(np.asarray(inputs.token_fields["image_indices"])[row].max()) // 4 + 1
        logits = model(input_ids=ids, pixel_values=pixels[used:used + tiles]).logits[0]
        used += tiles
        ce = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
        total = total + (ce * torch.tensor(weights[row][valid[row][:-1]], dtype=torch.float32)).sum()
    return total / float(weights.sum())


def _tiles(inputs):
    pixels = np.asarray(inputs.conditioning["pixel_values"])
    counts = [int(np.asarray(inputs.token_fields["image_indices"])[row].max()) // 4 + 1 for row in range(len(pixels))]
    return np.concatenate([pixels[row, :count] for row, count in enumerate(counts)]), counts


def test_pixel_gradient_matches_transformers(bundle, processor, reference, images):
    inputs = processor(PROMPTS, images=images)
    tokens, weights = targets(inputs)

    def loss(pixel_values):
        logits = bundle.model.apply(bundle.variables, inputs.tokens, **{**inputs.kwargs(), "pixel_values": pixel_values})
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
        return jnp.sum(ce * weights) / weights.sum()

    ours = np.asarray(compiled(jax.grad(loss), jnp.asarray(inputs.conditioning["pixel_values"])))
    flat, counts = _tiles(inputs)
    pixels = torch.tensor(flat, requires_grad=True)
    _their_loss(reference, inputs, pixels).backward()
    theirs = pixels.grad.numpy()
    mine = np.concatenate([ours[row, :count] for row, count in enumerate(counts)])
    assert not ours[0, 3].any()  # the padding tile reaches no slot
    # twice the logits' chain backwards, of the largest gradient (observed 2.8e-7 on gradients up to 0.049,
    # bound 3.5e-5)
    assert_within(mine, theirs, 2 * logit_bound(bundle, np.abs(theirs).max(), inputs.shape[1]), "pixel gradient")


def test_one_sgd_step_matches_transformers(bundle, processor, hf_processor, images):
    inputs = processor(PROMPTS, images=images)
    objective = LMObjective(bundle.model, inputs.tokens.shape[1] - 1, pretrained=bundle.variables, ema_decay=None,
                            pad_id=0)
    data = Dataset(train=lambda partition: iter([{"text": inputs}]), val=None, records=2, batch=2)
    state = Trainer(objective, optax.sgd(1e-2), key=jax.random.key(3), mesh=MeshSpec(),
                    layout=Layout(min_shard=2**30)).fit(data, steps=1, log_every=1)
    stepped = transformers.Llama4ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                          attn_implementation="eager")
    _their_loss(stepped, inputs, torch.tensor(_tiles(inputs)[0])).backward()
    ours = np.asarray(compiled(bundle.model.apply, state.params, inputs.tokens, **inputs.kwargs()))
    before = np.asarray(compiled(bundle.model.apply, bundle.variables, inputs.tokens, **inputs.kwargs()))
    check_stepped_logits(stepped, ours, before, inputs, [_their_row(hf_processor, prompt, images[row])
                                                         for row, prompt in enumerate(PROMPTS)],
                         lambda magnitude, seq_len: logit_bound(bundle, magnitude, seq_len))


def test_save_reloads_in_transformers(bundle, hf_processor, reference, images, tmp_path):
    row = _their_row(hf_processor, PROMPTS[1], images[1])
    check_save_reloads(bundle, transformers.Llama4ForConditionalGeneration, reference, row, FIXTURE, tmp_path / "saved")
