"""Gemma 4 with images and audio against transformers' `Gemma4ForConditionalGeneration` on the same weights
(tests/fixtures/hf/gemma4-native-tiny, made by tools/make_gemma4_fixtures.py), in float32: the processor's layout
(padded patch streams with patch positions, vision groups, audio frames) against transformers' `Gemma4Processor`
and `from_ids` against it; logits of text-only rows, of image rows (images of other sizes, left padding, a video
placeholder read as the pad embedding), of audio rows and of rows mixing an image and a clip; cached greedy
continuations against `generate`; one SGD step; save -> transformers reload; the frozen clipping bounds and
standardization bit for bit the same after ten training steps and in the saved checkpoint.

`Gemma4Processor` also holds a video processor, which needs torchvision (its PyPI wheels are CUDA builds that do not
load beside the CPU torch these tests run on); the tests build transformers' own class with its PIL image processor,
its audio feature extractor and the fixture's tokenizer and no video processor (`hf_processor`), the check of that one
argument's class lifted while it is made."""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import traverse_util
from safetensors.numpy import load_file

from dew.data.dataset import Dataset
from dew.interop import load_pretrained
from dew.interop.families import family_of
from dew.interop.processors import Processor
from dew.nn.layer import CONSTANTS
from dew.objectives.lm import LMObjective
from dew.training import Layout, MeshSpec, Trainer
from tests.interop.multimodal_checks import (check_greedy_matches_generate, check_row_logits, check_save_reloads,
                                             check_stepped_logits, without_videos)
from tests.interop.test_gemma4_text import gemma4_ulps
from tests.tolerances import ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "gemma4-native-tiny"
IMAGE, AUDIO = "<|image|>", "<|audio|>"
# a text row, a row with one image, a row with two images of other sizes (1 and 6 soft tokens), left-padded
PROMPTS = ["token20 token21 token22", f"token30 {IMAGE} token31", f"token40 {IMAGE} token41 {IMAGE} token42"]
# the first holds a video placeholder (transformers' processor refuses one without a video, which Dew does not
# encode: the test writes its id in, and the slot keeps the pad embedding)
TEXT = ["token20 token21 token22 token23", "token30 token31"]
VIDEO_ID = 7
# a clip alone, and a row mixing an image and a clip
AUDIO_PROMPTS = [f"token50 {AUDIO} token51", f"token60 {IMAGE} token61 {AUDIO} token62"]


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", max_seq_len=96)


@pytest.fixture(scope="module")
def logits_of(bundle):
    """Dew's logits, compiled once for every call of the same shapes."""
    return jax.jit(lambda variables, tokens, fields: bundle.model.apply(variables, tokens, **fields))


@pytest.fixture(scope="module")
def hf_processor():
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(FIXTURE)
    image_processor = transformers.AutoImageProcessor.from_pretrained(FIXTURE, backend="pil")
    extractor = transformers.Gemma4AudioFeatureExtractor.from_pretrained(FIXTURE)
    return without_videos(transformers.Gemma4Processor, feature_extractor=extractor, image_processor=image_processor,
                          tokenizer=tokenizer)


@pytest.fixture(scope="module")
def processor(bundle, hf_processor):
    return Processor.of(hf_processor, bundle.model.config)


@pytest.fixture(scope="module")
def reference():
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                       attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(904)
    draw = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return [[], [draw(32, 48)], [draw(16, 16), draw(48, 32)]]  # 6 soft tokens; 1 and 6


@pytest.fixture(scope="module")
def clips():
    rng = np.random.default_rng(905)
    return [0.1 * rng.standard_normal(12000).astype(np.float32), 0.1 * rng.standard_normal(7000).astype(np.float32)]


def logit_bound(bundle, reference, magnitude: float, seq_len: int) -> float:
    """Gemma 4's text bound (tests/interop/test_gemma4_text.py) plus what soft tokens carry in: the vision tower's
    rounding count (tests/nn/test_vision_gemma4.py: its sandwich norms, the pool and the standardization) and the
    embedder's (a norm and a product over 32 terms), relative to their own size and carried forward at the
    logits'; the audio tower's rounding chain is of the same length (tests/nn/test_audio.py)."""
    text = types.SimpleNamespace(config=reference.config.text_config, model=reference.model.language_model)
    tower = bundle.model.config.tower
    E = tower.hidden_size
    ulps = vision_tower_ulps(layers=tower.num_hidden_layers, width=E, mlp_width=tower.intermediate_size,
                             heads=tower.num_attention_heads, patches=280, patch_inputs=tower.patch_features)
    ulps += np.sqrt(6 * tower.num_hidden_layers * (2 * (2 * E + 4) + 3 * (2 * tower.head_dim + 4) + 1) + 6 * 8) + 8
    return ulp_bound(gemma4_ulps(text, seq_len) + ulps + np.sqrt(6 * (3 * E + 4)) + 8, magnitude)


def _their_row(hf_processor, text, images=None, clips=None):
    media = {}
    if images:
        media["images"] = [images]
    if clips:
        media["audio"] = clips
    return dict(hf_processor(text=[text], padding=False, return_tensors="pt", **media))


def test_processor_lays_out_patch_streams_as_transformers_gives_them(processor, hf_processor, images, clips):
    """Token ids, patches, patch positions, soft-token indices and vision groups per row as transformers' processor
    gives them; the server's `from_ids` expands a prompt's placeholders into the same inputs."""
    inputs = processor(PROMPTS, images=images)
    mask = inputs.token_fields["attention_mask"]
    pixels, positions = inputs.conditioning["pixel_values"], inputs.conditioning["image_position_ids"]
    assert pixels.shape == (3, 2, 280, 192) and positions.shape == (3, 2, 280, 2)
    for row, (prompt, row_images) in enumerate(zip(PROMPTS, images)):
        theirs = _their_row(hf_processor, prompt, row_images)
        ids = theirs["input_ids"][0].numpy()
        np.testing.assert_array_equal(inputs.tokens[row][mask[row]], ids)
        if row_images:
            np.testing.assert_array_equal(pixels[row, :len(row_images)], theirs["pixel_values"].numpy())
            np.testing.assert_array_equal(positions[row, :len(row_images)], theirs["image_position_ids"].numpy())
        slots = inputs.token_fields["image_indices"][row][mask[row]]
        groups = inputs.token_fields["image_groups"][row][mask[row]]
        types_ = theirs["mm_token_type_ids"][0].numpy()
        np.testing.assert_array_equal(groups >= 0, (types_ == 1) | (types_ == 2))
        np.testing.assert_array_equal(slots >= 0, ids == 6)
    # image n's tokens read features n * 70 + k (280 padded patches pool to 70 tokens an image)
    row2 = inputs.token_fields["image_indices"][2]
    np.testing.assert_array_equal(row2[row2 >= 0], [0, *(70 + np.arange(6))])
    assert not pixels[1, 1].any() and (positions[1, 1] == -1).all()  # the one-image row's padding image
    assert (inputs.token_fields["image_groups"][0] < 0).all() and (inputs.token_fields["image_indices"][0] < 0).all()

    # a video placeholder (only ids can hold one) is a vision group of its own and reads no feature
    video = processor.from_ids([2, 20, VIDEO_ID, VIDEO_ID, 21])
    np.testing.assert_array_equal(video.tokens[0], [2, 20, VIDEO_ID, VIDEO_ID, 21])
    np.testing.assert_array_equal(video.token_fields["image_groups"][0], [-1, -1, 0, 0, -1])
    ours = processor.from_ids(processor.tokenizer(AUDIO_PROMPTS[1])["input_ids"], images[1], clips[1:])
    theirs = processor(AUDIO_PROMPTS[1:], images=[images[1]], audio=clips[1:])
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    for name in ("positions", "image_indices", "image_groups", "audio_indices"):
        np.testing.assert_array_equal(ours.token_fields[name], theirs.token_fields[name], err_msg=name)
    for name in theirs.conditioning:
        np.testing.assert_array_equal(ours.conditioning[name], theirs.conditioning[name], err_msg=name)
    with pytest.raises(ValueError, match=r"the texts hold 2 audio placeholder\(s\) '<\|audio\|>' and 1 waveform"):
        processor(AUDIO_PROMPTS, images=[[], images[1]], audio=clips[:1])
    with pytest.raises(ValueError, match="videos are not built"):
        processor(PROMPTS[:1], videos=[np.zeros((2, 16, 16, 3), np.uint8)])


def test_the_checkpoint_processor_is_transformers_class_without_videos(bundle, processor, images, clips):
    """`bundle.processor` builds transformers' `Gemma4Processor` from the checkpoint's files with no video processor
    (a torchvision class) and lays out what the processor built by hand lays out."""
    assert isinstance(bundle.processor.reference, transformers.Gemma4Processor)
    assert bundle.processor.reference.video_processor is None
    ours = bundle.processor(AUDIO_PROMPTS, images=[[], images[1]], audio=clips)
    theirs = processor(AUDIO_PROMPTS, images=[[], images[1]], audio=clips)
    np.testing.assert_array_equal(ours.tokens, theirs.tokens)
    for name in theirs.conditioning:
        np.testing.assert_array_equal(ours.conditioning[name], theirs.conditioning[name], err_msg=name)


@pytest.mark.parametrize("with_images", [True, False], ids=["images", "text"])
def test_logits_match_transformers(bundle, logits_of, processor, hf_processor, reference, images, with_images):
    """Image rows, and text rows the first of which reads a video placeholder as the pad embedding (as transformers'
    model does without video pixels). Largest differences observed: 1.2e-4 with images (logits up to 4.5, bound
    5.8e-4), 1.4e-6 text only (up to 4.3, bound 3.4e-4)."""
    prompts = PROMPTS if with_images else TEXT
    inputs = processor(prompts, images=images if with_images else None)
    their_rows = [_their_row(hf_processor, prompt, images[row] if with_images else None)
                  for row, prompt in enumerate(prompts)]
    if not with_images:  # the first row's third word becomes a video placeholder
        column = inputs.shape[1] - len(their_rows[0]["input_ids"][0]) + 2
        inputs = inputs.replace(tokens=np.asarray(inputs.tokens).copy())
        inputs.tokens[0, column] = VIDEO_ID
        their_rows[0]["input_ids"][0, 2] = VIDEO_ID
        their_rows[0]["mm_token_type_ids"][0, 2] = 2
    ours = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    bound = lambda magnitude, seq_len: logit_bound(bundle, reference, magnitude, seq_len)
    check_row_logits(ours, inputs, reference, their_rows, bound, 1.0)


def test_audio_and_mixed_rows_match_transformers(bundle, logits_of, processor, hf_processor, reference, images, clips):
    """A row with a clip of 12000 samples (19 encoded frames) and one with an image and a clip of 7000 (11), padded
    together to 74 frames: logits equal transformers' on each row alone (observed 3.0e-5 on logits up to 4.6, bound
    8.7e-4)."""
    inputs = processor(AUDIO_PROMPTS, images=[[], images[1]], audio=clips)
    assert inputs.conditioning["input_features"].shape == (2, 1, 74, 8)
    np.testing.assert_array_equal(inputs.conditioning["audio_lengths"], [1, 1])
    ours = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    their_rows = [_their_row(hf_processor, AUDIO_PROMPTS[0], None, clips[:1]),
                  _their_row(hf_processor, AUDIO_PROMPTS[1], images[1], clips[1:])]
    bound = lambda magnitude, seq_len: logit_bound(bundle, reference, magnitude, seq_len)
    check_row_logits(ours, inputs, reference, their_rows, bound, 1.0)


def test_cached_greedy_continuation_matches_generate(bundle, processor, hf_processor, reference, images):
    check_greedy_matches_generate(bundle, processor(PROMPTS, images=images), reference,
                                  [_their_row(hf_processor, prompt, images[row]) for row, prompt in enumerate(PROMPTS)])


def _their_mean_loss(model, their_rows, inputs):
    """transformers' mean cross entropy over the targets LMObjective scores (real, not a soft token of an image or
    a clip), each row fed alone."""
    valid = np.asarray(inputs.token_fields["attention_mask"])
    fields = inputs.token_fields
    soft = (np.asarray(fields["image_indices"]) >= 0) | (np.asarray(fields["audio_indices"]) >= 0)
    weights = valid[:, :-1] & valid[:, 1:] & ~soft[:, 1:] & (np.asarray(inputs.tokens)[:, 1:] != 0)
    total = 0
    for row, theirs in enumerate(their_rows):
        logits = model(**theirs).logits[0]
        ids = theirs["input_ids"][0]
        ce = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
        total = total + (ce * torch.tensor(weights[row][valid[row][:-1]], dtype=torch.float32)).sum()
    return total / float(weights.sum())


@pytest.fixture(scope="module")
def trained(bundle, processor, images, clips):
    """(the batch of a clip's row and an image-and-clip row, the trainer's state after one SGD step of rate 1e-2
    on it, after ten): one trainer, its step compiled once."""
    inputs = processor(AUDIO_PROMPTS, images=[[], images[1]], audio=clips)
    objective = LMObjective(bundle.model, inputs.tokens.shape[1] - 1, pretrained=bundle.variables, ema_decay=None,
                            pad_id=0)
    trainer = Trainer(objective, optax.sgd(1e-2), key=jax.random.key(3), mesh=MeshSpec(),
                      layout=Layout(min_shard=2**30))
    states = [trainer.fit(Dataset(train=lambda partition, n=n: iter([{"text": inputs}] * n), val=None, records=2,
                                  batch=2), steps=n, log_every=n) for n in (1, 10)]
    return inputs, *states


def test_one_sgd_step_matches_transformers(bundle, logits_of, hf_processor, reference, images, clips, trained):
    """The trainer's step on the mean cross entropy `LMObjective` scores over a `{"text": inputs}` batch of audio and
    image rows, and transformers' SGD step (rate 1e-2) on the same loss: the stepped logits agree (observed 4.1e-4
    on logits up to 4.6, bound 1.7e-3: twice the forward bound, the step's own difference being the gradients'
    rounding times the rate), and the step moved them."""
    inputs, state, _ = trained
    ours = np.asarray(logits_of(state.params, inputs.tokens, inputs.kwargs()))
    before = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    stepped = transformers.Gemma4ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                          attn_implementation="eager")
    their_rows = [_their_row(hf_processor, AUDIO_PROMPTS[0], None, clips[:1]),
                  _their_row(hf_processor, AUDIO_PROMPTS[1], images[1], clips[1:])]
    _their_mean_loss(stepped, their_rows, inputs).backward()
    check_stepped_logits(stepped, ours, before, inputs, their_rows,
                         lambda magnitude, seq_len: 2 * logit_bound(bundle, reference, magnitude, seq_len))


def test_save_reloads_in_transformers(bundle, hf_processor, reference, images, clips, tmp_path):
    row = _their_row(hf_processor, AUDIO_PROMPTS[1], images[1], clips[1:])
    check_save_reloads(bundle, transformers.Gemma4ForConditionalGeneration, reference, row, FIXTURE, tmp_path / "saved")


def test_constants_stay_frozen_through_training_and_saving(bundle, trained, tmp_path):
    """Ten SGD steps of the trainer on a batch of image and audio rows leave every clipping bound, the vision
    tower's standardization and the layer scalars bit for bit as loaded, while the parameters move; the saved
    checkpoint holds them bit for bit as the source does."""
    _, _, state = trained
    flat = lambda tree: traverse_util.flatten_dict(jax.device_get(tree))
    trained_constants, loaded = flat(state.params[CONSTANTS]), flat(bundle.variables[CONSTANTS])
    assert sorted(trained_constants) == sorted(loaded)
    assert any("audio_tower" in path for path in loaded) and any("std_scale" in path for path in loaded)
    for path, value in loaded.items():
        np.testing.assert_array_equal(trained_constants[path], value, err_msg="/".join(path))
    for part in ("tower", "audio_tower"):  # both towers trained
        before, after = flat(bundle.variables["params"][part]), flat(state.params["params"][part])
        assert max(np.abs(after[path] - before[path]).max() for path in before) > 1e-4

    saved = load_file(bundle.save(tmp_path / "trained", variables=state.params) / "model.safetensors")
    source = load_file(FIXTURE / "model.safetensors")
    frozen = [name for name in source if name.endswith(("_min", "_max", "std_bias", "std_scale", "layer_scalar"))]
    assert len(frozen) > 40
    for name in frozen:
        assert saved[name].shape == source[name].shape, name
        np.testing.assert_array_equal(saved[name], source[name], err_msg=name)


@pytest.mark.parametrize("change, message", [
    (lambda config: config["text_config"].update(pad_token_id=3), "pad_token_id is 3"),
    (lambda config: config["text_config"].update(use_bidirectional_attention="all"), "'all'"),
    (lambda config: config["vision_config"].update(attention_bias=True), "attention_bias"),
    (lambda config: config["audio_config"].update(conf_num_hidden_layers=2), "conf_num_hidden_layers"),
    (lambda config: config.update(mm_tokens_per_image=256), "mm_tokens_per_image"),
])
def test_config_refusals_name_the_field(change, message):
    """A gemma4 config.json whose fields Dew would compute otherwise is refused, naming the field."""
    config = json.loads((FIXTURE / "config.json").read_text())
    change(config)
    with pytest.raises(ValueError, match=message):
        family_of(config).model_config(config)
