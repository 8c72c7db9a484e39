"""Gemma 3n against transformers' `Gemma3nForConditionalGeneration` on the same weights
(tests/fixtures/hf/gemma3n-native-tiny, made by tools/make_gemma3n_fixtures.py), in float32: logits of text-only,
image, audio and mixed batches (rows with one and two images, clips of other lengths, left padding, ids of both
embedders' hard ranges), cached greedy continuations against `generate`, one SGD step through `LMObjective`, and
save -> transformers reload.

transformers builds the vision tower through `TimmWrapperModel`, which refuses to start without torchvision; the
oracle is built and reloaded inside `timm_wrapper_without_torchvision` (tests/interop/timm_oracle.py), which lifts
that one check and hands the wrapper timm imported over stand-in torchvision modules: the model is the one the
wrapper builds anywhere, timm's encoder under `timm_model`."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.objectives.lm import LMObjective
from dew.training.state import Step
from tests.interop.multimodal_checks import (check_greedy_matches_generate, check_row_logits, check_save_reloads,
                                             check_stepped_logits, targets)
from tests.interop.test_gemma3n_text import gemma3n_ulps
from tests.interop.test_gemma3n_vision import _tower_ulps
from tests.interop.timm_oracle import import_timm, timm_wrapper_without_torchvision
from tests.nn.test_audio import _conformer_ulps
from tests.tolerances import LIBRARY_ULPS, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
try:
    import_timm()
except ImportError as error:
    pytest.skip(str(error), allow_module_level=True)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "gemma3n-native-tiny"
IMAGE = "<image_soft_token>"
# token130 lies in the vision embedder's hard range, token140 and <end_of_audio> in the audio one's
PROMPTS = [f"token7 {IMAGE} token9 token130", f"token5 {IMAGE} token8 {IMAGE} token140 <end_of_audio> token11"]
TEXT = ["token7 token130 token9 token141 token12", "token5 <end_of_image> token8"]
AUDIO = "<audio_soft_token>"
SPOKEN = [f"token7 {AUDIO} token9 token12", f"token5 {IMAGE} token8 {AUDIO} token11 {AUDIO} token140"]


class _Reference:
    """transformers' Gemma3nForConditionalGeneration, built and reloaded with timm's wrapper allowed (see the
    module); `from_pretrained` as the shared checks call it."""

    @staticmethod
    def from_pretrained(directory, **options):
        with timm_wrapper_without_torchvision():
            return transformers.Gemma3nForConditionalGeneration.from_pretrained(directory, **options).eval()


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", max_seq_len=64)


@pytest.fixture(scope="module")
def logits_of(bundle):
    """Dew's logits, compiled once for every call of the same shapes."""
    return jax.jit(lambda variables, tokens, fields: bundle.model.apply(variables, tokens, **fields))


@pytest.fixture(scope="module")
def reference():
    return _Reference.from_pretrained(FIXTURE, dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(903)
    return [[rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)],
            [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)]]


def logit_bound(bundle, reference, magnitude: float, seq_len: int, audio: bool = False) -> float:
    """The text decoder's chain (`gemma3n_ulps`, tests/interop/test_gemma3n_text.py) plus what a soft token carries
    in, relative to its size and carried forward at the logits': the vision tower's rounding count (`_tower_ulps`,
    tests/interop/test_gemma3n_vision.py), with `audio` the audio tower's (`_conformer_ulps`, tests/nn/test_audio.py,
    whose Gemma 3n config the fixture's is), and the embedder's (two RMSNorms, over 2048 and the text width, a
    2048-term projection, the scaling; an rsqrt each)."""
    hidden, text = 2048, bundle.model.config.emb_features
    embedder = math.sqrt(6 * (2 * (2 * hidden + 4) + hidden + 2 * text + 4 + 1)) + 2 * LIBRARY_ULPS
    ulps = gemma3n_ulps(reference.model.language_model, seq_len) + _tower_ulps(bundle.model.config.tower) + embedder
    if audio:
        ulps += _conformer_ulps(bundle.model.config.audio.tower, "gemma3n_audio")
    return ulp_bound(ulps, magnitude)


def _their_row(bundle, text, images, clips=None):
    """transformers' processor output for one unpadded row, as torch tensors."""
    media = {"images": [images] if images else None, "audio": clips or None}
    return dict(bundle.processor.reference(text=[text], text_kwargs={"padding": False}, return_tensors="pt", **media))


def test_processor_lays_out_the_expansion(bundle, images):
    inputs = bundle.processor(PROMPTS, images=images)
    tokens, mask = inputs.tokens, inputs.token_fields["attention_mask"]
    # each image: <start_of_image>, 4 soft tokens, <end_of_image> (a hard vision id)
    np.testing.assert_array_equal(tokens[1][mask[1]], [5, 120, *[129] * 4, 128, 8, 120, *[129] * 4, 128, 140, 136, 11])
    np.testing.assert_array_equal(inputs.token_fields["image_indices"][1][tokens[1] == 129], np.arange(8))
    assert inputs.conditioning["pixel_values"].shape == (2, 2, 3, 64, 64)
    assert bundle.model.config.tower.image_size == 64  # read from the processor's files


@pytest.mark.parametrize("with_images", [True, False], ids=["images", "text"])
def test_logits_match_transformers(bundle, logits_of, reference, images, with_images):
    """fp32, left-padded rows (observed: 5.8e-5 with images, bound 6.7e-4; 2.8e-6 text only, bound 4.5e-4; on logits
    up to 3.4)."""
    prompts = PROMPTS if with_images else TEXT
    inputs = bundle.processor(prompts, images=images if with_images else None)
    ours = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    their_rows = [_their_row(bundle, prompt, images[row] if with_images else None) for row, prompt in enumerate(prompts)]
    check_row_logits(ours, inputs, reference, their_rows,
                     lambda magnitude, seq_len: logit_bound(bundle, reference, magnitude, seq_len), 1.0)


@pytest.fixture(scope="module")
def clips():
    """Three 16 kHz clips of about 0.4 s and twice 0.18 s: 5 and 3 of the 6 encoded frames a clip's slots hold. None is
    a multiple of 128 samples: transformers' processor pads a clip to a multiple of 128 samples before the log-mel and
    keeps the last part-frame its samples reach, which Dew's processor gives each clip alone (16 mel frames from 2,900
    samples, where an unpadded extractor gives 15). The two of a row are as long: transformers pads a row's shorter
    clips to its longest and counts those zero frames as the clip's own (valid in its mask), so a clip's encoding
    there depends on the others in its row; Dew encodes each clip as it would be alone."""
    rng = np.random.default_rng(7)
    return [0.3 * rng.standard_normal(n).astype(np.float32) for n in (6350, 2900, 2900)]


def test_audio_and_mixed_logits_match_transformers(bundle, logits_of, reference, images, clips):
    """fp32: a row with one clip beside one with an image and two clips; each clip's 6 slots read its encoded frames
    and then the padding embedding; the second row's clips are padded to the call's longest (observed: 2.5e-6 and
    2.4e-5 on logits up to 3.9, bounds 1.2e-3 and 1.0e-3)."""
    inputs = bundle.processor(SPOKEN, images=[[], images[0]], audio=clips)
    assert inputs.conditioning["input_features"].shape[:2] == (2, 2)
    slots = inputs.token_fields["audio_indices"][1][inputs.tokens[1] == 137]
    np.testing.assert_array_equal(slots, np.arange(12))  # two clips of 6 slots each
    ours = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    their_rows = [_their_row(bundle, SPOKEN[0], None, clips[:1]), _their_row(bundle, SPOKEN[1], images[0], clips[1:])]
    check_row_logits(ours, inputs, reference, their_rows,
                     lambda magnitude, seq_len: logit_bound(bundle, reference, magnitude, seq_len, audio=True), 1.0)


def test_a_clip_longer_than_its_slots_is_refused(bundle):
    """One second of audio encodes to 13 frames, past the 6 slots a clip fills (transformers cannot place them)."""
    with pytest.raises(ValueError, match=r"audio clip 0 encodes to 13 frames; the model reads 6 soft tokens a clip"):
        bundle.processor(SPOKEN[:1], audio=[np.zeros(16_000, np.float32)])


def test_cached_greedy_continuation_matches_generate(bundle, reference, images):
    """Prefill with images, then decode steps whose ids embed through the decoder's table or an embedder's."""
    check_greedy_matches_generate(bundle, bundle.processor(PROMPTS, images=images), reference,
                                  [_their_row(bundle, prompt, images[row]) for row, prompt in enumerate(PROMPTS)])


def _their_loss(model, inputs, images):
    """transformers' mean cross entropy over the targets LMObjective scores, the batch padded as Dew pads it."""
    tokens, weights = targets(inputs)
    fields = inputs.token_fields
    flat = np.concatenate([np.asarray(inputs.conditioning["pixel_values"])[row, :len(row_images)]
                           for row, row_images in enumerate(images)])
    logits = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                   attention_mask=torch.tensor(np.asarray(fields["attention_mask"]), dtype=torch.long),
                   position_ids=torch.tensor(np.asarray(fields["positions"]), dtype=torch.long),
                   pixel_values=torch.tensor(flat)).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                           torch.tensor(tokens[:, 1:], dtype=torch.long).reshape(-1), reduction="none")
    w = torch.tensor(weights, dtype=torch.float32).reshape(-1)
    return (ce * w).sum() / w.sum()


def test_one_sgd_step_matches_transformers(bundle, logits_of, images):
    """`LMObjective`'s mean cross entropy on a `{"text": inputs}` batch, differentiated for every weight (tower and
    embedders included): one SGD step (rate 1e-2) gives transformers' stepped model's logits. transformers never trains
    the per-layer table's padding row, which the placeholders and hard ids read: a step that moved it would show here.

    The step moves this model's logits by up to 5, so the gradients' own rounding shows in the stepped logits beside the
    forward pass's bound (7.6e-4). The vision tower's batch-norm weights take gradients summed over every pixel of
    terms that mostly cancel: Dew's and transformers' differ by up to 2.1e-4 of the tensor's largest (measured on an
    AVX2 EPYC, where XLA's sums round otherwise than with AVX-512), so each side may carry up to about 5e-4 of its
    gradient in rounding, 1e-3 together: that fraction of the step's move is added. Observed: 1.0e-4 on the Xeon
    (AVX-512), 2.1e-3 on the EPYC, on stepped logits up to 3.6 moved by up to 5.0 (bound 5.7e-3)."""
    inputs = bundle.processor(PROMPTS, images=images)
    objective = LMObjective(bundle.model, inputs.tokens.shape[1] - 1, pretrained=bundle.variables, ema_decay=None,
                            pad_id=0)
    step = Step(jnp.int32(0), jax.random.key(3))

    def mean_loss(variables):
        total, count = objective.reduce_loss(objective.loss(variables, {"text": inputs}, step)[0])
        return total / count

    grads = jax.jit(jax.grad(mean_loss))(bundle.variables)
    stepped = _Reference.from_pretrained(FIXTURE, dtype=torch.float32, attn_implementation="eager")
    _their_loss(stepped, inputs, images).backward()
    moved = jax.tree.map(lambda value, grad: value - 1e-2 * grad, bundle.variables, grads)
    ours = np.asarray(logits_of(moved, inputs.tokens, inputs.kwargs()))
    before = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    check_stepped_logits(stepped, ours, before, inputs,
                         [_their_row(bundle, prompt, images[row]) for row, prompt in enumerate(PROMPTS)],
                         lambda magnitude, seq_len: logit_bound(bundle, stepped, magnitude, seq_len),
                         gradient_rounding=1e-3)


def test_save_reloads_in_transformers(bundle, reference, images, tmp_path):
    check_save_reloads(bundle, _Reference, reference, _their_row(bundle, PROMPTS[1], images[1]), FIXTURE,
                       tmp_path / "saved")


def test_config_fields_refused_by_name(bundle):
    """Fields Dew does not compute are refused by name, before any weight is read."""
    from dew.interop.families import FAMILIES

    family, source = FAMILIES["gemma3n"], bundle.config
    with pytest.raises(ValueError, match="vision_soft_tokens_per_image"):
        family.model_config({**source, "vision_soft_tokens_per_image": 9})
    with pytest.raises(ValueError, match="audio_config"):
        family.model_config({**source, "audio_config": {**source["audio_config"], "vocab_offset": 140}})
    with pytest.raises(ValueError, match="'mm_tokens_per_image'"):
        family.model_config({**source, "mm_tokens_per_image": 4})
