"""Qwen 3.5 with images against transformers' `Qwen3_5ForConditionalGeneration` on the same weights
(tests/fixtures/hf/qwen3_5-native-tiny, made by tools/make_qwen35_fixtures.py), in float32: the processor's
layout (patch vectors padded per image, grids, three-axis positions) against transformers' `Qwen3VLProcessor`
and `get_rope_index`, chat prompt ids with image placeholders served by `dew.serve.Engine`, logits of text-only and image batches (one image; two images of other grids; left
padding), cached greedy continuations, the pixel gradient and one SGD step through `LMObjective`, and save ->
transformers reload.

`Qwen3VLProcessor` also holds a video processor, which needs torchvision (its PyPI wheels are CUDA builds
that do not load beside the CPU torch these tests run on); the tests build transformers' own class with its
PIL image processor and the fixture's tokenizer and no video processor (`hf_processor`), the check of that
one argument's class lifted while it is made."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.interop.processors import Processor
from dew.objectives.lm import LMObjective
from dew.sampling import Sampling
from dew.serve import Engine, Request
from dew.training.state import Step
from tests.interop.test_qwen3_next import bound as hybrid_bound
from tests.interop.multimodal_checks import (check_greedy_matches_generate, check_save_reloads,
                                             check_row_logits, check_stepped_logits, targets, without_videos)
from tests.serve.test_engine import Collect
from tests.tolerances import assert_within, ulp_bound, vision_tower_ulps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3_5-native-tiny"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [f"token20 {IMAGE} token21", f"token30 {IMAGE} token31 {IMAGE} token32 token33"]
TEXT = ["token20 token21 token22 token23", "token30 token31"]


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
    return without_videos(transformers.Qwen3VLProcessor, image_processor=image_processor, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def processor(bundle, hf_processor):
    return Processor.of(hf_processor, bundle.model.config)


@pytest.fixture(scope="module")
def reference():
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                        attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(903)
    draw = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return [[draw(16, 24)], [draw(8, 8), draw(24, 16)]]  # grids (1, 4, 6); (1, 2, 2) and (1, 6, 4)


def logit_bound(bundle, magnitude: float, seq_len: int) -> float:
    """The hybrid decoder's bound (tests/interop/test_qwen3_next.py) plus what soft tokens carry in: the
    tower's rounding count and the merger's (a LayerNorm, two products over 128 terms, the erf), relative to
    their own size and carried forward at the logits'."""
    text = transformers.Qwen3_5TextConfig(**bundle.config["text_config"])
    tower = bundle.model.config.tower
    ulps = vision_tower_ulps(layers=tower.depth, width=tower.hidden_size, mlp_width=tower.intermediate_size,
                             heads=tower.num_heads, patches=24, patch_inputs=tower.patch_features)
    return hybrid_bound(text, seq_len, magnitude) + ulp_bound(ulps + np.sqrt(6 * 4 * 128) + 8, magnitude)


def _their_row(hf_processor, text, images):
    return dict(hf_processor(text=[text], images=None if images is None else [images], padding=False,
                             return_tensors="pt"))


def test_processor_lays_out_grids_as_transformers_gives_them(processor, hf_processor, reference, images):
    inputs = processor(PROMPTS, images=images)
    mask = inputs.token_fields["attention_mask"]
    pixels, grids = inputs.conditioning["pixel_values"], inputs.conditioning["image_grid_thw"]
    assert pixels.shape == (2, 2, 24, 96) and grids.shape == (2, 2, 3)
    for row, (prompt, row_images) in enumerate(zip(PROMPTS, images)):
        theirs = _their_row(hf_processor, prompt, row_images)
        ids = theirs["input_ids"][0].numpy()
        np.testing.assert_array_equal(inputs.tokens[row][mask[row]], ids)
        np.testing.assert_array_equal(grids[row, :len(row_images)], theirs["image_grid_thw"].numpy())
        counts = theirs["image_grid_thw"].prod(-1).tolist()
        patches = np.concatenate([pixels[row, n, :count] for n, count in enumerate(counts)])
        np.testing.assert_array_equal(patches, theirs["pixel_values"].numpy())
        slots = inputs.token_fields["image_indices"][row][mask[row]]
        np.testing.assert_array_equal(slots >= 0, ids == 5)
        # image n's tokens read features n * 6 + k (24 padded patches merge to 6 tokens an image)
        expected = np.concatenate([n * 6 + np.arange(count // 4) for n, count in enumerate(counts)])
        np.testing.assert_array_equal(slots[slots >= 0], expected)
        positions, _ = reference.model.get_rope_index(theirs["input_ids"], theirs["mm_token_type_ids"],
                                                      image_grid_thw=theirs["image_grid_thw"])
        np.testing.assert_array_equal(inputs.token_fields["rotary_positions"][row][mask[row]],
                                      positions[:, 0].T.numpy())
    assert not pixels[0, 1].any() and not grids[0, 1].any()  # the shorter row's padding image
    assert not pixels[1, 0, 4:].any()  # the small image's padding patches
    with pytest.raises(ValueError, match=r"row 0 has 1 image placeholder\(s\) '<\|image_pad\|>' and 2 image"):
        processor(PROMPTS[:1], images=[images[1]])


@pytest.mark.parametrize("with_images", [True, False], ids=["images", "text"])
def test_logits_match_transformers(bundle, logits_of, processor, hf_processor, reference, images, with_images):
    prompts = PROMPTS if with_images else TEXT
    inputs = processor(prompts, images=images if with_images else None)
    ours = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    their_rows = [_their_row(hf_processor, prompt, images[row] if with_images else None)
                  for row, prompt in enumerate(prompts)]
    # largest differences observed: 2.6e-5 with images (logits up to 7.7, bounds 1.1e-3), 1.1e-4 text only (up
    # to 8.0, bound 5.3e-4; the Gated DeltaNet layer's chunk sums, as in tests/interop/test_qwen3_next.py)
    bound = lambda magnitude, seq_len: logit_bound(bundle, magnitude, seq_len)
    check_row_logits(ours, inputs, reference, their_rows, bound, 1.0)


def test_cached_greedy_continuation_matches_generate(bundle, processor, hf_processor, reference, images):
    check_greedy_matches_generate(bundle, processor(PROMPTS, images=images), reference,
                                  [_their_row(hf_processor, prompt, images[row]) for row, prompt in enumerate(PROMPTS)])


def _their_loss(model, hf_processor, inputs, images, pixels):
    """transformers' mean cross entropy over the same targets, each row fed alone, `pixels` the rows' patches
    in order."""
    tokens, weights = targets(inputs)
    valid = np.asarray(inputs.token_fields["attention_mask"])
    total, used = 0, 0
    for row, prompt in enumerate(PROMPTS):
        theirs = _their_row(hf_processor, prompt, images[row])
        count = int(theirs["image_grid_thw"].prod(-1).sum())
        theirs["pixel_values"] = pixels[used:used + count]
        used += count
        logits = model(**theirs).logits[0]
        ids = theirs["input_ids"][0]
        ce = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
        total = total + (ce * torch.tensor(weights[row][valid[row][:-1]], dtype=torch.float32)).sum()
    return total / float(weights.sum())


def _patches(inputs):
    """The rows' real patches in order (as transformers concatenates them)."""
    pixels, grids = np.asarray(inputs.conditioning["pixel_values"]), np.asarray(inputs.conditioning["image_grid_thw"])
    counts = grids.prod(-1)
    return np.concatenate([pixels[b, n, :counts[b, n]] for b in range(len(pixels)) for n in range(pixels.shape[1])])


def test_pixel_gradient_and_one_sgd_step_match_transformers(bundle, logits_of, processor, hf_processor, images):
    """The mean cross entropy `LMObjective` scores on a `{"text": inputs}` batch, differentiated once for the
    weights and the pixels: the pixel gradient equals transformers' (twice the logits' chain, backwards), and
    the weights one SGD step (rate 1e-2) away give transformers' stepped model's logits (observed: 2.0e-6 on
    pixel gradients up to 0.22, bound 6.6e-5; 2.4e-4 on stepped logits up to 9.0, bounds 1.1e-3)."""
    inputs = processor(PROMPTS, images=images)
    objective = LMObjective(bundle.model, inputs.tokens.shape[1] - 1, pretrained=bundle.variables, ema_decay=None,
                            pad_id=0)
    step = Step(jnp.int32(0), jax.random.key(3))

    def mean_loss(variables, pixel_values):
        batch = {"text": inputs.replace(conditioning={**inputs.conditioning, "pixel_values": pixel_values})}
        total, count = objective.reduce_loss(objective.loss(variables, batch, step)[0])
        return total / count

    grads, pixel_grads = jax.jit(jax.grad(mean_loss, argnums=(0, 1)))(
        bundle.variables, jnp.asarray(inputs.conditioning["pixel_values"]))
    pixel_grads = np.asarray(pixel_grads)
    stepped = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(FIXTURE, dtype=torch.float32,
                                                                           attn_implementation="eager")
    pixels = torch.tensor(_patches(inputs), requires_grad=True)
    _their_loss(stepped, hf_processor, inputs, images, pixels).backward()
    theirs = pixels.grad.numpy()
    assert not pixel_grads[0, 1].any() and not pixel_grads[1, 0, 4:].any()  # padding reaches no slot
    mine = _patches(inputs.replace(conditioning={**inputs.conditioning, "pixel_values": pixel_grads}))
    assert_within(mine, theirs, 2 * logit_bound(bundle, np.abs(theirs).max(), inputs.shape[1]), "pixel gradient")

    moved = jax.tree.map(lambda value, grad: value - 1e-2 * grad, bundle.variables, grads)
    ours = np.asarray(logits_of(moved, inputs.tokens, inputs.kwargs()))
    before = np.asarray(logits_of(bundle.variables, inputs.tokens, inputs.kwargs()))
    check_stepped_logits(stepped, ours, before, inputs, [_their_row(hf_processor, prompt, images[row])
                                                         for row, prompt in enumerate(PROMPTS)],
                         lambda magnitude, seq_len: logit_bound(bundle, magnitude, seq_len))


def test_save_reloads_in_transformers(bundle, hf_processor, reference, images, tmp_path):
    row = _their_row(hf_processor, PROMPTS[1], images[1])
    check_save_reloads(bundle, transformers.Qwen3_5ForConditionalGeneration, reference, row, FIXTURE, tmp_path / "saved")


def test_the_experts_variant_matches_transformers(tmp_path, processor, hf_processor, images):
    """`qwen3_5_moe` is the same model over Qwen 3.5-MoE's text decoder (every layer's tokens routed to 4 experts,
    top 2, beside a gated shared expert; transformers 5's fused expert tensors): logits of a row with two images
    equal transformers' (observed: 3.0e-6 of logits up to 3.7, bound 6.9e-4), and a save reloads in transformers
    bit for bit."""
    dense = json.loads((FIXTURE / "config.json").read_text())
    text = {k: v for k, v in dense["text_config"].items() if k not in ("intermediate_size", "model_type")}
    config = transformers.Qwen3_5MoeConfig(
        text_config=dict(text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24),
        vision_config={k: v for k, v in dense["vision_config"].items() if k != "model_type"},
        **{k: dense[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                parameter.normal_(0.0, 0.2) if "norm" not in name else parameter.add_(0.2 * torch.randn_like(parameter))
    model.save_pretrained(tmp_path / "moe")
    # transformers runs its experts another way in a model it loads than in one it builds: compare loaded ones
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "moe", dtype=torch.float32,
                                                                            attn_implementation="eager").eval()
    moe = load_pretrained(tmp_path / "moe", dtype="float32", max_seq_len=96)
    assert moe.model.config.text.mixture.shared_gate and moe.model.config.text.mixture.layers is None
    inputs = processor(PROMPTS[1:], images=images[1:])
    ours = np.asarray(jax.jit(lambda variables, tokens, fields: moe.model.apply(variables, tokens, **fields))(
        moe.variables, inputs.tokens, inputs.kwargs()))
    row = _their_row(hf_processor, PROMPTS[1], images[1])
    bound = lambda magnitude, seq_len: logit_bound(moe, magnitude, seq_len)
    check_row_logits(ours, inputs, model, [row], bound, 1.0)
    check_save_reloads(moe, transformers.Qwen3_5MoeForConditionalGeneration, model, row, tmp_path / "moe",
                       tmp_path / "saved")


def test_prompt_ids_with_placeholders_are_served_as_text_generation_answers(bundle, processor, images):
    """A chat prompt comes to the server as token ids, one `<|image_pad|>` an image: `from_ids` expands each to
    its image's soft tokens and lays out patches, grids and three-axis positions as the processor lays out the
    text (two images of other grids in a row too). The engine, with two image rows of other patch counts (24
    and 4) and a text row in flight together, draws what text_generation draws; a text row then takes the slot
    of the first (whose rotary delta, -3, its admission replaces) and continues as text_generation does."""
    small = images[1][0]  # grid (1, 2, 2)
    prompts = [PROMPTS[0], TEXT[0], PROMPTS[0], TEXT[1]]
    row_images = [images[0], [], [small], []]
    generation = bundle.text_generation(sampling=Sampling(temperature=0))(processor(prompts, images=row_images), 6,
                                                                            seed=1)
    greedy = generation.continuations()
    requests = []
    for row, (prompt, pictures) in enumerate([*zip(prompts, row_images), (PROMPTS[1], images[1])]):
        theirs = processor([prompt], images=[pictures])
        media = None
        if pictures:
            ours = processor.from_ids(processor.tokenizer(prompt)["input_ids"], pictures)
            np.testing.assert_array_equal(ours.tokens, theirs.tokens)
            for name in ("positions", "image_indices", "image_groups", "rotary_positions"):
                np.testing.assert_array_equal(ours.token_fields[name], theirs.token_fields[name], err_msg=name)
            for name in ("pixel_values", "image_grid_thw"):
                np.testing.assert_array_equal(ours.conditioning[name], theirs.conditioning[name], err_msg=name)
            media = {name: np.asarray(ours.token_fields[name][0])
                     for name in ("image_indices", "image_groups", "rotary_positions")}
            media.update({name: np.asarray(value[0]) for name, value in ours.conditioning.items()})
        # the first image row ends after 2 tokens, so the last text row takes its slot
        requests.append(Request([int(i) for i in theirs.tokens[0]], 2 if row == 0 else 6, Sampling(temperature=0),
                                1, Collect(), row, media=media, log_probs=0))
    requests = requests[:len(prompts)]  # the two-image row's layout is checked; the engine serves the rest
    with pytest.raises(ValueError, match=r"the prompt has 1 image placeholder\(s\) '<\|image_pad\|>' and 2 image"):
        processor.from_ids(processor.tokenizer(PROMPTS[0])["input_ids"], images[1])
    engine = Engine(bundle.model, bundle.variables, slots=3, capacity=16, prefill_rows=1)
    engine.start()
    try:
        engine.submit(requests[:3])  # two image rows of 24 and 4 patches, a text row between
        assert requests[0].consumer.done.wait(120), "the engine did not finish the request"
        engine.submit(requests[3:])  # the lowest free slot, the first image row's
        for request in requests:
            assert request.consumer.done.wait(120), "the engine did not finish the request"
    finally:
        engine.close()
    # text_generation fed every row together, left-padded (patches to 24); the engine each row alone, with its
    # own patch count (the seed draws nothing at temperature 0)
    assert [request.consumer.tokens for request in requests] == [greedy[0][:2], *greedy[1:]]
    # and the drawn tokens' log-probabilities (a row's positions moved by its rotary delta would show here)
    ours = [[entry.log_prob for entry in request.consumer.entries] for request in requests]
    ours = np.array([row + [0.0] * (6 - len(row)) for row in ours])
    theirs = np.where(np.arange(6) < np.array([2, 6, 6, 6])[:, None], generation.log_probs, 0.0)
    # A log-softmax errs by at most twice its logits' error; this fixture's logits reach 8.0 (see
    # test_logits_match_transformers). Observed 8.9e-6 (bound 2.5e-3); a slot keeping the image row's delta
    # instead of its admission's moves them by 0.13.
    assert_within(ours, theirs, 2 * logit_bound(bundle, 8.0, 16), "served log-probabilities")
