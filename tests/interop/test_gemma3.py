"""Gemma 3 with images against transformers' `Gemma3ForConditionalGeneration` on the same weights
(tests/fixtures/hf/gemma3-native-tiny, made by tools/make_multimodal_fixtures.py), in float32: logits of
text-only and image batches (rows with one and two images, left padding), the processor's layout,
cached greedy continuations, the gradient with respect to the pixels, one SGD step, and save and reload."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data.dataset import Dataset
from dew.interop import load_pretrained
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling
from dew.training import Layout, MeshSpec, Trainer
from tests.compiled import compiled
from tests.interop.conftest import in_torch_memory
from tests.tolerances import LIBRARY_ULPS, assert_within, decoder_ulps, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "gemma3-native-tiny"
PROMPTS = ["token7 <start_of_image> token9", "token5 <start_of_image> token8 <start_of_image> token6"]
TEXT = ["token7 token9 token11", "token5 token8"]


def logit_bound(magnitude: float, seq_len: int) -> float:
    """fp32 Dew against transformers on the fixture: the text decoder's chain (2 layers, width 64, MLP 128,
    4 heads of 16; `decoder_ulps`, whose per-layer count also covers Gemma's two extra sandwich norms
    at about `width + 3` roundings each, added here, and the final softcap's tanh), plus what an image's
    soft tokens carry in: the tower (2 pre-LayerNorm blocks of width 32, MLP 64, 4 heads of 8 over 4
    patches, no rotation: `decoder_ulps` with no rotary error, plus two LayerNorms' mean and variance,
    `2 * (32 + 3)` each, and the 3 * 14 * 14-term patch convolution) and the projector (an RMS norm and a
    32-term product)."""
    width = 64
    text = decoder_ulps(layers=2, width=width, mlp_width=128, heads=4, head_dim=16, seq_len=seq_len)
    text += math.sqrt(6 * 2 * 2 * (width + 3)) + LIBRARY_ULPS
    tower = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=4, frequency_ulps=0.0)
    tower += math.sqrt(6 * (2 * 2 * 2 * (32 + 3) + 3 * 14 * 14 + (32 + 3) + 32))
    return ulp_bound(text + tower, magnitude)


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", max_seq_len=64)


@pytest.fixture(scope="module")
def reference():
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                         attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def hf_processor():
    return transformers.AutoProcessor.from_pretrained(FIXTURE, local_files_only=True, backend="pil")


@pytest.fixture(scope="module")
def images():
    raw = np.load(FIXTURE / "raw_images.npy")
    return [[raw[0]], [raw[1], raw[2]]]


def _their_row(hf_processor, text, images):
    """transformers' processor output for one unpadded row, as torch tensors."""
    return hf_processor(text=[text], images=None if images is None else [images], return_tensors="pt")


def _their_logits(reference, row):
    with torch.no_grad():
        return reference(**row).logits[0].numpy()


def test_processor_lays_out_what_transformers_gives(bundle, hf_processor, images):
    inputs = bundle.processor(PROMPTS, images=images)
    theirs = hf_processor(text=PROMPTS, images=images, padding=True, return_tensors="np")
    np.testing.assert_array_equal(inputs.tokens, theirs["input_ids"])
    np.testing.assert_array_equal(inputs.token_fields["attention_mask"], theirs["attention_mask"].astype(bool))
    is_image = theirs["token_type_ids"] == 1
    np.testing.assert_array_equal(inputs.token_fields["image_groups"] >= 0, is_image)
    np.testing.assert_array_equal(inputs.token_fields["image_indices"] >= 0, is_image)
    # the second row's second image reads soft tokens 4..7 of that row, as group 1
    row = inputs.token_fields["image_indices"][1]
    np.testing.assert_array_equal(row[row >= 4], np.arange(4, 8))
    pixels = inputs.conditioning["pixel_values"]
    assert pixels.shape == (2, 2, 3, 28, 28)
    np.testing.assert_array_equal(pixels[0, 0], theirs["pixel_values"][0])
    np.testing.assert_array_equal(pixels[1], theirs["pixel_values"][1:])
    assert not pixels[0, 1].any()  # the shorter row's missing image is zeros, read by no slot
    expected_positions = np.maximum(np.cumsum(theirs["attention_mask"], axis=1) - 1, 0)
    np.testing.assert_array_equal(inputs.token_fields["positions"], expected_positions)


def test_text_without_padding_has_no_mask(bundle):
    inputs = bundle.processor(["token7 token9", "token5 token8"])
    assert "attention_mask" not in inputs.token_fields
    assert not inputs.conditioning


def test_placeholders_and_images_must_agree(bundle, images):
    with pytest.raises(ValueError, match=r"row 0 has 1 image placeholder\(s\) '<start_of_image>' and 2 image"):
        bundle.processor(PROMPTS[:1], images=[images[1]])
    with pytest.raises(ValueError, match="one list of images per text"):
        bundle.processor(PROMPTS, images=images[:1])


@pytest.mark.parametrize("with_images", [True, False], ids=["images", "text"])
def test_logits_match_transformers(bundle, reference, hf_processor, images, with_images):
    prompts = PROMPTS if with_images else TEXT
    inputs = bundle.processor(prompts, images=images if with_images else None)
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, inputs.tokens, **inputs.kwargs()))
    mask = inputs.token_fields.get("attention_mask", np.ones(inputs.shape, bool))
    for row, prompt in enumerate(prompts):
        theirs = _their_logits(reference, _their_row(hf_processor, prompt, images[row] if with_images else None))
        mine = ours[row][np.asarray(mask[row])]
        # largest difference observed: 5.2e-6 with images, 1.9e-6 text only, on logits up to 10.9 (bounds 7e-4 to 1.5e-3)
        assert_within(mine, theirs, logit_bound(np.abs(theirs).max(), inputs.shape[1]), f"row {row}")


def test_cached_greedy_continuation_matches_generate(bundle, reference, hf_processor, images):
    inputs = bundle.processor(PROMPTS, images=images)
    task = bundle.text_generation(sampling=Sampling(temperature=0))
    result = task(inputs, 3, seed=1)
    for row, prompt in enumerate(PROMPTS):
        theirs = _their_row(hf_processor, prompt, images[row])
        with torch.no_grad():
            generated = reference.generate(**theirs, do_sample=False, max_new_tokens=3)
        assert result.continuations()[row] == generated[0, theirs["input_ids"].shape[1]:].tolist()
    assert all(text.startswith("token") for text in result.text)


def _loss_inputs(inputs):
    """The rows' target weights as LMObjective counts them: real, not padding id 0, not an image token."""
    tokens = np.asarray(inputs.tokens)
    valid = np.asarray(inputs.token_fields["attention_mask"])
    image = np.asarray(inputs.token_fields["image_indices"]) >= 0
    weights = valid[:, :-1] & valid[:, 1:] & ~image[:, 1:] & (tokens[:, 1:] != 0)
    return tokens, weights


def _their_loss(reference, inputs, pixel_values):
    """transformers' mean cross entropy over the same targets, the batch padded as Dew pads it."""
    tokens, weights = _loss_inputs(inputs)
    valid = torch.tensor(np.asarray(inputs.token_fields["attention_mask"]), dtype=torch.long)
    positions = torch.tensor(np.asarray(inputs.token_fields["positions"]), dtype=torch.long)
    token_type = torch.tensor((np.asarray(inputs.token_fields["image_indices"]) >= 0).astype(np.int64))
    logits = reference(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=valid,
                       position_ids=positions, pixel_values=pixel_values, token_type_ids=token_type).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1), reduction="none")
    w = torch.tensor(weights, dtype=torch.float32).reshape(-1)
    return (ce * w).sum() / w.sum()


def _flat_pixels(inputs):
    """The images the processor padded to `[B, images, ...]`, flattened as transformers takes them."""
    pixels = np.asarray(inputs.conditioning["pixel_values"])
    counts = [int(np.asarray(inputs.token_fields["image_groups"])[row].max()) + 1 for row in range(pixels.shape[0])]
    return np.concatenate([pixels[row, :count] for row, count in enumerate(counts)]), counts


def test_pixel_gradient_matches_transformers(bundle, reference, images):
    inputs = bundle.processor(PROMPTS, images=images)
    tokens, weights = _loss_inputs(inputs)

    def loss(pixel_values):
        fields = {**inputs.kwargs(), "pixel_values": pixel_values}
        logits = bundle.model.apply(bundle.variables, inputs.tokens, **fields)[:, :-1]
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
        return jnp.sum(ce * weights) / weights.sum()

    ours = np.asarray(compiled(jax.grad(loss), jnp.asarray(inputs.conditioning["pixel_values"])))
    flat, counts = _flat_pixels(inputs)
    pixels = torch.tensor(flat, requires_grad=True)
    _their_loss(reference, inputs, pixels).backward()
    theirs = pixels.grad.numpy()
    mine = np.concatenate([ours[row, :count] for row, count in enumerate(counts)])
    assert not ours[0, 1].any()  # the padding image reaches no slot
    # the same chain of roundings backwards: the logits' bound relative to the gradient's size (largest
    # observed 1.8e-7 on gradients up to 0.18, bound 2.4e-5)
    assert_within(mine, theirs, logit_bound(np.abs(theirs).max(), inputs.shape[1]), "pixel gradient")


def test_one_sgd_step_matches_transformers(bundle, reference, images):
    """The guide's continue-training path: `{"text": inputs}` batches through LMObjective and the Trainer."""
    inputs = bundle.processor(PROMPTS, images=images)
    objective = LMObjective(bundle.model, inputs.tokens.shape[1] - 1, pretrained=bundle.variables, ema_decay=None,
                            pad_id=0)
    data = Dataset(train=lambda partition: iter([{"text": inputs}]), val=None, records=2, batch=2)
    trainer = Trainer(objective, optax.sgd(1e-2), key=jax.random.key(3), mesh=MeshSpec(), layout=Layout(min_shard=2**30))
    state = trainer.fit(data, steps=1, log_every=1)

    stepped = transformers.Gemma3ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                          attn_implementation="eager")
    flat, _ = _flat_pixels(inputs)
    _their_loss(stepped, inputs, torch.tensor(flat)).backward()
    with torch.no_grad():
        for parameter in stepped.parameters():
            if parameter.grad is not None:
                parameter -= 1e-2 * parameter.grad
    ours = np.asarray(compiled(bundle.model.apply, state.params, inputs.tokens, **inputs.kwargs()))
    before = np.asarray(compiled(bundle.model.apply, bundle.variables, inputs.tokens, **inputs.kwargs()))
    mask = np.asarray(inputs.token_fields["attention_mask"])
    hf = transformers.AutoProcessor.from_pretrained(FIXTURE, local_files_only=True, backend="pil")
    for row, prompt in enumerate(PROMPTS):
        theirs = _their_logits(stepped, _their_row(hf, prompt, images[row]))
        assert np.abs(ours[row][mask[row]] - before[row][mask[row]]).max() > 1e-3  # the step moved the logits
        # largest difference observed 3.3e-6, on logits up to 10.7
        assert_within(ours[row][mask[row]], theirs, logit_bound(np.abs(theirs).max(), inputs.shape[1]), f"row {row}")


def test_save_reloads_in_transformers(bundle, reference, hf_processor, images, tmp_path):
    saved = bundle.save(tmp_path / "saved")
    assert (saved / "processor_config.json").is_file() and (saved / "tokenizer.json").is_file()
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(saved, dtype=torch.float32,
                                                                        attn_implementation="eager")
    row = _their_row(hf_processor, PROMPTS[1], images[1])
    np.testing.assert_array_equal(_their_logits(in_torch_memory(again), row),
                                  _their_logits(in_torch_memory(reference), row))
    reloaded = load_pretrained(saved, dtype="float32", max_seq_len=64)
    inputs = reloaded.processor(PROMPTS, images=images)
    np.testing.assert_array_equal(np.asarray(compiled(reloaded.model.apply, reloaded.variables, inputs.tokens, **inputs.kwargs())),
                                  np.asarray(compiled(bundle.model.apply, bundle.variables, inputs.tokens, **inputs.kwargs())))


def test_unknown_field_refused_by_name(tmp_path):
    directory = tmp_path / "edited"
    shutil.copytree(FIXTURE, directory)
    config = json.loads((directory / "config.json").read_text())
    config["vision_config"]["num_positions_extra"] = 3
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_positions_extra"):
        load_pretrained(directory)
    config = json.loads((FIXTURE / "config.json").read_text())
    config["mm_tokens_per_image"] = 3
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        load_pretrained(directory)


def test_lora_on_the_language_model(bundle, images):
    """Adapters inside `language_model` only (the tower's attention has q/k/v projections of the same
    names), trained one step through the Trainer; merged, they give the adapted model's logits."""
    from dew.nn.lora import LoRA, adapters

    lora = LoRA(rank=2, within="language_model")
    adapted = lora.adapt(bundle.model)
    inputs = bundle.processor(PROMPTS, images=images)
    start = adapted.attach(jax.random.key(1), bundle.variables)
    found = jax.tree_util.tree_leaves_with_path(adapters(start))
    assert found and all("language_model" in jax.tree_util.keystr(path) for path, _ in found)
    objective = LMObjective(adapted, inputs.tokens.shape[1] - 1, pretrained=start, ema_decay=None, pad_id=0,
                            trainable=lora.trainable)
    data = Dataset(train=lambda partition: iter([{"text": inputs}]), val=None, records=2, batch=2)
    state = Trainer(objective, optax.sgd(1e-1), key=jax.random.key(3), mesh=MeshSpec(),
                    layout=Layout(min_shard=2**30)).fit(data, steps=1, log_every=1)
    tower = lambda variables: variables["params"]["tower"]
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, tower(state.params), tower(bundle.variables)))
    trained = np.asarray(compiled(adapted.apply, state.params, inputs.tokens, **inputs.kwargs()))
    merged = np.asarray(compiled(bundle.model.apply, adapted.merge(state.params), inputs.tokens, **inputs.kwargs()))
    base = np.asarray(compiled(bundle.model.apply, bundle.variables, inputs.tokens, **inputs.kwargs()))
    assert np.abs(trained - base).max() > 1e-4  # the adapters moved
    # merging folds x A B into x W, which rounds each adapted product once more or less: at most the
    # decoder's own chain of roundings in another order (one library; largest observed 4.2e-6 on logits to 9.8)
    ulps = decoder_ulps(layers=2, width=64, mlp_width=128, heads=4, head_dim=16, seq_len=inputs.shape[1], libraries=1)
    np.testing.assert_allclose(merged, trained, atol=ulp_bound(ulps, np.abs(trained).max()), rtol=0)
