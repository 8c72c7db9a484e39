"""Continued training: one SGD step on a loaded checkpoint against the same step in torch."""

from __future__ import annotations

import copy

import jax
import numpy as np
import optax
import pytest

from dew import Trainer
from dew.data.dataset import Dataset
from dew.interop import load_pretrained
from dew.objectives.lm import LMObjective
from tests.compiled import compiled
from tests.interop.conftest import save_checkpoint, torch_model
from tests.tolerances import transformers_decoder_ulps, ulp_bound

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("case", ["llama", "qwen3-qk-norm"])
def test_one_sgd_step_matches_torch(case, tmp_path):
    model = torch_model(case, seed=1)
    directory = save_checkpoint(model, tmp_path / case)
    bundle = load_pretrained(directory)
    tokens = np.random.default_rng(0).integers(0, 97, (4, 13)).astype(np.int32)

    objective = LMObjective(bundle.model, 12, pretrained=bundle.variables, ema_decay=None)
    data = Dataset(train=lambda partition: iter([{"text": tokens}]), val=None, records=4, batch=4)
    state = Trainer(objective, optax.sgd(0.05), key=jax.random.key(0)).fit(data, steps=1, verbose=False)
    ours = np.asarray(compiled(bundle.model.apply, state.params, tokens))

    theirs_model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(theirs_model.parameters(), lr=0.05)
    ids = torch.from_numpy(tokens).long()
    theirs_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with torch.no_grad():
        theirs = theirs_model.eval()(input_ids=ids).logits.numpy()
    before = np.asarray(compiled(bundle.model.apply, bundle.variables, tokens))
    # fp32 logits (up to 6.3) of the stepped weights: the forward pass's rounding (transformers_decoder_ulps),
    # plus the step's move of the logits (up to 4.7) off by its gradient's relative error: a forward and
    # a backward pass (twice those ulps) and a 48-token sum. Bounds 1.2e-3 to 1.3e-3; observed 1.3e-5
    # (llama), 1.5e-5 (qwen3-qk-norm).
    ulps = transformers_decoder_ulps(model.config, tokens.shape[1])
    move = np.abs(theirs - before).max()
    assert move > 100 * ulp_bound(ulps, np.abs(theirs).max())  # the step moved the logits
    bound = ulp_bound(ulps, np.abs(theirs).max()) + ulp_bound(2 * ulps + 48, move)
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)
