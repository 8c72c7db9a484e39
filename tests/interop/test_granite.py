"""Granite (dew.interop.families.granite): its four multipliers as Dew's knobs, written back, and read from
llama.cpp's GGUF scales.

Its logits and greedy tokens against transformers are tests/interop/test_families.py's case
granite-multipliers (observed 1.9e-6 on logits up to 2.8, against a bound of 2.1e-4)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from tests.interop.conftest import assert_logits_match, save_checkpoint, torch_model, transformers

MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)


def test_a_granite_load_saves_a_checkpoint_transformers_loads_with_equal_logits(tmp_path):
    model = torch_model("granite-multipliers")
    bundle = load_pretrained(save_checkpoint(model, tmp_path / "source"))
    c = bundle.model.config
    assert (c.embedding_scale, c.residual_scale, c.query_scale, c.logit_divisor) == (3.0, 0.5, 0.2, 2.0)
    out = bundle.save(tmp_path / "export")
    written = json.loads((out / "config.json").read_text())
    assert {name: written[name] for name in MULTIPLIERS} == MULTIPLIERS
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "GraniteForCausalLM"
    assert_logits_match(bundle, reloaded, np.random.default_rng(3).integers(0, 97, (2, 12)))


def test_the_loss_and_its_gradient_read_the_logit_divisor():
    """The chunked loss divides the logits as the head does: its cross entropy is the log-softmax of
    head.logits, and training sees the divisor."""
    from dew.objectives.lm import LMObjective
    from dew.nn.transformer import CausalTransformer, DecoderConfig

    model = CausalTransformer(DecoderConfig(vocab_size=97, emb_features=32, num_layers=1, num_heads=4,
                                            logit_divisor=4.0, max_seq_len=16))
    variables = model.init(__import__("jax").random.key(0), jnp.zeros((1, 8), jnp.int32), head=False)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)
    scores = LMObjective(model, 8).token_scores(variables, tokens)
    logits = np.asarray(model.apply(variables, tokens[:, :-1]), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.take_along_axis(log_probs, np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
    # float32 log-sum-exp over 97 terms against float64: a few ulps of the loss (observed ~1e-7)
    np.testing.assert_allclose(scores.losses, want, rtol=1e-5)


def test_a_granite_gguf_reads_its_scales(tmp_path):
    """llama.cpp's granite keeps the multipliers as embedding_scale, residual_scale, attention.scale and
    logit_scale, over Llama's names and rows; float32 tensors, so the GGUF load is the safetensors load exactly."""
    gguf_test = pytest.importorskip("tests.interop.test_gguf")
    model = torch_model("granite-multipliers", max_position_embeddings=32)
    source = load_pretrained(save_checkpoint(model, tmp_path / "source"))
    tensors = [(gguf_test._gguf_name(name), gguf_test.permuted(name, tensor.numpy(), model.config, "granite"), None)
               for name, tensor in model.state_dict().items()]

    def scales(writer):
        writer.add_embedding_scale(3.0)
        writer.add_residual_scale(0.5)
        writer.add_attention_scale(0.2)
        writer.add_logit_scale(2.0)

    (tmp_path / "gguf").mkdir()
    path = gguf_test.write_gguf(model, tmp_path / "gguf" / "tiny.f32.gguf", extra=scales, tensors=tensors)
    bundle = load_pretrained(path.parent, gguf_file=path.name)
    c = bundle.model.config
    assert (c.embedding_scale, c.residual_scale, c.logit_divisor) == (3.0, 0.5, 2.0)
    assert c.query_scale == pytest.approx(0.2, rel=1e-7)  # a float32 in the file
    tokens = jnp.asarray(gguf_test.TOKENS_IN, jnp.int32)
    np.testing.assert_allclose(np.asarray(bundle.model.apply(bundle.variables, tokens)),
                               np.asarray(source.model.apply(source.variables, tokens)), rtol=1e-6, atol=1e-6)
