"""IndexerTraining: the KL by hand, which parameters each phase's terms reach, a warm-up that leaves
every frozen weight bit-identical, fresh indexer weights for a checkpoint without them, the refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer
from dew.nn.mla import KL_EPS, LatentAttention, indexer_kl
from dew.nn.transformer import CausalTransformer, DecoderConfig
from dew.objectives.base import Step
from dew.objectives.lm import IndexerTraining, LMObjective
from tests.compiled import compiled

LATENT = LatentAttention(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=4, value_dim=6, index_heads=2, index_head_dim=8)
SHAPE = dict(vocab_size=40, emb_features=32, num_layers=2, num_heads=4, mlp_features=48, max_seq_len=32)
SEQ = 10
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))  # the loss runs with the step's key as dropout rng
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, 40, (2, SEQ + 1)), jnp.int32)
SEGMENTS = jnp.asarray([[1] * 6 + [2] * 5, [1] * 8 + [0] * 3])


def model(topk: int | None) -> CausalTransformer:
    return CausalTransformer(DecoderConfig(**SHAPE, latent=dataclasses.replace(LATENT, index_topk=topk)))


def test_kl_by_hand():
    """Two heads, one query, three keys of which two are kept: p is the heads' probabilities summed and
    normalised over the kept keys, q the softmax of the indexer's scores over them."""
    attention = np.array([[[[0.5, 0.5, 0.0]], [[0.2, 0.8, 0.0]]]], np.float32)  # [B, H, S, T]
    scores = np.array([[[1.0, 0.0, 5.0]]], np.float32)
    keep = np.array([[[True, True, False]]])
    p = np.array([0.7, 1.3]) / (2.0 + KL_EPS)
    q = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    expected = np.sum(p * (np.log(p + KL_EPS) - np.log(q + KL_EPS)))
    np.testing.assert_allclose(np.asarray(indexer_kl(jnp.asarray(attention), jnp.asarray(scores), jnp.asarray(keep))),
                               [[expected]], rtol=1e-6)  # fp32 over three terms of order one


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def _reached(objective, variables, term) -> tuple[set, set]:
    """(indexer leaves, other leaves) with a non-zero gradient of `term(statistics)`."""
    batch = {"text": TOKENS, "text_segment_ids": SEGMENTS}

    def loss(params):
        return term(objective.loss({**variables, "params": params}, batch, STEP)[0])

    grads = _leaves(compiled(jax.grad(loss), variables["params"]))
    moved = {path for path, grad in grads.items() if np.any(grad != 0)}
    return {p for p in moved if "['indexer']" in p}, {p for p in moved if "['indexer']" not in p}


@pytest.mark.slow
def test_warmup_kl_reaches_only_the_indexers():
    objective = LMObjective(model(None), SEQ, indexer=IndexerTraining("warmup"))
    variables = compiled(objective.init, jax.random.key(0))
    indexed, others = _reached(objective, variables, lambda stats: stats.terms["indexer_kl"].total)
    assert others == set()
    assert len(indexed) == 2 * 5  # wq_b, wk, weights_proj, k_norm's scale and bias, in both layers
    assert objective.trainable("params/layers_0/self_attn/indexer/wk/kernel")
    assert not objective.trainable("params/layers_0/self_attn/q_a_proj/kernel")


@pytest.mark.slow
def test_sparse_cross_entropy_skips_the_indexers_and_the_kl_reaches_only_them():
    objective = LMObjective(model(3), SEQ, indexer=IndexerTraining("sparse", weight=0.5))
    variables = compiled(objective.init, jax.random.key(0))
    indexed, others = _reached(objective, variables, lambda stats: stats.ce.total)
    assert indexed == set() and len(others) > 10
    indexed, others = _reached(objective, variables, lambda stats: stats.terms["indexer_kl"].total)
    assert others == set() and len(indexed) == 2 * 5
    scores = objective.token_scores(variables, TOKENS, segment_ids=SEGMENTS, indexer=True)
    selected = np.asarray(scores.indexer.selected)
    assert selected.shape == (2, 2, SEQ, SEQ)  # layers, rows, queries, keys
    assert selected.sum(-1).max() == 3  # the top 3 keys, fewer for the first queries


def _stream(batch: int = 2) -> Dataset:
    def train(partition):
        step = 0
        while True:
            yield {"text": np.random.default_rng(step).integers(1, 40, (batch, SEQ + 1)).astype(np.int32)}
            step += 1

    return Dataset(train=train, val=None, records=10**6, batch=batch)


@pytest.mark.slow
def test_warmup_leaves_every_frozen_weight_bit_identical():
    """Three optimizer steps from a checkpoint without indexer weights (a DeepSeek-V3 one): they start
    fresh, they train, and every other weight, the balancing bias included, is what it was, bit for bit."""
    decoder = model(None)
    full = compiled(decoder.init, jax.random.key(3), jnp.zeros((1, SEQ), jnp.int32))
    without = jax.tree_util.tree_map(lambda x: x, full)
    for layer in ("layers_0", "layers_1"):
        del without["params"][layer]["self_attn"]["indexer"]
    objective = LMObjective(decoder, SEQ, indexer=IndexerTraining("warmup"), pretrained=without, ema_decay=None)
    state = Trainer(objective, optax.adam(1e-2), key=jax.random.key(2)).fit(_stream(), steps=3, verbose=False)
    before, after = _leaves(without), _leaves(state.params)
    assert {p for p in after if "['indexer']" in p} and not {p for p in before if "['indexer']" in p}
    for path, old in before.items():
        np.testing.assert_array_equal(after[path], old, err_msg=path)
    fresh = _leaves(compiled(objective.init, jax.random.key(2), without))
    assert any(not np.array_equal(after[p], fresh[p]) for p in after if "['indexer']" in p)


def test_refusals_name_the_fix():
    plain = CausalTransformer(DecoderConfig(**SHAPE, latent=dataclasses.replace(LATENT, index_heads=0)))
    with pytest.raises(ValueError, match="has none: build it with latent=LatentAttention"):
        LMObjective(plain, SEQ, indexer=IndexerTraining("warmup"))
    with pytest.raises(ValueError, match="phase='sparse'.*no index_topk"):
        LMObjective(model(None), SEQ, indexer=IndexerTraining("sparse"))
    with pytest.raises(ValueError, match="top 3: build it with index_topk None"):
        LMObjective(model(3), SEQ, indexer=IndexerTraining("warmup"))
    with pytest.raises(ValueError, match="z_loss=0.1 has nothing to act on"):
        LMObjective(model(None), SEQ, indexer=IndexerTraining("warmup"), z_loss=0.1)
    with pytest.raises(ValueError, match="phase is 'cold'"):
        IndexerTraining("cold")
    with pytest.raises(ValueError, match="index_topk is 3.*index_heads >= 1"):
        LatentAttention(index_topk=3)
    with pytest.raises(ValueError, match="q_rank is None"):
        LatentAttention(q_rank=None, index_heads=2)
    decoder = model(None)
    objective = LMObjective(decoder, SEQ, indexer=IndexerTraining("warmup"))
    full = decoder.init(jax.random.key(3), jnp.zeros((1, SEQ), jnp.int32))
    del full["params"]["norm"]
    with pytest.raises(ValueError, match=r"lack \[\"\['params'\]\['norm'\]\['scale'\]\"\]"):
        objective.init(jax.random.key(0), full)
