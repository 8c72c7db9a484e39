"""The mixture of experts: routers and blocks against transformers, the grouped matmul, capacity,
routes replay, the decoder's mixture knob, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dew import models
from dew.nn import grouped
from dew.nn.moe import Mixture, Router, Routes, SparseMLP, SparseSpec, drop_overflow
from tests.compile_flags import devices_environment
from tests.compiled import compiled
from tests.tolerances import LIBRARY_ULPS, assert_within, ulp_bound

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WIDTH, FEATURES, EXPERTS, TOP_K = 32, 24, 8, 2
F32_EPS = float(np.finfo(np.float32).eps)

# Each block as transformers builds it, and the Mixture that routes the same way.
BLOCKS = {
    "mixtral": dict(mixture=Mixture(EXPERTS, TOP_K), off=dict(norm_topk_prob=False)),
    "qwen2_moe": dict(mixture=Mixture(EXPERTS, TOP_K, norm_topk_prob=False, shared_features=40, shared_gate=True),
                      off=dict(shared_gate=False)),
    # A group scored by its best expert limits a token's top-2 only when fewer groups than 2 are kept.
    "deepseek_v2": dict(mixture=Mixture(EXPERTS, TOP_K, norm_topk_prob=False, scaling=1.5, groups=4,
                                        groups_per_token=1, group_score="max", shared_features=48),
                        off=dict(groups=1, groups_per_token=1)),
    "deepseek_v3": dict(mixture=Mixture(EXPERTS, TOP_K, score_function="sigmoid", scaling=2.5, groups=4,
                                        groups_per_token=2, bias=True, shared_features=24),
                        off="bias"),
}


def _torch_block(family: str):
    common = dict(hidden_size=WIDTH, num_experts_per_tok=TOP_K, hidden_act="silu")
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        return MixtralSparseMoeBlock(transformers.MixtralConfig(**common, intermediate_size=FEATURES,
                                                                num_local_experts=EXPERTS))
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        return Qwen2MoeSparseMoeBlock(transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=FEATURES, shared_expert_intermediate_size=40, num_experts=EXPERTS,
            norm_topk_prob=False))
    if family == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
        return DeepseekV2Moe(transformers.DeepseekV2Config(
            **common, moe_intermediate_size=FEATURES, n_routed_experts=EXPERTS, n_group=4, topk_group=1,
            topk_method="group_limited_greedy", routed_scaling_factor=1.5, n_shared_experts=2))
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    return DeepseekV3MoE(transformers.DeepseekV3Config(
        **common, moe_intermediate_size=FEATURES, n_routed_experts=EXPERTS, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1))


def _block(mixture: Mixture, x_BSD, seed: int = 0):
    """A Dew sparse block and its variables: expert weights widened to outputs of order 10, a router
    whose logits stay under 1 in size (so their rounding stays far below the weights' tolerance), and
    a nonzero balancing bias."""
    block = SparseMLP(SparseSpec(mixture, FEATURES))
    variables = nn.meta.unbox(compiled(block.init, jax.random.key(seed), x_BSD))

    def widen(path, leaf):
        name = jax.tree_util.keystr(path)
        if "gate']['kernel" in name and "shared" not in name:
            return leaf * 0.5
        if "e_score_correction_bias" in name:
            return 0.05 * jax.random.normal(jax.random.key(seed + 1), leaf.shape)
        return leaf * 10.0

    return block, jax.tree_util.tree_map_with_path(widen, variables)


def _copy_into(torch_block, variables, family):
    params = variables["params"]
    t = lambda x: torch.from_numpy(np.array(x, np.float32, copy=True))
    experts = params["experts"]
    state = {
        "gate.weight": t(params["gate"]["kernel"].T),
        "experts.gate_up_proj": t(np.concatenate([np.swapaxes(experts["gate_proj"]["kernel"], 1, 2),
                                                  np.swapaxes(experts["up_proj"]["kernel"], 1, 2)], axis=1)),
        "experts.down_proj": t(np.swapaxes(experts["down_proj"]["kernel"], 1, 2)),
    }
    if "shared_experts" in params:
        shared = "shared_expert" if family == "qwen2_moe" else "shared_experts"
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"{shared}.{name}.weight"] = t(params["shared_experts"][name]["kernel"].T)
    if "shared_expert_gate" in params:
        state["shared_expert_gate.weight"] = t(params["shared_expert_gate"]["kernel"].T)
    if "moe" in variables:
        state["gate.e_score_correction_bias"] = t(variables["moe"]["gate"]["e_score_correction_bias"])
    missing, unexpected = torch_block.load_state_dict(state, strict=True)
    assert not missing and not unexpected


def _sorted_by_expert(experts_NK, weights_NK):
    order = np.argsort(experts_NK, axis=1)
    return np.take_along_axis(experts_NK, order, 1), np.take_along_axis(weights_NK, order, 1)


def _bounds(mixture, x_ND, variables, weights, y_ND):
    """(per-weight bound, per-output bound) on |Dew - transformers| for a block.

    Router logits: a WIDTH-term fp32 dot, whose rounding walks at most sqrt(6 (WIDTH + 1)) ulps of
    the sum of |x_i w_i|; a weight moves by at most its scaling times 1/2 per unit of logit error (a
    softmax or a normalised sigmoid: the derivatives' absolute sum). On top, the weight's own
    roundings relative to its size: the scores' exp from two libraries (LIBRARY_ULPS) and again in
    the normaliser, then a sum, a division and the scaling (3). Each expert's output: gate and up
    (WIDTH terms each), the activation (3), down (FEATURES terms), the combination (TOP_K), and the
    shared expert's as many: a random walk of sqrt(6 N) ulps of the outputs' size plus silu's exp
    from two libraries, and TOP_K weight errors times the outputs' size."""
    kernel = np.asarray(variables["params"]["gate"]["kernel"])
    logit_error = ulp_bound(math.sqrt(6 * (WIDTH + 1)), float(np.max(np.abs(x_ND) @ np.abs(kernel))))
    weight_bound = mixture.scaling * 0.5 * logit_error + ulp_bound(2 * LIBRARY_ULPS + 3, np.abs(weights))
    roundings = 2 * (2 * WIDTH + 3 + FEATURES) + TOP_K + 2
    size = float(np.max(np.abs(y_ND)))
    output_bound = (ulp_bound(math.sqrt(6 * roundings) + 2 * LIBRARY_ULPS, size)
                    + TOP_K * float(np.max(weight_bound)) * size)
    return weight_bound, output_bound


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_block_matches_transformers(family):
    mixture = BLOCKS[family]["mixture"]
    x_BSD = jax.random.normal(jax.random.key(7), (2, 24, WIDTH))
    block, variables = _block(mixture, x_BSD)
    y_BSD, record = compiled(block.apply, variables, x_BSD)
    reference = _torch_block(family).eval()
    _copy_into(reference, variables, family)
    x_torch = torch.from_numpy(np.asarray(x_BSD))
    with torch.no_grad():
        _, ref_weights, ref_experts = reference.gate(x_torch.reshape(-1, WIDTH))
        ref_y = reference(x_torch).numpy()
    ours_e, ours_w = _sorted_by_expert(np.asarray(record.experts).reshape(-1, TOP_K),
                                       np.asarray(record.weights).reshape(-1, TOP_K))
    theirs_e, theirs_w = _sorted_by_expert(ref_experts.numpy(), ref_weights.numpy())
    np.testing.assert_array_equal(ours_e, theirs_e)
    weight_bound, output_bound = _bounds(mixture, np.asarray(x_BSD).reshape(-1, WIDTH), variables, theirs_w, ref_y)
    # Under the issue's 1e-6 wherever the weights are at most 1 (no scaling); DeepSeek-V2's 1.5 and
    # V3's 2.5 scale the bound with them.
    assert np.max(weight_bound) <= 1e-6 * max(1.0, mixture.scaling)
    assert_within(ours_w, theirs_w, weight_bound, f"{family} router weights")  # observed: 2.4e-7 (deepseek_v3)
    assert_within(np.asarray(y_BSD), ref_y, output_bound, f"{family} block output")  # observed: 9.5e-7 at 8.1

    # Switching the feature off changes the output by far more than the tolerance.
    off = BLOCKS[family]["off"]
    if off == "bias":
        changed = {**variables, "moe": jax.tree_util.tree_map(jnp.zeros_like, variables["moe"])}
        y_off, _ = block.apply(changed, x_BSD)
    else:
        y_off, _ = SparseMLP(SparseSpec(dataclasses.replace(mixture, **off), FEATURES)).apply(variables, x_BSD)
    assert float(np.max(np.abs(np.asarray(y_off) - ref_y))) > 100 * output_bound


def test_gemma4_router_matches_transformers():
    """Gemma 4's router (`router_norm`, `expert_scale`): the input normed without a scale, times the learned
    `scale` and `width ** -0.5`, projected by `proj`; the top-k renormalised, times `per_expert_scale`."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    mixture = Mixture(EXPERTS, TOP_K, router_norm=True, expert_scale=True)
    x_ND = jax.random.normal(jax.random.key(8), (48, WIDTH))
    router = Router(mixture)
    variables = nn.meta.unbox(router.init(jax.random.key(9), x_ND))
    rng = np.random.default_rng(10)
    params = {"proj": {"kernel": jnp.asarray(rng.normal(size=(WIDTH, EXPERTS)), jnp.float32)},
              "scale": jnp.asarray(1 + 0.1 * rng.normal(size=WIDTH), jnp.float32),
              "per_expert_scale": jnp.asarray(1 + 0.3 * rng.normal(size=EXPERTS), jnp.float32)}
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(variables["params"])
    experts, weights, _, _ = router.apply({"params": params}, x_ND)

    reference = Gemma4TextRouter(transformers.Gemma4TextConfig(hidden_size=WIDTH, num_experts=EXPERTS,
                                                               top_k_experts=TOP_K, num_hidden_layers=1)).eval()
    state = {"proj.weight": torch.from_numpy(np.array(params["proj"]["kernel"]).T.copy()),
             "scale": torch.from_numpy(np.array(params["scale"])),
             "per_expert_scale": torch.from_numpy(np.array(params["per_expert_scale"]))}
    missing, unexpected = reference.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        _, their_weights, their_experts = reference(torch.from_numpy(np.array(x_ND)))
    ours_e, ours_w = _sorted_by_expert(np.asarray(experts), np.asarray(weights))
    theirs_e, theirs_w = _sorted_by_expert(their_experts.numpy(), their_weights.numpy())
    np.testing.assert_array_equal(ours_e, theirs_e)
    # The routed input carries the norm's WIDTH + 3 roundings, its rsqrt from two libraries and the two
    # scale products, relative to its size; the logits add a WIDTH-term dot, in units of the sum of
    # |routed_i w_i|. A weight moves by at most half the logit error (a softmax renormalised over the
    # top-k) times the largest per-expert scale, plus its own roundings (exp from two libraries in the
    # scores and in the normaliser, a sum, a division, the per-expert product). Bound 1.4e-5; observed 2.4e-7.
    routed = np.asarray(x_ND) / np.sqrt(np.mean(np.square(np.asarray(x_ND)), -1, keepdims=True))
    routed = np.abs(routed * np.asarray(params["scale"]) * WIDTH**-0.5)
    logit_size = float(np.max(routed @ np.abs(np.asarray(params["proj"]["kernel"]))))
    logit_error = ulp_bound(math.sqrt(6 * (2 * WIDTH + 6)) + LIBRARY_ULPS, logit_size)
    per_expert = float(np.max(np.abs(np.asarray(params["per_expert_scale"]))))
    weight_bound = per_expert * 0.5 * logit_error + ulp_bound(2 * LIBRARY_ULPS + 4, np.abs(theirs_w))
    assert_within(ours_w, theirs_w, weight_bound, "gemma 4 router weights")

    # Without the per-expert scale the weights move by far more than the bound.
    _, plain = Router(dataclasses.replace(mixture, expert_scale=False)).apply(
        {"params": {"proj": params["proj"], "scale": params["scale"]}}, x_ND)[:2]
    assert float(np.max(np.abs(_sorted_by_expert(np.asarray(experts), np.asarray(plain))[1] - theirs_w))) > (
        100 * float(np.max(weight_bound)))


@pytest.mark.parametrize("sizes", [(10, 0, 27, 9), (0, 0, 0, 46), (1, 2, 3, 4)])
def test_grouped_kernels_match_a_per_row_product(sizes):
    rows, width, features = 50, 16, 24
    rng = np.random.default_rng(sum(sizes))
    x = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    sizes_E = jnp.asarray(sizes, jnp.int32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(4, width, features)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(4, features, width)), jnp.float32)
    owner = np.repeat(np.arange(4), sizes)
    routed = len(owner)

    def per_row(x, w_gate, w_up, w_down):  # float64 numpy: each row with its expert's weights
        x = np.asarray(x, np.float64)[:routed]
        gate = np.einsum("md,mdf->mf", x, np.asarray(w_gate, np.float64)[owner])
        up = np.einsum("md,mdf->mf", x, np.asarray(w_up, np.float64)[owner])
        y = np.einsum("mf,mfd->md", gate / (1 + np.exp(-gate)) * up, np.asarray(w_down, np.float64)[owner])
        return np.concatenate([y, np.zeros((rows - routed, width))])

    expected = per_row(x, w_gate, w_up, w_down)
    # fp32 against float64: gate and up sum 16 terms, down 24, with silu between: a random walk of
    # sqrt(6 * 45) ulps, plus silu's exp, of the terms' sizes, which reach 10x the outputs' here.
    bound = ulp_bound(math.sqrt(6 * 45) + LIBRARY_ULPS, float(np.max(np.abs(expected))) * 10)
    for kernel in (grouped._tiled_forward, grouped._ragged_forward):
        y, _, _ = jax.jit(lambda *a: kernel(a[0], sizes_E, *a[1:], activation="silu"))(x, w_gate, w_up, w_down)
        assert_within(y, expected, bound, kernel.__name__)
        assert np.all(np.asarray(y)[routed:] == 0)  # rows of no expert give zeros
    # The custom VJP's two backward kernels agree with each other and with autodiff of the reference.
    cotangent = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    grads = jax.grad(lambda *a: jnp.sum(grouped.expert_mlp(a[0], sizes_E, *a[1:]) * cotangent),
                     argnums=(0, 1, 2, 3))(x, w_gate, w_up, w_down)
    residuals = grouped._expert_mlp_fwd(x, sizes_E, w_gate, w_up, w_down, "silu")[1]
    ragged = grouped._ragged_backward(*residuals, cotangent, activation="silu")
    for ours, theirs in zip(grads, ragged):
        scale = float(np.max(np.abs(np.asarray(theirs)))) or 1.0
        # Each gradient entry sums at most 46 rows of products of the sizes above: 64 ulps of the largest.
        assert_within(ours, theirs, ulp_bound(64, scale) + ulp_bound(math.sqrt(6 * 45), scale), "gradients")


def test_capacity_drops_overflow_slots_in_token_order():
    # One row, 3 tokens of 2 slots, 4 experts, capacity 2: expert 1 is chosen by all three tokens,
    # so the third token's slot for it is dropped (id 4), and nothing else.
    slots = jnp.asarray([[1, 0, 1, 2, 1, 3]], jnp.int32)
    np.testing.assert_array_equal(drop_overflow(slots, 4, 2), [[1, 0, 1, 2, 4, 3]])
    assert Mixture(4, 2, capacity_factor=1.0).capacity(3) == 2  # ceil(1.0 * 3 * 2 / 4)


@pytest.mark.slow
def test_capacity_factor_matters_only_when_it_drops():
    x = jax.random.normal(jax.random.key(3), (2, 16, WIDTH))
    block, variables = _block(Mixture(EXPERTS, TOP_K), x)
    y, _ = block.apply(variables, x)
    roomy, _ = SparseMLP(SparseSpec(Mixture(EXPERTS, TOP_K, capacity_factor=8.0), FEATURES)).apply(variables, x)
    tight, _ = SparseMLP(SparseSpec(Mixture(EXPERTS, TOP_K, capacity_factor=0.25), FEATURES)).apply(variables, x)
    np.testing.assert_array_equal(roomy, y)  # capacity 32 per expert and row: nothing dropped, same program
    assert float(jnp.max(jnp.abs(tight - y))) > 1.0


@pytest.mark.slow
def test_routes_replay_the_recorded_experts_and_the_router_keeps_its_gradient():
    model = models.build("causal_transformer", vocab_size=64, emb_features=WIDTH, num_layers=3, num_heads=4,
                         mlp_features=FEATURES, max_seq_len=16, scan_layers=2,
                         mixture=dict(experts=EXPERTS, top_k=TOP_K, layers=[1, 2]))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 8)), jnp.int32)
    variables = compiled(model.init, jax.random.key(0), tokens)
    ids = jnp.asarray(np.random.default_rng(1).permuted(np.tile(np.arange(EXPERTS), (2, 8, 2, 1)), axis=-1)[..., :TOP_K],
                      jnp.int32)
    covered = jnp.arange(8)[None, :].repeat(2, 0) < 5
    out = compiled(model.apply, variables, tokens, head=False, routes=Routes(ids, covered))
    own = compiled(model.apply, variables, tokens, head=False)
    chosen = np.moveaxis(np.asarray(out.aux["routing"].experts), 0, 2)  # [B, S, L, K]
    np.testing.assert_array_equal(chosen[:, :5], np.asarray(ids)[:, :5])
    np.testing.assert_array_equal(chosen[:, 5:], np.moveaxis(np.asarray(own.aux["routing"].experts), 0, 2)[:, 5:])

    def loss(params):
        output = model.apply({**variables, "params": params}, tokens, head=False, routes=Routes(ids))
        return jnp.sum(output.logits() ** 2)

    grads = compiled(jax.grad(loss), variables["params"])
    router = grads["layers_1to2"]["mlp"]["gate"]["kernel"]
    assert router.shape == (2, WIDTH, EXPERTS) and bool(jnp.all(jnp.any(router != 0, axis=(1, 2))))


@pytest.mark.slow
def test_scanned_and_unrolled_sparse_runs_agree():
    kwargs = dict(vocab_size=64, emb_features=WIDTH, num_layers=3, num_heads=4, mlp_features=FEATURES, max_seq_len=16,
                  mixture=dict(experts=4, top_k=2, every=1, bias=True, shared_features=16))
    scanned = models.build("causal_transformer", scan_layers=2, **kwargs)
    unrolled = models.build("causal_transformer", scan_layers=0, **kwargs)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 8)), jnp.int32)
    variables = compiled(scanned.init, jax.random.key(0), tokens)
    assert variables["moe"]["layers_0to2"]["mlp"]["gate"]["e_score_correction_bias"].shape == (3, 4)
    a = compiled(scanned.apply, variables, tokens, head=False)
    b = compiled(unrolled.apply, unrolled.unstack_variables(variables), tokens, head=False)
    # One program scanned, one unrolled: XLA may fuse them differently (3 layers, width 32): 1e-5 at ~1.
    np.testing.assert_allclose(a.logits(), b.logits(), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(a.aux["routing"].experts, b.aux["routing"].experts)


def test_the_mixture_knob_builds_sparse_layers_and_round_trips_through_json():
    config = dict(vocab_size=64, emb_features=WIDTH, num_layers=4, num_heads=4, mlp_features=FEATURES,
                  mixture=dict(experts=4, top_k=1, every=2, expert_features=16, score_function="sigmoid"))
    model = models.build("causal_transformer", **config)
    assert model.config.sparse_layers == (1, 3)
    assert [type(spec.feed_forward).__name__ for spec in model.config.layer_specs] == ["DenseSpec", "SparseSpec"] * 2
    # As a run record holds it: JSON values (dtypes by name, tuples as lists, the mixture as an object).
    recorded = json.loads(json.dumps(dataclasses.asdict(model.config), default=lambda value: np.dtype(value).name))
    rebuilt = models.build("causal_transformer", **recorded)
    assert rebuilt.config == model.config
    names = model.logical_names()["params"]["layers_1"]["mlp"]["experts"]["gate_proj"]["kernel"]
    assert tuple(names) == ("expert", "embed", "mlp")


@pytest.mark.parametrize("mixture, message", [
    (dict(experts=4, top_k=5), r"top_k is 5; it must be in \[1, experts\] = \[1, 4\]"),
    (dict(experts=6, groups=4), "groups is 4; it must divide the 6 experts"),
    (dict(experts=8, top_k=4, groups=4, groups_per_token=1), "top_k 4 is more than the 2 experts of the 1 groups"),
    (dict(experts=4, score_function="relu"), "score_function is 'relu'"),
    (dict(experts=4, shared_gate=True), "shared_gate gates the shared expert, and shared_features is 0"),
    (dict(experts=4, layers=[7]), r"mixture layers \[7\] are not layers of this 2-layer model"),
    (dict(experts=4, expert=3), r"mixture has no fields \['expert'\]"),
])
def test_bad_mixtures_are_refused_by_name(mixture, message):
    with pytest.raises((ValueError, TypeError), match=message):
        models.build("causal_transformer", vocab_size=64, emb_features=WIDTH, num_layers=2, num_heads=4,
                     mixture=mixture)


def test_routes_of_the_wrong_shape_are_refused():
    model = models.build("causal_transformer", vocab_size=64, emb_features=WIDTH, num_layers=2, num_heads=4,
                         mixture=dict(experts=4, top_k=2))
    tokens = jnp.zeros((2, 8), jnp.int32)
    variables = compiled(model.init, jax.random.key(0), tokens)
    with pytest.raises(ValueError, match=r"routes experts have shape \(2, 8, 2, 1\); this model reads \[B, S, L, K\] "
                                         r"= \[2, 8, 2, 2\]"):
        model.apply(variables, tokens, routes=Routes(jnp.zeros((2, 8, 2, 1), jnp.int32)))


@pytest.mark.slow
def test_greedy_generation_follows_the_full_forward():
    # The cache's prefill and decode route each new token alone; teacher-forced over the whole
    # sequence the model must pick the same next tokens.
    from dew.sampling import Sampling, generate

    model = models.build("causal_transformer", vocab_size=64, emb_features=WIDTH, num_layers=2, num_heads=4,
                         mlp_features=FEATURES, max_seq_len=32,
                         mixture=dict(experts=4, top_k=2, shared_features=16, shared_gate=True))
    variables = _widened(compiled(model.init, jax.random.key(5), jnp.zeros((1, 4), jnp.int32)))
    prompt = [3, 14, 15, 9]
    generation = generate(model, variables, [prompt], 6, key=jax.random.key(0), sampling=Sampling(temperature=0.0))
    tokens = [int(t) for t in generation.host().continuations()[0]]
    assert len(tokens) == 6
    logits = compiled(model.apply, variables, jnp.asarray([prompt + tokens[:-1]], jnp.int32))
    assert list(np.argmax(np.asarray(logits)[0, len(prompt) - 1:], axis=-1)) == tokens


def _widened(variables):
    """Weights scaled up, so that the greedy choice is decided by margins far above rounding."""
    return jax.tree_util.tree_map(lambda x: x * 8.0, variables)


EXPERT_MESH_SCRIPT = """
import jax, numpy as np, optax
from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.objectives.lm import LMObjective
from dew.sharding import Layout, MeshSpec

model = models.build("causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4, mlp_features=32,
                     max_seq_len=16, scan_layers=1, mixture=dict(experts=8, top_k=2, bias=True, shared_features=16))
rows = np.random.default_rng(0).integers(0, 64, (8, 9)).astype(np.int32)
data = Dataset(train=lambda partition: iter([{"text": rows}] * 8), val=None, records=8, batch=8)
losses = {}
for name, devices, spec in (("one", jax.devices()[:1], MeshSpec()), ("expert", None, MeshSpec(data=2, expert=4))):
    objective = LMObjective(model, 8, aux_loss_alpha=0.01, router_z_loss=0.001, balance_rate=0.01)
    trainer = Trainer(objective, optax.adamw(1e-2), key=jax.random.key(0), mesh=spec, layout=Layout(min_shard=0))
    if devices is not None:
        trainer.mesh = spec.build(devices)
    state = trainer.fit(data, steps=3, log_every=1, verbose=False)
    losses[name] = [row["train/loss"] for row in trainer.history]
# The stacked experts [layers, E, D, F] are split over the expert axis on E, their moments alike.
up = state.params["params"]["layers_0to1"]["mlp"]["experts"]["up_proj"]["kernel"]
assert tuple(up.sharding.spec)[:2] == (None, "expert"), up.sharding.spec
moments = [leaf for leaf in jax.tree_util.tree_leaves(state.opt_state) if getattr(leaf, "shape", None) == up.shape]
assert moments and all(leaf.sharding == up.sharding for leaf in moments)
# Not bit-identical: the data axis sums each gradient in two halves. fp32 losses near 4 over 3 Adam
# steps: 64 ulps, as for the tensor-parallel mesh (tests/training/test_contract.py).
np.testing.assert_allclose(losses["expert"], losses["one"], rtol=64 * np.finfo(np.float32).eps)
print("ok", losses)
"""


@pytest.mark.slow
def test_experts_sharded_over_the_expert_axis_give_one_devices_losses():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = devices_environment(8)
    done = subprocess.run([sys.executable, "-c", EXPERT_MESH_SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
