"""Each native family against transformers on a tiny random checkpoint: fp32 logits and 16 greedy tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained
from dew.sampling import Sampling
from tests.interop.conftest import CASES, save_checkpoint, torch, torch_model

# fp32 logits (largest 5.5-8.2) of 2-layer width-32 decoders with order-one weights. The largest
# differences observed, per case: llama 5.0e-6, llama-bias-tied-mha 4.1e-6, mistral-window 4.5e-6,
# ministral-mixed-window 2.9e-6, qwen2-bias-window 5.0e-6, qwen3-qk-norm 5.7e-6, gemma 5.5e-6,
# gemma2-softcap-alternating 3.5e-6, gemma3-local-global (linear on full layers) 2.2e-6, olmo2 2.3e-6,
# olmo3-window 4.5e-6, llama-linear-rope 5.0e-6, llama-llama3-rope 4.8e-6, qwen3-yarn-rope 6.0e-6.
TOLERANCE = 2e-5
PROMPT = [5, 17, 3, 88, 41, 9]


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    model = torch_model(request.param)
    directory = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, load_pretrained(directory)


def test_logits_match_transformers(loaded):
    case, model, bundle = loaded
    tokens = np.random.default_rng(0).integers(0, 97, (2, 12))
    ours = np.asarray(bundle.model.apply(bundle.variables, jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(theirs).max() > 2.0  # the weights are large enough for a wrong convention to show
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0, err_msg=case)


def test_greedy_tokens_match_transformers_generate(loaded):
    case, model, bundle = loaded
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    ours = bundle.text_generation(Sampling(temperature=0.0))([PROMPT], 16)
    assert ours.continuations()[0] == theirs, case
