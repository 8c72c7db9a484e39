"""Each native family against transformers on a tiny random checkpoint: fp32 logits and 16 greedy tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from tests.compiled import compiled
from tests.interop.conftest import CASES, greedy_continuations, save_checkpoint, torch, torch_model
from tests.tolerances import transformers_decoder_ulps, ulp_bound

# fp32 logits (largest 5.4-8.2) of 2-layer width-32 decoders over 12 tokens, Dew against transformers:
# transformers_decoder_ulps gives 650 ulps of the largest logit (2094 with Llama 3's rotary blend), so
# bounds of 4.3e-4 to 1.5e-3. The largest differences observed, per case: llama 6.6e-6, llama-bias-tied-mha
# 4.5e-6, mistral-window 3.6e-6, ministral-mixed-window 3.5e-6, qwen2-bias-window 4.8e-6, qwen3-qk-norm
# 4.5e-6, gemma 3.9e-6, gemma2-softcap-alternating 3.3e-6, gemma3-local-global (linear on full layers)
# 2.2e-6, olmo2 3.5e-6, olmo3-window 3.3e-6, llama-linear-rope 4.8e-6, llama-llama3-rope 6.4e-6,
# qwen3-yarn-rope 3.5e-6, phi3-fused-window 7.2e-6. Along the greedy paths below, the top two logits are at least 6.7 times
# further apart than both sides' bounds together, so the tokens cannot flip on another CPU.
PROMPT = [5, 17, 3, 88, 41, 9]


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    model = torch_model(request.param)
    directory = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, load_pretrained(directory)


def test_logits_match_transformers(loaded):
    case, model, bundle = loaded
    tokens = np.random.default_rng(0).integers(0, 97, (2, 12))
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(theirs).max() > 2.0  # the weights are large enough for a wrong convention to show
    bound = ulp_bound(transformers_decoder_ulps(model.config, tokens.shape[1]), np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0, err_msg=case)


def test_greedy_tokens_match_transformers_generate(loaded):
    case, model, bundle = loaded
    ours, theirs = greedy_continuations(model, bundle, PROMPT)
    assert ours == theirs, case


@pytest.mark.parametrize("case", ["llama", "qwen3-qk-norm", "gemma2-softcap-alternating"])
def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(case, tmp_path):
    """A bf16 checkpoint run in bf16 by both: each side's error against the fp32 logits of the same
    bf16 weights. Dew keeps rotary, softmax and norms in float32 where transformers rounds more often, so
    its error must not exceed transformers' by more than a quarter, give or take one bf16 ulp of the
    largest logit, which each side's final rounding alone may cost (observed, on logits up to about 8:
    llama 0.117 vs 0.163, qwen3-qk-norm 0.067 vs 0.080, gemma2-softcap-alternating 0.075 vs 0.086)."""
    model = torch_model(case).to(torch.bfloat16)
    directory = save_checkpoint(model, tmp_path / case)
    bundle = load_pretrained(directory, dtype="bfloat16")
    assert bundle.model.config.param_dtype == jnp.bfloat16  # param_dtype="auto" reads config.json's dtype
    tokens = np.random.default_rng(0).integers(0, 97, (2, 12))
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(tokens, jnp.int32)), np.float32)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.float().numpy()
        truth = model.float()(torch.from_numpy(tokens)).logits.numpy()
    ours_error, theirs_error = np.abs(ours - truth).max(), np.abs(theirs - truth).max()
    slack = ulp_bound(1, np.abs(truth).max(), dtype=jnp.bfloat16)
    assert ours_error <= 1.25 * theirs_error + slack, (case, ours_error, theirs_error)
