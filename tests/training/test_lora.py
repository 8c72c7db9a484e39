"""LoRA: adapters on a decoder's linears, trained alone (the base bit-identical, the optimizer state and
the EMA holding only adapters), resumed exactly, merged into the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.nn.lora import LoRA, adapters
from dew.objectives.lm import LMObjective
from dew.trees import split
from tests.conftest import TINY
from tests.tolerances import assert_within, decoder_ulps, ulp_bound

SEQ = 8
LORA = LoRA(rank=4, alpha=8.0)


def _stream(batch: int = 4) -> Dataset:
    def train(partition):
        step = 0
        while True:
            yield {"text": np.random.default_rng(step).integers(1, 64, (batch, SEQ + 1)).astype(np.int32)}
            step += 1

    return Dataset(train=train, val=None, records=10**6, batch=batch)


@pytest.fixture(scope="module", params=["per_layer", "scanned"])
def adapted(request):
    """(the base model, the adapted one, base variables with fresh adapters): layers unrolled, or one
    scanned run whose adapters are stacked like its kernels."""
    base = models.build("causal_transformer", **{**TINY, "scan_layers": 0 if request.param == "per_layer" else 1})
    base_variables = base.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32), head=False)
    model = LORA.adapt(base)
    return base, model, model.attach(jax.random.key(1), base_variables)


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def test_targets_that_match_no_linear_are_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match=r"LoRA targets \['qkv_proj'\] match no linear of this model; its linears "
                                         r"are \['mlp/down_proj', .*'self_attn/q_proj', 'self_attn/v_proj'\]"):
        LoRA(targets=("q_proj", "qkv_proj")).adapt(tiny_model)
    with pytest.raises(ValueError, match="LoRA rank is 0"):
        LoRA(rank=0)


def test_adapters_sit_beside_the_targeted_kernels_and_start_at_no_change(adapted):
    base, model, variables = adapted
    found = _leaves(adapters(variables))
    scanned = base.config.scan_layers == 1
    stack = (TINY["num_layers"],) if scanned else ()
    # The default targets: the seven projections of every layer, stacked in a scanned run.
    assert len(found) == 2 * 7 * (1 if scanned else TINY["num_layers"])
    key = "['params']['layers_0to1']" if scanned else "['params']['layers_0']"
    assert found[f"{key}['self_attn']['q_proj']['lora_A']"].shape == (*stack, 32, 4)
    assert found[f"{key}['mlp']['down_proj']['lora_B']"].shape == (*stack, 4, 32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, SEQ)), jnp.int32)
    # B starts at zero: the adapter's term is an exact zero added in float32.
    np.testing.assert_array_equal(model.apply(variables, tokens), base.apply(model.merge(variables), tokens))
    np.testing.assert_array_equal(model.apply(variables, tokens),
                                  base.apply({"params": split(variables["params"], lambda p: not LoRA.trainable(p))[0]},
                                             tokens))


def _objective(model, variables, ema_decay=0.9):
    return LMObjective(model, SEQ, ema_decay=ema_decay, pretrained=variables, trainable=LoRA.trainable)


@pytest.mark.slow
def test_only_adapters_train_and_only_they_have_optimizer_state_and_an_ema(adapted, tmp_path):
    base, model, variables = adapted
    objective = _objective(model, variables)
    straight = Trainer(objective, optax.adamw(1e-2, weight_decay=0.1), key=jax.random.key(2)).fit(
        _stream(), steps=4, verbose=False)
    before, after = _leaves(variables), _leaves(straight.params)
    for path, old in before.items():
        if "lora_" in path:
            # B leaves zero and A moves once B does: every adapter leaf trained.
            assert not np.array_equal(old, after[path]), path
        else:
            np.testing.assert_array_equal(after[path], old, err_msg=path)  # the base, bit for bit
    adapter_shapes = sorted(leaf.shape for path, leaf in before.items() if "lora_" in path)
    assert sorted(leaf.shape for leaf in _leaves(straight.ema).values()) == adapter_shapes
    moments = [leaf.shape for leaf in _leaves(straight.opt_state).values() if leaf.ndim]
    assert sorted(moments) == sorted(adapter_shapes * 2)  # adam's mu and nu, for adapters only
    # state.averaged is the whole model: the EMA's adapters over the frozen base.
    assert _leaves(straight.averaged).keys() == after.keys()

    # Resume: two steps, a checkpoint, two more, equals four straight, bit for bit.
    Trainer(objective, optax.adamw(1e-2, weight_decay=0.1), key=jax.random.key(2)).fit(
        _stream(), steps=2, checkpoint_dir=str(tmp_path), verbose=False)
    resumed = Trainer(objective, optax.adamw(1e-2, weight_decay=0.1), key=jax.random.key(2)).fit(
        _stream(), steps=4, checkpoint_dir=str(tmp_path), verbose=False)
    for tree in ("params", "ema", "opt_state"):
        ours, theirs = _leaves(getattr(resumed, tree)), _leaves(getattr(straight, tree))
        assert ours.keys() == theirs.keys()
        for path in ours:
            np.testing.assert_array_equal(ours[path], theirs[path], err_msg=f"{tree} {path}")

    # Merged into the kernels, the base model computes the adapted forward. fp32: the merged kernel rounds
    # W + s A B once per entry, and the adapted path rounds x A (32 terms), (x A) B (4 terms), the scaling
    # and the add, each an ulp of that projection's terms; the decoder's own chain carries them to the
    # logits as decoder_ulps (libraries=1) does its own roundings, so 38 more roundings per projection,
    # seven projections a layer, add to its count. Bound 3.0e-5 at the largest logit, 0.42; observed 8.9e-8.
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, SEQ)), jnp.int32)
    adapted_logits = np.asarray(model.apply(straight.params, tokens))
    merged_logits = np.asarray(base.apply(model.merge(straight.params), tokens))
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=SEQ, libraries=1)
    ulps += 2 * 7 * 38
    assert_within(merged_logits, adapted_logits, ulp_bound(ulps, np.abs(adapted_logits).max()), "merged logits")
    assert not np.array_equal(adapted_logits, np.asarray(base.apply(variables, tokens)))


def test_the_adapted_models_shapes_and_names_hold_the_adapters_and_the_decoders_do_not():
    """Each model keeps the shapes it traced once: asking the decoder first, the adapted model second, or
    the other way round, gives each its own (adapters on the adapted model only), its names leaf for leaf
    with its shapes (what placement and the FLOPs count pair up)."""
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    paths = lambda tree: [jax.tree_util.keystr(path)  # noqa: E731
                          for path, _ in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_spec)]
    for adapted_first in (False, True):
        base = models.build("causal_transformer", **{**TINY, "num_layers": 1 + adapted_first})
        model = LORA.adapt(base)
        for each in ([model, base] if adapted_first else [base, model]):
            names, shapes = paths(each.logical_names()), paths(each.variable_shapes())
            adapters = [path for path in names if "lora_" in path]
            assert bool(adapters) == (each is model), (adapted_first, adapters[:2])
            assert names == shapes


def test_dropout_applies_only_with_a_dropout_key(tiny_model):
    variables = tiny_model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32), head=False)
    model = LoRA(rank=4, alpha=8.0, dropout=0.5).adapt(tiny_model)
    adapted = model.attach(jax.random.key(1), variables)
    # Nonzero B, so the adapters' input matters.
    adapted = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.full_like(leaf, 0.1) if "lora_B" in jax.tree_util.keystr(path) else leaf, adapted)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (2, SEQ)), jnp.int32)
    plain = model.apply(adapted, tokens)
    np.testing.assert_array_equal(model.apply(adapted, tokens), plain)  # no key: no dropout, deterministic
    dropped = model.apply(adapted, tokens, rngs={"dropout": jax.random.key(5)})
    assert not np.allclose(dropped, plain)
    np.testing.assert_array_equal(model.apply(adapted, tokens, rngs={"dropout": jax.random.key(5)}), dropped)
    no_dropout = LoRA(rank=4, alpha=8.0).adapt(tiny_model)
    np.testing.assert_array_equal(no_dropout.apply(adapted, tokens, rngs={"dropout": jax.random.key(5)}), plain)


def test_a_filter_that_keeps_nothing_is_refused(tiny_model):
    objective = LMObjective(tiny_model, SEQ, trainable=LoRA.trainable)  # a model without adapters
    with pytest.raises(ValueError, match="trainable accepts no parameter of the model"):
        Trainer(objective, optax.sgd(0.1), key=jax.random.key(0)).init_state()


def test_lm_objective_trains_with_adapter_dropout_and_evaluates_without(tiny_model):
    """The training loss runs the model with the step's key as its dropout rng; evaluation with none."""
    from dew.objectives.base import Step

    variables = tiny_model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32), head=False)
    batch = {"text": jnp.asarray(np.random.default_rng(6).integers(0, 64, (2, SEQ + 1)), jnp.int32)}
    step = Step(jnp.asarray(0), jax.random.key(7))
    losses = {}
    for rate in (0.0, 0.5):
        model = LoRA(rank=4, alpha=8.0, dropout=rate).adapt(tiny_model)
        adapted = jax.tree_util.tree_map_with_path(  # nonzero B, so the adapters' input matters
            lambda path, leaf: jnp.full_like(leaf, 0.1) if "lora_B" in jax.tree_util.keystr(path) else leaf,
            model.attach(jax.random.key(1), variables))
        objective = _objective(model, adapted)
        train = lambda step: objective.reduce_loss(objective.loss(adapted, batch, step)[0])[0]
        losses[rate] = (train(step), objective.evaluate(adapted, batch, step).ce.total)
        # Each step draws its own mask; the same step the same one.
        assert (train(Step(jnp.asarray(1), jax.random.key(8))) != losses[rate][0]) == (rate > 0)
        np.testing.assert_array_equal(train(step), losses[rate][0])
    # Without dropout the training and the evaluation pass compute the same thing, bit for bit.
    np.testing.assert_array_equal(losses[0.0][0], losses[0.0][1])
    assert losses[0.5][0] != losses[0.0][0]
    np.testing.assert_array_equal(losses[0.5][1], losses[0.0][1])  # evaluation draws no mask


def test_the_pipeline_generates_from_the_averaged_adapters_over_the_frozen_base(adapted):
    """With frozen parameters the EMA holds only the adapters: the pipeline lays it over the base."""
    base, model, variables = adapted
    objective = _objective(model, variables)
    trainer = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(2))
    state = trainer.init_state()
    task = objective.pipeline(state)
    assert _leaves(task.params).keys() == _leaves(state.params).keys()
    assert objective.pipeline(state, ema=False).params is state.params
