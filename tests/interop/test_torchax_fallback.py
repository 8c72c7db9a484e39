"""Tier 3 (dew.interop.torchax_fallback): transformers' PyTorch model through torchax, against the native
load of the same checkpoint: the same loss and gradients, and it trains with buffers untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from dew.interop import load_pretrained
from dew.interop.torchax_fallback import TorchaxFallbackWarning, TorchCausalLM, TorchLayout
from dew.objectives.lm import LMObjective
from dew.training import Trainer
from dew.training.mesh import place_batch
from dew.training.state import Step
from tests.interop.conftest import save_checkpoint, torch_model

pytest.importorskip("torchax")

SEQ = 11  # targets per row; rows hold SEQ + 1 ids


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """A tiny Llama checkpoint (untied head) loaded natively and as tier 3: (native, tier 3)."""
    directory = save_checkpoint(torch_model("llama"), tmp_path_factory.mktemp("llama-torchax"))
    native = load_pretrained(directory)
    with pytest.warns(TorchaxFallbackWarning) as caught:
        generic = load_pretrained(directory, fallback="torchax")
    assert len(caught) == 1 and "tier 3 (fallback='torchax')" in str(caught[0].message)
    return native, generic


def _batch():
    return {"text": jnp.asarray(np.random.default_rng(0).integers(0, 97, (4, SEQ + 1)), jnp.int32)}


def test_the_variables_keep_torch_names_split_into_params_and_buffers(loads):
    _, generic = loads
    assert isinstance(generic.model, TorchCausalLM)
    assert "model.layers.0.self_attn.q_proj.weight" in generic.variables["params"]
    assert set(generic.variables["buffers"]) >= {"model.rotary_emb.inv_freq"}
    names = TorchLayout().logical_names(generic.variables)
    assert names["params"]["model.layers.1.mlp.down_proj.weight"] == PartitionSpec("embed", "mlp")
    assert names["params"]["model.norm.weight"] == PartitionSpec()  # no glob: the size rule places it


def test_loss_and_gradients_match_the_native_load(loads):
    """Both compute the same float32 model, differently ordered: fp32 logits agree to about 1e-5 of their size
    (tests/interop/test_families.py), so the loss to 1e-5 relative; each gradient leaf to 1e-4 of its largest
    entry (a backward pass doubles the chain). Observed: loss 1.2e-7 relative, gradients 2.8e-6
    of each leaf's largest entry."""
    native, generic = loads
    batch, step = _batch(), Step(0, jax.random.key(0))
    ours = LMObjective(native.model, SEQ, pretrained=native.variables)
    theirs = LMObjective(generic.model, SEQ, pretrained=generic.variables)
    loss = lambda objective, variables: objective.reduce_loss(objective.loss(variables, batch, step)[0])[0]
    native_loss, native_grads = jax.value_and_grad(loss, argnums=1)(ours, native.variables)
    buffers = generic.variables["buffers"]
    torch_loss, torch_grads = jax.jit(jax.value_and_grad(lambda p: loss(theirs, {"params": p, "buffers": buffers})))(
        generic.variables["params"])
    np.testing.assert_allclose(float(torch_loss), float(native_loss), rtol=1e-5)
    worst = 0.0
    for name, theirs_grad in torch_grads.items():  # every parameter, by its torch name
        path = name.removeprefix("model.").removesuffix(".weight").replace("layers.", "layers_").split(".")
        ours_leaf = native_grads["params"]
        for key in path:
            ours_leaf = ours_leaf[key]
        (ours_grad,) = ours_leaf.values()  # kernel [in, out], embedding or scale
        theirs_grad = theirs_grad.T if theirs_grad.ndim == 2 and "embed_tokens" not in name else theirs_grad
        scale = float(jnp.abs(ours_grad).max())
        np.testing.assert_allclose(theirs_grad, ours_grad, atol=1e-4 * scale, err_msg=name)
        worst = max(worst, float(jnp.abs(theirs_grad - ours_grad).max()) / scale)
    assert worst < 1e-4, worst


def test_it_trains_through_the_trainer_with_buffers_never_updated(loads):
    _, generic = loads
    objective = LMObjective(generic.model, SEQ, pretrained=generic.variables, ema_decay=None)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    state = trainer.init_state()
    start = jax.tree_util.tree_map(np.asarray, state.params)
    batch = place_batch(trainer.mesh, _batch())
    step = trainer.compile_step(state, batch)
    losses = []
    for _ in range(3):
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
    assert losses[2] < losses[0]
    moved = [name for name, value in state.params["params"].items()
             if not np.array_equal(np.asarray(value), start["params"][name])]
    assert sorted(moved) == sorted(start["params"])  # every parameter trained
    for name, value in state.params["buffers"].items():
        np.testing.assert_array_equal(np.asarray(value), start["buffers"][name])


def test_generation_and_other_fallbacks_are_refused_by_name(loads, tmp_path):
    _, generic = loads
    with pytest.raises(TypeError, match=r"text_generation\(\) is not built for a tier-3"):
        generic.text_generation()
    with pytest.raises(ValueError, match="the one fallback is 'torchax'"):
        load_pretrained(tmp_path, fallback="torch")
