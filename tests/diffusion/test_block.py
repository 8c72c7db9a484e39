"""DiffusionGemma block generation (`BlockProcess`, `BlockGeneration`) against transformers' own generate on the
tiny fixture, the guide's workflow example, defaults from generation_config.json and bad input."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from tempfile import TemporaryDirectory

import jax
import numpy as np
import pytest

from dew.diffusion.block import BlockProcess, accepted, entropy
from dew.inference import BlockGeneration
from dew.interop import load_pretrained

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "diffusion-gemma-workflow"


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", attention_impl="xla", max_seq_len=32)


@pytest.mark.slow
def test_guide_workflow_example(bundle):
    """The guide's example: tokenize, generate, decode, save, reload, the same tokens for the same key."""
    assert bundle.processor is not None
    inputs = bundle.processor(["<bos> t5 t7 t9 t11"])
    task = bundle.block_generation()
    assert isinstance(task, BlockGeneration)  # dew.inference exports it beside the other tasks
    generated = task(inputs, 7, key=jax.random.key(11))
    text = task.decode(generated)
    assert len(text) == 1 and len(text[0].split()) == generated.new_tokens[0] <= 7
    assert list(generated.tokens[0, :5]) == [2, 5, 7, 9, 11]
    assert generated.tokens.shape == (1, 5 + 7)
    # two canvases of 4 for 7 tokens, each at most the fixture's 8 steps (generation_config.json)
    assert 2 <= generated.refinements[0] <= 16
    with TemporaryDirectory() as checkpoint:
        bundle.save(checkpoint)
        restored = load_pretrained(checkpoint, dtype="float32", attention_impl="xla", max_seq_len=32)
        replay = restored.block_generation()(inputs, 7, key=jax.random.key(11))
        np.testing.assert_array_equal(replay.tokens, generated.tokens)
        np.testing.assert_array_equal(replay.refinements, generated.refinements)
    other = task(inputs, 7, key=jax.random.key(12))
    assert not np.array_equal(other.tokens, generated.tokens)  # the key is what fixes the draw


def test_defaults_come_from_generation_config(bundle):
    task = bundle.block_generation()
    assert task.process == BlockProcess(4, 64, t_max=0.8, t_min=0.4, entropy_bound=0.1, max_steps=8,
                                        stability_threshold=1, confidence_threshold=0.005)
    assert (task.max_new_tokens, task.eos_token_ids, task.pad_id) == (16, (1,), 0)
    # transformers' defaults where the file is silent or null
    assert BlockProcess.from_generation({"t_min": None}, 4, 64) == BlockProcess(4, 64, max_steps=48)
    with pytest.raises(ValueError, match="top_k"):
        BlockProcess.from_generation({"top_k": 5}, 4, 64)
    with pytest.raises(ValueError, match="sampler_config"):
        BlockProcess.from_generation({"sampler_config": {"_cls_name": "OtherSampler", "x": 1}}, 4, 64)


def test_process_override_and_step_limit(bundle):
    """process= replaces the defaults for one call: one step per canvas gives one refinement per canvas."""
    task = bundle.block_generation()
    one_step = dataclasses.replace(task.process, max_steps=1)
    generated = task([[2, 5, 7]], 10, key=jax.random.key(0), process=one_step)
    assert generated.tokens.shape == (1, 3 + 10)
    assert generated.refinements[0] == math.ceil(10 / 4) or generated.terminated[0]


def test_bad_input_refused(bundle):
    task = bundle.block_generation()
    with pytest.raises(ValueError, match="max_seq_len 32"):
        task([[2] * 20], 13, key=jax.random.key(0))  # 20 + 16 positions
    with pytest.raises(ValueError, match="temperature=0.5 is an autoregressive sampling control"):
        task([[2, 3]], 4, temperature=0.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        task([[2, 64]], 4)
    with pytest.raises(ValueError, match="t_min"):
        BlockProcess(4, 64, t_min=0.9, t_max=0.8)
    with pytest.raises(ValueError, match="canvas_length 8"):
        task([[2, 3]], 4, process=BlockProcess(8, 64))
    generated = task([[2, 3], [4]], 0)  # no tokens asked: the prompts, no refinement
    assert generated.tokens.tolist() == [[2, 3], [0, 4]] or generated.tokens.tolist() == [[2, 3], [4, 0]]
    assert generated.refinements.tolist() == [0, 0]


def test_dew_generate_refines_canvases_from_a_diffusion_gemma_checkpoint(capsys):
    from dew.cli import main

    capsys.readouterr()
    assert main(["generate", str(FIXTURE), "--prompt", "t5 t7 t9", "--max-new-tokens", "4", "--n", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line[:4] for line in printed] == ["[0] ", "[1] "] and all("t5 t7 t9" in line for line in printed)
    assert main(["generate", str(FIXTURE), "--prompt", "t5", "--top-k", "3"]) == 2
    assert "--top-k sets autoregressive sampling, and" in capsys.readouterr().err


def test_pipeline_gives_block_generation():
    from dew.runs import pipeline

    task = pipeline(str(FIXTURE), dtype="float32")
    assert isinstance(task, BlockGeneration)
    assert load_pretrained(FIXTURE).text_generation().process == task.process


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_sampler_pieces_match_transformers():
    """Entropy and the entropy-bound acceptance against transformers' EntropyBoundSampler on random logits."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSampler, EntropyBoundSamplerConfig,
    )

    logits = (2 * np.random.default_rng(3).normal(size=(3, 16, 64))).astype(np.float32)
    theirs_entropy = torch.distributions.Categorical(logits=torch.tensor(logits)).entropy().numpy()
    ours_entropy = np.asarray(entropy(logits))
    # fp32: a 64-term sum of p log p (within 64 ulps of its size, ~4 nats) and exp/log from two libraries
    np.testing.assert_allclose(ours_entropy, theirs_entropy, rtol=0, atol=64 * 4 * np.finfo(np.float32).eps * 4)
    for bound in (0.1, 1.0, 5.0):
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), 16, 64, 8)
        current = torch.zeros((3, 16), dtype=torch.long)
        sampler.accept_canvas(current, current + 1, torch.tensor(logits), 1)
        # the same entropies on both sides, so the bound is crossed at the same place
        mine = np.asarray(accepted(theirs_entropy, bound))
        np.testing.assert_array_equal(mine, sampler.accepted_token_mask.numpy())
        assert mine.sum(axis=1).min() >= 1  # the lowest-entropy position always accepts


@pytest.mark.slow
def test_generation_matches_transformers(bundle):
    """Near-zero temperatures make every draw the argmax and a huge entropy bound accepts every position,
    so with the same first canvases (Dew's, handed to transformers) both generate the same tokens: the
    committed canvases re-encoded into the cache, self-conditioning, stability-and-confidence stopping,
    EOS padding and the per-row evaluation counts."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    reference = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    process = BlockProcess(4, 64, t_max=2e-5, t_min=1e-5, entropy_bound=1e6, max_steps=6)
    prompts = np.random.default_rng(1).integers(3, 64, (3, 6))
    new, key = 10, jax.random.key(5)
    ours = process.generate(bundle.model, {k: bundle.variables[k] for k in ("params", "constants")},
                            prompts.tolist(), new, key=key, eos_token_ids=(1,), pad_id=0)

    first_canvases = [np.asarray(process.noise(jax.random.split(jax.random.fold_in(key, block))[0], 3))
                      for block in range(math.ceil(new / 4))]
    original = reference._prepare_denoiser_inputs

    def with_dew_canvas(*args, model_kwargs, **kwargs):
        model_kwargs["decoder_input_ids"] = torch.tensor(first_canvases.pop(0))
        return original(*args, model_kwargs=model_kwargs, **kwargs)

    reference._prepare_denoiser_inputs = with_dew_canvas
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor(prompts), max_new_tokens=new, max_denoising_steps=6, t_min=1e-5, t_max=2e-5,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=1e6), stability_threshold=1,
            confidence_threshold=0.005, eos_token_id=1, pad_token_id=0)
    sequences = theirs.sequences.numpy()
    np.testing.assert_array_equal(ours.tokens, sequences[:, :6 + new])
    generated = sequences[:, 6:]
    passes = (generated != 0).sum(axis=1) / theirs.tokens_per_forward.numpy()
    np.testing.assert_allclose(ours.refinements, passes, rtol=1e-6)
    assert ours.refinements.min() < 6 * len(range(0, new, 4))  # stopping cut some refinement short
