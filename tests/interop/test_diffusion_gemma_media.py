"""DiffusionGemma with images against transformers' `DiffusionGemmaForBlockDiffusion` on the same weights
(tests/fixtures/hf/diffusion-gemma-vision, made by tools/make_diffusion_gemma_fixtures.py), in float32: the checkpoint's
processor (transformers' `Gemma4Processor`) against transformers' own; the encoder's logits over a prompt holding
images (rows of one and two images of other sizes, left padding; image tokens reading each other in both
directions) and the denoiser's after it, before and after a committed canvas; block generation with images against
`generate`; save -> reload with the processor, the clipping bounds and standardization bit for bit; refusals.

Images run at the prefill only: the encoder call that writes the prompt encodes them, and every later call reads
the cache (`dew.nn.diffusion_gemma`). transformers is fed one row at a time, unpadded (its encoder counts
positions from the batch's first slot, Dew's from each row's first token).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data.inputs import ModelInputs
from dew.diffusion.block import BlockProcess
from dew.interop import load_pretrained
from dew.interop.processors import Processor
from dew.nn.diffusion_gemma import DiffusionGemma, PrefixCache
from tests.interop.test_diffusion_gemma import logit_tolerance
from tests.tolerances import assert_within, ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "diffusion-gemma-vision"
IMAGE = "<|image|>"
# a row with one image (6 soft tokens), a row with two (1 and 6), left-padded to the longer
PROMPTS = [f"token30 {IMAGE} token31", f"token40 {IMAGE} token41 {IMAGE} token42"]
CANVAS = 4


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", attention_impl="xla")


@pytest.fixture(scope="module")
def reference():
    return transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_processor(bundle):
    """transformers' `Gemma4Processor` the checkpoint's processor runs (built from its files, without the video
    processor, a torchvision class: tests/interop/test_gemma4.py)."""
    return bundle.processor.reference


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(904)
    draw = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noqa: E731
    return [[draw(32, 48)], [draw(16, 16), draw(48, 32)]]


@pytest.fixture(scope="module")
def inputs(bundle, images):
    return bundle.processor(PROMPTS, images=images)


def _their_row(hf_processor, row: int, images) -> dict:
    return dict(hf_processor(text=[PROMPTS[row]], images=[images[row]], padding=False, return_tensors="pt"))


def logit_bound(config, magnitude: float, seq_len: int) -> float:
    """The text model's bound (tests/interop/test_diffusion_gemma.py) plus what soft tokens carry in: Gemma 4's
    tower's rounding count over 280 padded patches (its sandwich norms, q/k/v norms, gated MLP, the pool and the
    standardization, as tests/interop/test_gemma4.py counts them) and the embedder's (a norm and a product over the
    tower's width), relative to their own size and carried forward at the logits'."""
    tower = config.vision.tower
    E = tower.hidden_size
    ulps = vision_tower_ulps(layers=tower.num_hidden_layers, width=E, mlp_width=tower.intermediate_size,
                             heads=tower.num_attention_heads, patches=280, patch_inputs=tower.patch_features)
    ulps += math.sqrt(6 * tower.num_hidden_layers * (2 * (2 * E + 4) + 3 * (2 * tower.head_dim + 4) + 1) + 6 * 8) + 8
    ulps += math.sqrt(6 * (3 * E + 4)) + 8
    return logit_tolerance(magnitude, seq_len) + ulp_bound(ulps, magnitude)


def test_the_checkpoint_processor_is_gemma4s(bundle, inputs, hf_processor, images):
    """`bundle.processor` is transformers' `Gemma4Processor` from the checkpoint's files (transformers maps
    diffusion_gemma to it): per row the ids, patch streams and patch positions of transformers' processor, the
    slots of image tokens marked by `image_indices` and their images by `image_groups`."""
    assert isinstance(bundle.processor, Processor) and isinstance(hf_processor, transformers.Gemma4Processor)
    mask = inputs.token_fields["attention_mask"]
    pixels, positions = inputs.conditioning["pixel_values"], inputs.conditioning["image_position_ids"]
    assert pixels.shape == (2, 2, 280, 192) and positions.shape == (2, 2, 280, 2)
    for row in range(2):
        theirs = _their_row(hf_processor, row, images)
        ids = theirs["input_ids"][0].numpy()
        np.testing.assert_array_equal(inputs.tokens[row][mask[row]], ids)
        np.testing.assert_array_equal(pixels[row, :len(images[row])], theirs["pixel_values"].numpy())
        np.testing.assert_array_equal(positions[row, :len(images[row])], theirs["image_position_ids"].numpy())
        np.testing.assert_array_equal(inputs.token_fields["image_indices"][row][mask[row]] >= 0, ids == 6)
        types = theirs["mm_token_type_ids"][0].numpy()
        np.testing.assert_array_equal(inputs.token_fields["image_groups"][row][mask[row]] >= 0, types == 1)


def _encode(model, variables, inputs, capacity, **media):
    """Dew's prefill of `inputs` (its images when `media` says so) into a fresh cache: (encoder logits, cache)."""
    cache = PrefixCache.empty(model.config, inputs.shape[0], capacity)
    valid = jnp.asarray(inputs.token_fields["attention_mask"])
    hidden, cache = model.apply(variables, jnp.asarray(inputs.tokens), valid, cache, 0, **media, method=model.encode)
    return np.asarray(model.apply(variables, hidden, method=model.logits)), cache


def _media(inputs) -> dict:
    return {**{name: jnp.asarray(inputs.conditioning[name]) for name in ("pixel_values", "image_position_ids")},
            **{name: jnp.asarray(inputs.token_fields[name]) for name in ("image_indices", "image_groups")}}


@pytest.mark.slow
def test_prefill_with_images_matches_transformers(bundle, reference, hf_processor, inputs, images):
    """Encoder logits over each row's prompt with its images, denoiser logits after it, then after a committed
    canvas, each row against transformers on that row alone. Largest differences observed: 1.6e-5 on encoder
    logits up to 4.3 (bound 1.0e-3), 5.5e-6 on the denoiser's up to 4.0 (bound 9.6e-4). The images, and their
    tokens reading each other in both directions, move the logits far past the bound."""
    from transformers.cache_utils import DynamicCache

    model, variables = bundle.model, {k: bundle.variables[k] for k in ("params", "constants")}
    B, S = inputs.shape
    rng = np.random.default_rng(0)
    committed, canvas = rng.integers(0, 128, (B, CANVAS)), rng.integers(0, 128, (B, CANVAS))
    denoise = jax.jit(lambda cache: model.apply(variables, jnp.asarray(canvas), cache, method=model.denoise))
    encoded, cache = _encode(model, variables, inputs, S + CANVAS, **_media(inputs))
    ours = [encoded, np.asarray(denoise(cache))]
    valid = jnp.ones((B, CANVAS), bool)
    hidden, cache = model.apply(variables, jnp.asarray(committed), valid, cache, S, method=model.encode)
    ours += [np.asarray(model.apply(variables, hidden, method=model.logits)), np.asarray(denoise(cache))]

    mask = np.asarray(inputs.token_fields["attention_mask"])
    for row in range(B):
        theirs_row = _their_row(hf_processor, row, images)
        length = theirs_row["input_ids"].shape[1]
        with torch.no_grad():
            their_cache = DynamicCache(config=reference.config.get_text_config(decoder=True))
            encoder = reference.model.encoder(**{k: v for k, v in theirs_row.items() if k != "attention_mask"},
                                              cache=their_cache)
            theirs = [30 * torch.tanh(reference.lm_head(encoder.last_hidden_state).float() / 30)[0].numpy(),
                      reference(cache=their_cache, decoder_input_ids=torch.tensor(canvas[row:row + 1])).logits[0]]
            positions = torch.arange(length, length + CANVAS)[None]
            encoder = reference.model.encoder(input_ids=torch.tensor(committed[row:row + 1]), cache=their_cache,
                                              position_ids=positions)
            theirs += [30 * torch.tanh(reference.lm_head(encoder.last_hidden_state).float() / 30)[0].numpy(),
                       reference(cache=their_cache, decoder_input_ids=torch.tensor(canvas[row:row + 1])).logits[0]]
        mine = [ours[0][row][mask[row]], ours[1][row], ours[2][row], ours[3][row]]
        for name, value, its in zip(("encoder", "denoiser", "encoder after a canvas", "denoiser after a canvas"),
                                    mine, theirs):
            its = np.asarray(its)
            assert np.abs(its).max() > 1.0
            assert_within(value, its, logit_bound(model.config, np.abs(its).max(), S + 2 * CANVAS), f"row {row} {name}")

    # the images reach the logits, and so does their reading each other in both directions
    blank = inputs.replace(conditioning={**inputs.conditioning, "pixel_values": np.zeros_like(
        inputs.conditioning["pixel_values"])})
    one_way = DiffusionGemma(dataclasses.replace(model.config, vision=dataclasses.replace(
        model.config.vision, bidirectional_images=False)))
    for other_model, other_inputs in ((model, blank), (one_way, inputs)):
        moved, _ = _encode(other_model, variables, other_inputs, S + CANVAS, **_media(other_inputs))
        assert np.abs(moved - ours[0])[mask].max() > 0.05, other_model.config.vision  # observed 6.5 and 5.0


@pytest.mark.slow
def test_block_generation_with_images_matches_transformers(bundle, reference, hf_processor, inputs, images):
    """Near-zero temperatures and a huge entropy bound make every draw the argmax (tests/diffusion/test_block.py):
    with Dew's first canvases handed to transformers, each row's generation from its prompt and images equals
    `generate` on that row, tokens and evaluation counts; images encoded once, at the prefill."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    process = BlockProcess(CANVAS, 128, t_max=2e-5, t_min=1e-5, entropy_bound=1e6, max_steps=6)
    new, key = 10, jax.random.key(5)
    task = dataclasses.replace(bundle.block_generation(), eos_token_ids=())
    ours = task(inputs, new, key=key, process=process)
    canvases = math.ceil(new / CANVAS)
    first = [np.asarray(process.noise(jax.random.split(jax.random.fold_in(key, block))[0], 2))
             for block in range(canvases)]
    original = reference._prepare_denoiser_inputs
    for row in range(2):
        handed = [canvas[row:row + 1] for canvas in first]

        def with_dew_canvas(*args, model_kwargs, **kwargs):
            model_kwargs["decoder_input_ids"] = torch.tensor(handed.pop(0))
            return original(*args, model_kwargs=model_kwargs, **kwargs)

        reference._prepare_denoiser_inputs = with_dew_canvas
        theirs_row = _their_row(hf_processor, row, images)
        try:
            with torch.no_grad():
                theirs = reference.generate(
                    **theirs_row, max_new_tokens=new, max_denoising_steps=6, t_min=1e-5, t_max=2e-5,
                    sampler_config=EntropyBoundSamplerConfig(entropy_bound=1e6), stability_threshold=1,
                    confidence_threshold=0.005, eos_token_id=None, pad_token_id=0)
        finally:
            reference._prepare_denoiser_inputs = original
        length = theirs_row["input_ids"].shape[1]
        generated = theirs.sequences[0, length:length + new].tolist()
        assert ours.continuations()[row] == generated
        passes = canvases * CANVAS / float(theirs.tokens_per_forward[0])
        assert int(ours.refinements[row]) == round(passes)


def test_save_reload_keeps_the_tower_and_the_processor(bundle, reference, tmp_path):
    """bundle.save writes the vision tower and embedder back under their names, the clipping bounds and the
    standardization included, beside processor_config.json: transformers reads the same numbers again, and Dew
    the same model with its processor."""
    saved = bundle.save(tmp_path / "saved")
    assert (saved / "processor_config.json").read_text() == (FIXTURE / "processor_config.json").read_text()
    again = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(saved, dtype=torch.float32)
    theirs = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    bounds = [name for name in theirs if name.endswith(("input_min", "std_scale"))]
    assert bounds and all(torch.isfinite(theirs[name]).all() for name in bounds)
    for name, tensor in {**dict(again.named_parameters()), **dict(again.named_buffers())}.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
    restored = load_pretrained(saved, dtype="float32", attention_impl="xla")  # the runtime knobs as loaded
    assert restored.model.config == bundle.model.config and isinstance(restored.processor, Processor)
    assert set(bundle.variables["constants"]) >= {"tower"}
    assert json.loads((saved / "config.json").read_text())["vision_config"] == json.loads(
        (FIXTURE / "config.json").read_text())["vision_config"]


def test_a_run_record_rebuilds_the_vision_side(bundle):
    """A block-diffusion run records the model's config as JSON (`dew.run_config.to_json`); the registry rebuilds the
    same model from it, its tower and projector by their registered kinds."""
    from dew import models
    from dew.run_config import to_json

    record = json.loads(json.dumps(to_json(bundle.model.config)))
    assert record["vision"]["tower_kind"] == "gemma4" and record["vision"]["image_token_id"] == 6
    assert models.build("diffusion_gemma", **record).config == bundle.model.config


def test_media_refusals(bundle, inputs):
    """What DiffusionGemma does not read is refused by name, before anything compiles."""
    task = bundle.block_generation()
    with pytest.raises(ValueError, match=r"\['audio_indices'\], which DiffusionGemma does not read"):
        task.media(inputs.replace(token_fields={**inputs.token_fields,
                                                "audio_indices": np.full(inputs.shape, -1, np.int32)}))
    with pytest.raises(ValueError, match=r"\['image_indices'\] place images, and these inputs carry no pixel_values"):
        task.media(inputs.replace(conditioning={}, token_fields={
            name: value for name, value in inputs.token_fields.items() if name != "image_groups"}))
    shifted = np.asarray(inputs.token_fields["positions"]) + 1
    with pytest.raises(ValueError, match="positions of row 0 are .* counts each real token's position"):
        task.media(inputs.replace(token_fields={**inputs.token_fields, "positions": shifted}))
    media = task.media(inputs)
    assert [len(values) for values in media["image_indices"]] == [len(p) for p in task.prompts(inputs)]
    text_only = DiffusionGemma(dataclasses.replace(bundle.model.config, vision=None))
    with pytest.raises(ValueError, match="no vision tower"):
        task.process.generate(text_only, bundle.variables, task.prompts(inputs), 4, key=jax.random.key(0),
                              media=media)
    with pytest.raises(ValueError, match=r"media image_groups have lengths \[3, 3\] for prompts of \[10, 14\] ids"):
        task.process.generate(bundle.model, bundle.variables, task.prompts(inputs), 4, key=jax.random.key(0),
                              media={**media, "image_groups": [values[:3] for values in media["image_groups"]]})
    assert task.media(ModelInputs.of(np.asarray([[30, 31]]))) is None  # text alone: no media
