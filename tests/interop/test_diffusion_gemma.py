"""DiffusionGemma checkpoints: load_pretrained against transformers' own model on the tiny fixture
(tools/make_diffusion_gemma_fixtures.py), config fields read or refused by name, save and reload."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.nn.diffusion_gemma import PrefixCache
from tests.compiled import compiled
from tests.tolerances import LIBRARY_ULPS, decoder_ulps, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "diffusion-gemma-workflow"
PROMPT, CANVAS = 12, 4  # a prompt past the sliding window (8), so the sliding layers drop keys


def logit_tolerance(magnitude: float, seq_len: int) -> float:
    """fp32 Dew against transformers on the fixture (3 layers, width 32, MLP 48, heads 4 of up to 16,
    4 experts choosing 2 of width 24, vocabulary 64): the decoder chain `decoder_ulps` counts, plus per
    layer the extra norms Gemma 4 adds (five of `width + 3` roundings and an rsqrt each), the router
    (a norm, a `width`-term projection, a softmax over 4, an exp), the two chosen experts (gate and up
    of `width` terms, the activation, down of 24, a weighted sum of 2), and once the self-conditioning
    (a softmax over 64 and an exp, a 64-term soft embedding, a gated MLP and two norms)."""
    width, layers = 32, 3
    extra = layers * (5 * (width + 3) + (width + 3) + width + 4 + 1 + 2 * width + 3 + 24 + 2)
    extra += 64 + 1 + 64 + (width + 3) + 2 * width + 3 + 48 + (width + 3)
    ulps = (decoder_ulps(layers=layers, width=width, mlp_width=48, heads=4, head_dim=16, seq_len=seq_len)
            + math.sqrt(6 * extra) + LIBRARY_ULPS * (7 * layers + 4))
    return ulp_bound(ulps, magnitude)


@pytest.fixture(scope="module")
def bundle():
    return load_pretrained(FIXTURE, dtype="float32", attention_impl="xla")


@pytest.fixture(scope="module")
def reference():
    model = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(FIXTURE, dtype=torch.float32)
    return model.eval()


def _capped(reference, hidden):
    logits = reference.lm_head(hidden).float()
    return 30.0 * torch.tanh(logits / 30.0)


@pytest.mark.slow
def test_logits_match_transformers(bundle, reference):
    """Encoder logits over a prompt, then over a committed canvas on the same cache, and denoiser logits
    after each (with and without self-conditioning, one row's signal masked off) equal transformers'."""
    from transformers.cache_utils import DynamicCache

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 64, (2, PROMPT))
    committed = rng.integers(0, 64, (2, CANVAS))
    canvas = rng.integers(0, 64, (2, CANVAS))
    conditioning = (3 * rng.normal(size=(2, CANVAS, 64))).astype(np.float32)
    conditioned = np.array([True, False])
    model, variables = bundle.model, {k: bundle.variables[k] for k in ("params", "constants")}
    encode = jax.jit(lambda tokens, cache, start: model.apply(
        variables, tokens, jnp.ones(tokens.shape, bool), cache, start, method=model.encode))
    denoise = jax.jit(lambda *args: model.apply(variables, *args, method=model.denoise))
    head = jax.jit(lambda hidden: model.apply(variables, hidden, method=model.logits))

    def dew_denoise(cache, with_conditioning):
        extra = (jnp.asarray(conditioning), jnp.asarray(conditioned)) if with_conditioning else ()
        return np.asarray(denoise(jnp.asarray(canvas), cache, *extra))

    cache = PrefixCache.empty(model.config, 2, PROMPT + 2 * CANVAS)
    hidden, cache = encode(jnp.asarray(prompt), cache, 0)
    ours = [np.asarray(head(hidden)), dew_denoise(cache, False), dew_denoise(cache, True)]
    hidden, cache = encode(jnp.asarray(committed), cache, PROMPT)
    ours += [np.asarray(head(hidden)), dew_denoise(cache, True)]

    with torch.no_grad():
        theirs_cache = DynamicCache(config=reference.config.get_text_config(decoder=True))
        encoded = reference.model.encoder(input_ids=torch.tensor(prompt), cache=theirs_cache)

        def their_denoise(with_conditioning):
            extra = dict(self_conditioning_logits=torch.tensor(conditioning),
                         self_conditioning_mask=torch.tensor(conditioned)) if with_conditioning else {}
            return reference(cache=theirs_cache, decoder_input_ids=torch.tensor(canvas), **extra).logits.numpy()

        theirs = [_capped(reference, encoded.last_hidden_state).numpy(), their_denoise(False), their_denoise(True)]
        positions = torch.arange(PROMPT, PROMPT + CANVAS)[None]
        encoded = reference.model.encoder(input_ids=torch.tensor(committed), cache=theirs_cache,
                                          position_ids=positions)
        theirs += [_capped(reference, encoded.last_hidden_state).numpy(), their_denoise(True)]

    for name, mine, its in zip(("encoder", "denoiser", "conditioned denoiser", "encoder after a canvas",
                                "denoiser after a canvas"), ours, theirs):
        magnitude = float(np.abs(its).max())
        assert magnitude > 1.0, f"{name}: logits of {magnitude} would hide a misplaced tensor"
        # largest observed: 4.8e-6 on logits up to 4.6 (AMD EPYC, AVX2); the bound is about 7e-4
        np.testing.assert_allclose(mine, its, rtol=0, atol=logit_tolerance(magnitude, PROMPT + 2 * CANVAS),
                                   err_msg=name)


def test_save_reload_is_exact(bundle, reference, tmp_path):
    """bundle.save writes every tensor back under its checkpoint name (vision tower included), so Dew
    and transformers both read the same numbers again."""
    saved = bundle.save(tmp_path / "saved")
    restored = load_pretrained(saved, dtype="float32", attention_impl="xla")  # the runtime knobs as loaded
    for collection in ("params", "constants"):
        mine = dict(_leaves(bundle.variables[collection]))
        for path, leaf in _leaves(restored.variables[collection]):
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(mine[path]), err_msg=path)
    again = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(saved, dtype=torch.float32)
    theirs = reference.state_dict()
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
    assert json.loads((saved / "generation_config.json").read_text()) == bundle.generation_config


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("edit, field", [
    (lambda c: c["text_config"].update(sliding_windows=4), "sliding_windows"),
    (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (lambda c: c.update(tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_type="yarn"), "rope_parameters"),
    (lambda c: c["text_config"].update(attention_dropout=0.1), "attention_dropout"),
    (lambda c: c["text_config"].update(num_experts=None), "num_experts"),
    (lambda c: c.update(canvas_length=0), "canvas_length"),
])
def test_config_fields_refused_by_name(tmp_path, edit, field):
    directory = tmp_path / "edited"
    shutil.copytree(FIXTURE, directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        load_pretrained(directory, dtype="float32")


def test_tensor_mismatch_refused(tmp_path):
    """A checkpoint whose tensors disagree with config.json is refused, naming a tensor."""
    directory = tmp_path / "edited"
    shutil.copytree(FIXTURE, directory)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 20
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gate_up_proj"):
        load_pretrained(directory, dtype="float32")


def test_fields_are_transformers_declared_ones():
    """The family reads the fields transformers' two config classes declare, with their defaults, plus
    the keyword arguments the text config takes without declaring them."""
    import dataclasses

    from dew.interop.families.diffusion_gemma import OUTER_FIELDS, TEXT_FIELDS, UNDECLARED_TEXT_FIELDS

    base = {field.name for field in dataclasses.fields(transformers.PreTrainedConfig)}
    for config_class, fields, undeclared in ((transformers.DiffusionGemmaTextConfig, TEXT_FIELDS,
                                              UNDECLARED_TEXT_FIELDS), (transformers.DiffusionGemmaConfig,
                                                                        OUTER_FIELDS, ())):
        declared = {field.name: field.default for field in dataclasses.fields(config_class) if field.name not in base}
        assert {k: v for k, v in fields.items() if k not in undeclared} == declared
    assert transformers.DiffusionGemmaTextConfig.final_logit_softcapping == TEXT_FIELDS["final_logit_softcapping"]


def test_padding_before_a_prompt_changes_nothing(bundle):
    """A prompt padded on the left (positions count from its first token, padded slots never attended) and
    a cache with unused slots after it give the logits of the prompt alone."""
    model, variables = bundle.model, {k: bundle.variables[k] for k in ("params", "constants")}
    prompt = np.arange(3, 3 + 7)[None]
    canvas = jnp.asarray(np.arange(20, 20 + CANVAS)[None])

    def run(tokens, valid, capacity):
        cache = PrefixCache.empty(model.config, 1, capacity)
        hidden, cache = compiled(model.apply, variables, jnp.asarray(tokens), jnp.asarray(valid), cache, 0,
                                 method=model.encode)
        last = np.asarray(compiled(model.apply, variables, hidden[:, -1:], method=model.logits))
        return last, np.asarray(compiled(model.apply, variables, canvas, cache, method=model.denoise))

    alone = run(prompt, np.ones((1, 7), bool), 7)
    padded = run(np.concatenate([np.zeros((1, 5), int), prompt], 1), np.arange(12)[None] >= 5, 16)
    for mine, its in zip(padded, alone):
        # masked slots weigh exactly zero; only the reduction lengths differ (12 or 16 keys against 7)
        np.testing.assert_allclose(mine, its, rtol=0, atol=logit_tolerance(float(np.abs(its).max()), 16))
