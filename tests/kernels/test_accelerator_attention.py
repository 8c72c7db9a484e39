"""dew.kernels.accelerator_attention: splash's attention against Dew's XLA attention (`attend`) for every mask Dew
computes, forward and backward; on the CPU through Pallas's interpreter, on a TPU natively. And the choice of
kernel by backend, and cuDNN's formulation (jax.nn's, run by XLA off a GPU)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models
from dew.kernels import accelerator_attention as accelerator
from dew.kernels import policy
from dew.nn.attention import attend, attention_mask
from dew.sampling import Sampling, generate

ON_TPU = jax.default_backend() == "tpu"
# Off a TPU splash runs in Pallas's interpreter, in float32: its sums in another order than attend's, 1e-5 covers
# a softmax over at most 256 keys. On a TPU, float32 operands are multiplied in bfloat16 passes inside the kernel
# and by XLA's default precision outside: scores of unit-normal 32-wide heads (about 6 in size) carry errors near
# 6 * 2**-8, each probability that much relative error, so an output (a mean of unit-normal values) 3e-2.
TOLERANCE = 3e-2 if ON_TPU else 1e-5


def kernels_here():
    """Splash where it runs: natively on a TPU, through the interpreter elsewhere."""
    return contextlib.nullcontext() if ON_TPU else accelerator.interpreting()


def _operands(S, H, K, D, V, seed=0, B=2):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return normal(B, S, H, D), normal(B, S, K, D), normal(B, S, K, V), normal(B, S, H, V)


def _compare(q, k, v, cotangent, mask, kernel_call, softcap=None):
    """The forward pass and the gradients of `<out, cotangent>` of splash against `attend`, over real queries."""
    scale = q.shape[-1] ** -0.5
    reference = lambda q, k, v: attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, scale=scale,  # noqa: E731
                                       softcap=softcap)
    real = jnp.any(mask, axis=-1)[:, :, None, None]  # a query with no allowed key is padding nothing reads
    weighted = lambda run: lambda q, k, v: jnp.sum(jnp.where(real, run(q, k, v) * cotangent, 0.0))  # noqa: E731
    # the output and its gradients as one program (op by op, the interpreter's steps cost seconds)
    both = lambda run: jax.jit(lambda q, k, v: (run(q, k, v), jax.grad(weighted(run), argnums=(0, 1, 2))(q, k, v)))  # noqa: E731
    with jax.default_matmul_precision("highest"):
        expected, expected_grads = both(reference)(q, k, v)
    with kernels_here():
        got, got_grads = both(kernel_call)(q, k, v)
    assert float(jnp.max(jnp.abs(jnp.where(real, got - expected, 0.0)))) <= TOLERANCE
    for g, e in zip(got_grads, expected_grads):
        assert float(jnp.max(jnp.abs(g - e))) <= TOLERANCE * max(1.0, float(jnp.max(jnp.abs(e))))


def _slots(B, S):
    return jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))


@pytest.mark.parametrize("case", ["causal", "window", "full", "segments", "softcap", "padded", "narrow_values"])
def test_splash_matches_attend_under_each_static_mask(case):
    """Causal, a sliding window, bidirectional, packed documents with padding, a score cap, a length that is
    not a whole tile (padded inside), and values narrower than keys (latent attention's) over grouped heads."""
    S = {"window": 256, "padded": 136}.get(case, 128)
    H, K, D, V = 4, 2, 32, (16 if case == "narrow_values" else 32)
    q, k, v, cotangent = _operands(S, H, K, D, V)
    B = q.shape[0]
    causal, window, softcap = case != "full", (37 if case == "window" else None), (5.0 if case == "softcap" else None)
    segments = None
    if case == "segments":  # two documents and padding in row 0, one document in row 1
        segments = jnp.asarray([[1] * 70 + [2] * 40 + [0] * 18, [1] * 128], jnp.int32)
    seg = jnp.ones((B, S), jnp.int32) if segments is None else segments
    mask = attention_mask(_slots(B, S), _slots(B, S), seg, seg, causal=causal, window=window)
    call = lambda q, k, v: accelerator.splash_attention(q, k, v, scale=D**-0.5, causal=causal, window=window,  # noqa: E731
                                                        softcap=softcap, segments_BS=segments)
    _compare(q, k, v, cotangent, mask, call, softcap)


def test_splash_matches_attend_under_a_mask_given_whole():
    """A mask that depends on the batch (an image's tokens read each other in both directions, Gemma 3's) runs as
    a boolean mask per row, its fully masked tiles skipped."""
    B, S, H, K, D = 2, 256, 2, 1, 32
    q, k, v, cotangent = _operands(S, H, K, D, D, seed=1)
    groups = np.full((B, S), -1, np.int32)
    groups[0, 20:84], groups[1, 150:230] = 0, 0
    seg = jnp.ones((B, S), jnp.int32)
    mask = attention_mask(_slots(B, S), _slots(B, S), seg, seg, causal=True, window=None,
                          q_groups_BS=jnp.asarray(groups), k_groups_BT=jnp.asarray(groups))
    call = lambda q, k, v: accelerator.splash_attention(q, k, v, scale=D**-0.5, mask_BST=mask)  # noqa: E731
    _compare(q, k, v, cotangent, mask, call)


def _decoder(attention: str, **fields):
    return models.build("causal_transformer", vocab_size=64, emb_features=64, num_layers=4, num_heads=4,
                        num_kv_heads=2, mlp_features=96, max_seq_len=256, scan_layers=1, attention=attention,
                        **fields)


def test_a_decoder_trains_the_same_through_splash():
    """A scanned run mixing sliding and full layers (the layer's window picked among static kernels) over packed
    documents: splash's loss and gradients are XLA's."""
    fields = dict(layer_types=("sliding_attention", "full_attention") * 2, sliding_window=50)
    xla, splash = _decoder("xla", **fields), _decoder("splash", **fields)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 160)), jnp.int32)
    segments = jnp.asarray([[1] * 100 + [2] * 60, [1] * 160], jnp.int32)
    params = xla.init(jax.random.key(0), tokens)

    def loss(model, p):
        return jnp.mean(model.apply(p, tokens, segment_ids=segments).astype(jnp.float32) ** 2)

    with jax.default_matmul_precision("highest"):  # one program each: op by op, the interpreter's steps cost seconds
        expected, expected_grads = jax.jit(jax.value_and_grad(lambda p: loss(xla, p)))(params)
    with kernels_here(), policy.recording() as choices:
        got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(splash, p)))(params)
    assert choices["attention/float32"] == "splash"
    # float32 sums in other orders through four layers and the head (on a TPU, bfloat16 passes: see TOLERANCE)
    assert abs(float(got) - float(expected)) <= (1e-2 if ON_TPU else 1e-6) * abs(float(expected))
    largest = max(float(jnp.max(jnp.abs(e))) for e in jax.tree_util.tree_leaves(expected_grads))
    difference = max(float(jnp.max(jnp.abs(g - e))) for g, e in zip(jax.tree_util.tree_leaves(got_grads),
                                                                     jax.tree_util.tree_leaves(expected_grads)))
    assert difference <= (3e-2 if ON_TPU else 1e-5) * largest


def test_a_prefill_into_a_fresh_cache_reads_its_own_keys_through_splash():
    """Greedy generation whose prefill runs in splash (the prompts' own keys, under the mask their cache would
    give them, a shorter prompt padded) continues as XLA's does."""
    xla, splash = _decoder("xla"), _decoder("splash")
    prompts = [[5, 9, 11, 3], [7, 1, 2, 3, 4, 5]]
    params = xla.init(jax.random.key(1), jnp.asarray([prompts[1]], jnp.int32))
    run = lambda model: generate(model, params, prompts, 6, key=jax.random.key(0),  # noqa: E731
                                 sampling=Sampling(temperature=0.0)).tokens
    with jax.default_matmul_precision("highest"):
        expected = run(xla)
        with kernels_here(), policy.recording() as choices:
            got = run(splash)
    assert choices["attention/float32"] == "splash"
    np.testing.assert_array_equal(got, expected)


def test_the_kernel_is_chosen_by_backend_and_refused_where_it_cannot_run():
    choose = lambda impl, **kw: accelerator.choose(impl, jnp.bfloat16, **{  # noqa: E731
        **dict(q_width=64, v_width=64, softcap=None, dynamic=False, segmented=False), **kw})
    assert choose("xla") == "xla"
    if jax.default_backend() == "cpu":
        assert choose("auto") == "xla"  # the CPU keeps Dew's own attention and its kernels
        with pytest.raises(ValueError, match="runs on a TPU and this process's backend is cpu"):
            choose("splash")
        with pytest.raises(ValueError, match="runs on a GPU and this process's backend is cpu"):
            choose("cudnn")
        with accelerator.interpreting():
            assert choose("auto") == "splash"
    with pytest.raises(ValueError, match="not an attention implementation"):
        accelerator.check("flash")
    # cuDNN's conditions, whatever the backend: half-precision, one mask without segments or a cap, equal widths
    assert accelerator._cudnn_applies(jnp.bfloat16, 128, 128, None, False, False)
    for bad in ((jnp.float32, 64, 64, None, False, False), (jnp.bfloat16, 192, 128, None, False, False),
                (jnp.bfloat16, 64, 64, 30.0, False, False), (jnp.bfloat16, 64, 64, None, True, False),
                (jnp.bfloat16, 64, 64, None, False, True)):
        assert not accelerator._cudnn_applies(*bad)


@pytest.mark.parametrize("window", [None, 9])
def test_cudnn_formulation_is_attend(window):
    """`cudnn_attention`'s call of jax.nn (grouped heads, the window as cuDNN's left size), run here by XLA."""
    q, k, v, _ = _operands(24, 4, 2, 16, 16, seed=2)
    B, S = q.shape[:2]
    seg = jnp.ones((B, S), jnp.int32)
    mask = attention_mask(_slots(B, S), _slots(B, S), seg, seg, causal=True, window=window)
    with jax.default_matmul_precision("highest"):
        expected = attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, scale=16**-0.5)
        got = accelerator.cudnn_attention(q, k, v, scale=16**-0.5, window=window, implementation=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)
