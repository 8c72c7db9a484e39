"""BlockDiffusionObjective on the tiny DiffusionGemma fixture: the guide's one-step example, the encoder term
against transformers' encoder, the per-row normalisation, trainable scalars, and bad input."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from tempfile import TemporaryDirectory

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.objectives.base import Step
from dew.objectives.diffusion import BlockDiffusionObjective

SOURCE = Path(__file__).parents[1] / "fixtures" / "hf" / "diffusion-gemma-sft"


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(SOURCE, dtype="float32", attention_impl="xla", max_seq_len=32)


@pytest.fixture(scope="module")
def rows():
    with np.load(SOURCE / "reference.npz") as reference:
        return reference["tokens"]


@pytest.mark.slow
def test_guide_one_step_example(bundle, rows):
    """The guide's example: one SGD step from the checkpoint, exported through the objective's model; the
    per-layer scalars train (params) and come back as the checkpoint's frozen buffers."""
    import optax

    from dew import Dataset, Trainer

    train_tokens = np.tile(rows, (jax.device_count(), 1))
    data = Dataset(train=lambda partition: iter([{"text": train_tokens}]), val=None, records=len(train_tokens),
                   batch=len(train_tokens))
    objective = BlockDiffusionObjective(bundle.model, prompt_length=4, num_canvases=2, pretrained=bundle.variables)
    assert "encoder_layer_scalar" in objective.model.init(
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))["params"]["layers_0"]
    assert "encoder_layer_scalar" in bundle.variables["constants"]["layers_0"]
    state = Trainer(objective, optax.sgd(0.001), key=jax.random.key(2)).fit(data, steps=1, log_every=1)
    assert int(state.updates) == 1
    trained = state.params["params"]
    before = bundle.variables["constants"]["layers_0"]["encoder_layer_scalar"]
    assert not np.array_equal(np.asarray(trained["layers_0"]["encoder_layer_scalar"]), np.asarray(before))
    with TemporaryDirectory() as checkpoint:
        replace(bundle, model=objective.model).save(checkpoint, variables=state.params)
        restored = load_pretrained(checkpoint, dtype="float32", attention_impl="xla", max_seq_len=32)
    for layer in ("layers_0", "layers_2"):
        for name in ("encoder_layer_scalar", "decoder_layer_scalar"):
            np.testing.assert_array_equal(np.asarray(restored.variables["constants"][layer][name]),
                                          np.asarray(trained[layer][name]))
    np.testing.assert_array_equal(np.asarray(restored.variables["params"]["layers_1"]["mlp"]["up_proj"]["kernel"]),
                                  np.asarray(trained["layers_1"]["mlp"]["up_proj"]["kernel"]))
    assert bundle.variables["constants"]["layers_0"]["encoder_layer_scalar"] is before  # the bundle is untouched


@pytest.mark.slow
def test_terms_per_row(bundle, rows):
    """encoder_ce is each row's mean next-token cross entropy over its non-padding targets (transformers'
    encoder and head as the oracle), averaged over rows; a row whose response is all padding adds nothing
    to canvas_ce and still counts as a row."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    objective = BlockDiffusionObjective(bundle.model, prompt_length=4, num_canvases=2, pretrained=bundle.variables)
    empty = np.array([[2, 3, 4, 5] + [0] * 8], np.int32)
    batch = {"text": jnp.asarray(np.concatenate([rows, empty]))}
    stats = jax.jit(lambda v, b, k: objective.loss(v, b, Step(jnp.int32(0), k))[0])(
        objective.held_variables(), batch, jax.random.key(0))

    reference = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(SOURCE, dtype=torch.float32).eval()
    with torch.no_grad():
        tokens = torch.tensor(np.asarray(batch["text"]), dtype=torch.long)
        hidden = reference.model.encoder(input_ids=tokens).last_hidden_state
        logits = 30.0 * torch.tanh(reference.lm_head(hidden).float() / 30.0)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
        counted = (tokens[:, 1:] != 0).float()
        per_row = (ce * counted).sum(-1) / counted.sum(-1)
    expected = float(per_row.sum())  # over the 3 rows: every row has encoder targets
    assert float(stats.encoder_ce.count) == 3.0 and float(stats.canvas_ce.count) == 3.0
    # fp32: per-row means of ~10 cross entropies of logits that agree to ~1e-5 (tests/interop/test_diffusion_gemma)
    np.testing.assert_allclose(float(stats.encoder_ce.total), expected, rtol=1e-5)
    alone = jax.jit(lambda v, b, k: objective.loss(v, b, Step(jnp.int32(0), k))[0])(
        objective.held_variables(), {"text": jnp.asarray(empty)}, jax.random.key(0))
    assert float(alone.canvas_ce.total) == 0.0
    np.testing.assert_allclose(float(stats.loss.total), float(stats.encoder_ce.total + stats.canvas_ce.total),
                               rtol=1e-6)


def test_bad_input_refused(bundle, rows):
    with pytest.raises(ValueError, match="max_seq_len 32"):
        BlockDiffusionObjective(bundle.model, prompt_length=20, num_canvases=4)
    with pytest.raises(TypeError, match="DiffusionGemma"):
        BlockDiffusionObjective(object(), prompt_length=4)
    objective = BlockDiffusionObjective(bundle.model, prompt_length=4, num_canvases=2)
    with pytest.raises(ValueError, match=r"\[B, 12\]"):
        objective.check_batch({"text": rows[:, :11]})
    with pytest.raises(ValueError, match="packed documents"):
        objective.check_batch({"text": rows, "text_segment_ids": np.ones_like(rows)})
    with pytest.raises(ValueError, match="outside vocab_size 64"):
        objective.check_batch({"text": rows + 60})
    objective.check_batch({"text": rows})
