"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on tiny random checkpoints: the routers, the
logits, greedy tokens (through `generate` and the serving engine), saving back, transformers 5's fused
layout, GGUF files, training from a loaded checkpoint, from-scratch exports, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

from dew import Trainer, models
from dew.data.dataset import Dataset
from dew.interop import load_pretrained
from dew.interop.export import save_pretrained
from dew.interop.families import decoder_kwargs, family_for
from dew.nn.moe import Router
from dew.nn.transformer import CausalTransformer
from dew.objectives.lm import LMObjective
from tests.serve.conftest import Tokens
from dew.sampling import Sampling
from dew.serve.engine import Engine, Request
from tests.interop.conftest import (
    CASES, greedy_continuations, save_checkpoint, sized, torch, torch_model, transformers,
)
from tests.tolerances import LIBRARY_ULPS, assert_within, transformers_decoder_ulps, ulp_bound

# Each family as transformers builds it (two layers of width 32), and the routing feature it computes
# that Dew must match: switched off in Dew, the logits move by more than the tolerance.
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                dict(norm_topk_prob=False)),
    # the second layer dense (mlp_only_layers), the first sparse, with the shared expert and its gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, mlp_only_layers=[1]),
                  dict(shared_gate=False)),
    # every second layer sparse (decoder_sparse_step), the first dense; renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True,
                       decoder_sparse_step=2),
                  dict(norm_topk_prob=False)),
}
SPARSE = {"mixtral": (0, 1), "qwen2_moe": (0,), "qwen3_moe": (1,)}
TOKENS = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int32)
PROMPT = [5, 17, 3, 88, 41, 9]


def moe_torch_model(family: str, **overrides):
    """conftest's tiny random transformers model (weights of order one) of a mixture family."""
    config_class, model_class, options, _ = FAMILIES[family]
    with mock.patch.dict(CASES, {family: (config_class, model_class, {"attn_implementation": "eager", **options})}):
        return torch_model(family, **overrides)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def loaded(request, tmp_path_factory):
    """(family, transformers model, its directory as transformers saves it, Dew's load of it)."""
    model = moe_torch_model(request.param)
    directory = save_checkpoint(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, directory, load_pretrained(directory)


def moe_logit_ulps(config, dew_config, seq_len: int) -> float:
    """Ulps of the logits' size between Dew's and transformers' fp32 logits: `transformers_decoder_ulps`
    (whose MLP, `intermediate_size`, is the widest feed-forward of these models) plus what each sparse
    layer adds along the chain: the router's width-term logits, an E-term softmax sum, the top-k
    renormalisation (a k-term sum and a division), the k-term weighted combination, and Qwen2-MoE's
    shared expert beside it (gate and up, width terms each, the activation, down over its width, the
    gate's width-term logit and its sigmoid). Their rounding walks randomly, sqrt(6 N) ulps for N
    roundings; the softmax's exp and the shared gate's sigmoid from two libraries add LIBRARY_ULPS each."""
    mixture, width = dew_config.mixture, dew_config.emb_features
    shared = 2 * width + 3 + mixture.shared_features + width + 1 if mixture.shared_features else 0
    per_layer = width + 1 + mixture.experts + mixture.top_k + 1 + mixture.top_k + shared
    sparse = len(dew_config.sparse_layers)
    return (transformers_decoder_ulps(config, seq_len) + math.sqrt(6 * sparse * per_layer)
            + 2 * LIBRARY_ULPS * sparse)


def _logit_bound(model, bundle, theirs):
    assert np.abs(theirs).max() > 2.0  # weights large enough for a wrong convention to show
    return ulp_bound(moe_logit_ulps(model.config, bundle.model.config, theirs.shape[1]), np.abs(theirs).max())


def _torch_routers(model, tokens):
    """Each sparse layer's router input, logits, top-k weights and experts in transformers' forward."""
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: seen.append((args[0], *out)))
             for layer in model.model.layers if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits.numpy()
    for hook in hooks:
        hook.remove()
    return logits, [tuple(np.asarray(t.detach().reshape(-1, t.shape[-1]).numpy()) for t in entry) for entry in seen]


def _by_expert(experts_NK, weights_NK):
    """transformers' `topk` is unsorted: each token's slots sorted by expert id."""
    order = np.argsort(experts_NK, axis=1)
    return np.take_along_axis(experts_NK, order, 1), np.take_along_axis(weights_NK, order, 1)


def test_routers_and_logits_match_transformers(loaded):
    family, model, _, bundle = loaded
    assert bundle.model.config.sparse_layers == SPARSE[family]
    theirs, routers = _torch_routers(model, TOKENS)
    assert len(routers) == len(SPARSE[family])
    output = jax.jit(bundle.model.apply, static_argnames="head")(bundle.variables, TOKENS, head=False)
    ours = np.asarray(output.logits())
    logit_bound = _logit_bound(model, bundle, theirs)
    # Bounds 4.8e-4 to 5.6e-4 on logits up to 6.0-6.8. Observed: mixtral 1.1e-5, qwen2_moe 9.4e-6, qwen3_moe 3.7e-6.
    assert_within(ours, theirs, logit_bound, f"{family} logits")

    mixture = bundle.model.config.mixture
    for position, (layer, (x_ND, router_logits, weights, experts)) in enumerate(zip(SPARSE[family], routers)):
        # The same experts in the whole model's forward, and margins that keep them on any CPU: the k-th
        # and (k+1)-th router logits lie further apart than the decoder's bound on a value of their size.
        chosen = np.asarray(output.aux["routing"].experts[position]).reshape(-1, mixture.top_k)
        np.testing.assert_array_equal(np.sort(chosen, axis=1), np.sort(experts, axis=1))
        ranked = np.sort(router_logits, axis=1)[:, ::-1]
        margin = np.min(ranked[:, mixture.top_k - 1] - ranked[:, mixture.top_k])
        ulps = moe_logit_ulps(model.config, bundle.model.config, TOKENS.shape[1])
        assert margin > 2 * ulp_bound(ulps, np.abs(ranked).max())
        # The loaded router on transformers' own router input: its logits are a WIDTH-term fp32 dot,
        # whose rounding walks at most sqrt(6 (WIDTH + 1)) ulps of the sum of |x_i w_i|; a weight (a
        # renormalised softmax) moves by at most half the logits' error, plus its own roundings (the
        # exp from two libraries, again in the normaliser, a sum and a division) relative to its size.
        gate = bundle.variables["params"][f"layers_{layer}"]["mlp"]["gate"]
        our_experts, our_weights, _, _ = Router(mixture).apply({"params": gate}, jnp.asarray(x_ND))
        kernel = np.asarray(gate["kernel"])
        logit_error = ulp_bound(math.sqrt(6 * (x_ND.shape[1] + 1)), float(np.max(np.abs(x_ND) @ np.abs(kernel))))
        ours_e, ours_w = _by_expert(np.asarray(our_experts), np.asarray(our_weights))
        theirs_e, theirs_w = _by_expert(experts, weights)
        np.testing.assert_array_equal(ours_e, theirs_e)
        weight_bound = 0.5 * logit_error + ulp_bound(2 * LIBRARY_ULPS + 3, np.abs(theirs_w))
        # Router logits up to 5 on these order-one weights: bounds 7.3e-6 to 9.4e-6 (tests/nn/test_moe.py
        # holds 1e-6 on routers whose logits stay under 1). Observed: at most 1.5e-7, one ulp of the weights.
        assert_within(ours_w, theirs_w, weight_bound, f"{family} layer {layer} router weights")

    # The family's routing feature matters: without it Dew's logits leave the tolerance.
    off = dataclasses.replace(mixture, **FAMILIES[family][3])
    without = CausalTransformer(dataclasses.replace(bundle.model.config, mixture=off))
    changed = np.asarray(jax.jit(without.apply)(bundle.variables, TOKENS))
    assert np.abs(changed - theirs).max() > 10 * logit_bound


def test_greedy_tokens_match_transformers_generate(loaded):
    family, model, _, bundle = loaded
    ours, theirs = greedy_continuations(model, bundle, PROMPT)
    assert ours == theirs, family


@pytest.mark.slow
def test_dew_serve_engine_draws_transformers_greedy_tokens(loaded):
    family, model, _, bundle = loaded
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    engine = Engine(bundle.model, bundle.variables, slots=2, capacity=32, prefill_rows=1)
    engine.start()
    try:
        request = Request(PROMPT, 16, Sampling(temperature=0.0), seed=0, consumer=Tokens())
        engine.submit([request])
        assert request.consumer.done.wait(300)
    finally:
        engine.close()
    assert request.consumer.tokens == theirs, family


def test_saved_under_the_hubs_names_and_reloaded_by_transformers(loaded, tmp_path):
    family, model, directory, bundle = loaded
    saved = bundle.save(tmp_path / "export")
    # the per-expert names transformers wrote (Mixtral's block_sparse_moe.experts.N.w1), each tensor equal
    source, written = load_file(directory / "model.safetensors"), load_file(saved / "model.safetensors")
    assert sorted(written) == sorted(source)
    assert any(".experts.3." in name for name in written)
    for name, tensor in source.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    again = getattr(transformers, FAMILIES[family][1]).from_pretrained(saved, attn_implementation="eager").eval()
    with torch.no_grad():
        reloaded = again(torch.from_numpy(TOKENS)).logits.numpy()
        original = model(torch.from_numpy(TOKENS)).logits.numpy()
    np.testing.assert_array_equal(reloaded, original)  # the same weights through the same program


def test_transformers_5_fused_layout_loads_alike(loaded, tmp_path):
    family, model, _, bundle = loaded
    model.save_pretrained(tmp_path, save_original_format=False)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in load_file(tmp_path / "model.safetensors"))
    fused = load_pretrained(tmp_path)
    for ours, theirs in zip(jax.tree_util.tree_leaves(fused.variables), jax.tree_util.tree_leaves(bundle.variables)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


# ---- GGUF ------------------------------------------------------------------------------------------

LLAMA_CPP_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def write_moe_gguf(model, path):
    """The model as llama.cpp writes a mixture (names from the gguf package's own table): each projection's
    experts stacked `[E, out, in]` (Q8_0 where rows allow), the shared-expert gate as a vector, the rest
    float32; and the transformers model given the weights the file holds (dequantized), the oracle."""
    gguf = pytest.importorskip("gguf")
    from tests.interop.test_gguf import Q8_0, permuted, write_gguf

    config, arch = model.config, LLAMA_CPP_ARCHITECTURES[model.config.model_type]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    gguf_name = lambda name: names.get_name(name, try_suffixes=(".weight", ".bias"))
    state, tensors = model.state_dict(), []
    for name, tensor in state.items():
        array = permuted(name, tensor.numpy().astype(np.float32), config, arch)
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5's fused experts, llama.cpp's two stacks
            stacks = np.split(array, 2, axis=1)
            parts = [(name.replace("gate_up_proj", f"{proj}.weight"), stack) for proj, stack in
                     zip(("gate_proj", "up_proj"), stacks)]
        elif name.endswith("mlp.experts.down_proj"):
            parts = [(f"{name}.weight", array)]
        else:
            parts = [(name, array)]
        stored = []
        for part, values in parts:
            if ".experts." in part and values.shape[-1] % 32 == 0:  # Q8_0 blocks of 32 along a row
                values = gguf.quants.quantize(values, Q8_0)
                tensors.append((gguf_name(part), values, Q8_0))
                values = gguf.quants.dequantize(values, Q8_0)
            elif ".experts." in part:
                tensors.append((gguf_name(part), values, None))
            elif part.endswith("shared_expert_gate.weight"):
                tensors.append((gguf_name(part), values[0], None))  # llama.cpp's vector of n_embd
            elif not (name == "lm_head.weight" and config.tie_word_embeddings):
                tensors.append((gguf_name(part), values, None))
            stored.append(values)
        if ".experts." in name:
            state[name] = torch.from_numpy(np.concatenate(stored, axis=1) if len(stored) > 1 else stored[0])

    def metadata(writer):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if hasattr(config, "shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)

    write_gguf(model, path, extra=metadata, arch=arch, tensors=tensors)
    model.load_state_dict(state)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_experts_match_transformers(family, tmp_path):
    pytest.importorskip("gguf")
    # llama.cpp's metadata has no dense layers among sparse ones: every layer sparse here. Its qwen3moe
    # graph always renormalises the top-k, as this checkpoint (norm_topk_prob) does.
    model = moe_torch_model(family, mlp_only_layers=[], decoder_sparse_step=1) if family != "mixtral" else \
        moe_torch_model(family)
    path = write_moe_gguf(model, tmp_path / "tiny.gguf")
    bundle = load_pretrained(tmp_path, gguf_file=path.name)
    assert bundle.config["model_type"] == family and bundle.model.config.mixture.top_k == 2
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    ours = np.asarray(jax.jit(bundle.model.apply)(bundle.variables, TOKENS))
    # The same bound as for safetensors (both sides hold the file's dequantized weights exactly): 5.4e-4 to
    # 6.2e-4. Observed: mixtral 9.0e-6, qwen2_moe 9.4e-6, qwen3_moe 5.7e-6.
    assert_within(ours, theirs, _logit_bound(model, bundle, theirs), f"{family} GGUF logits")
    exported = load_pretrained(bundle.save(tmp_path / "export"))  # a transformers checkpoint of the same model
    np.testing.assert_array_equal(np.asarray(jax.jit(exported.model.apply)(exported.variables, TOKENS)), ours)
    # and a GGUF file of it, written by Dew (stacked experts, router and shared expert under llama.cpp's names)
    written = bundle.save(tmp_path / "out" / "moe.f32.gguf", format="gguf", outtype="f32")
    again = load_pretrained(written.parent, gguf_file=written.name)
    assert again.config["model_type"] == family
    np.testing.assert_array_equal(np.asarray(jax.jit(again.model.apply)(again.variables, TOKENS)), ours)


# ---- training and from-scratch exports ----------------------------------------------------------------


@pytest.mark.slow
def test_a_loaded_mixture_trains(tmp_path):
    model = moe_torch_model("qwen2_moe")
    bundle = load_pretrained(save_checkpoint(model, tmp_path / "qwen2_moe"))
    rows = np.random.default_rng(1).integers(0, 97, (4, 13)).astype(np.int32)
    objective = LMObjective(bundle.model, 12, pretrained=bundle.variables, ema_decay=None, aux_loss_alpha=0.01)
    data = Dataset(train=lambda partition: iter([{"text": rows}] * 4), val=None, records=4, batch=4)
    trainer = Trainer(objective, optax.adamw(3e-3), key=jax.random.key(0))
    state = trainer.fit(data, steps=4, log_every=1, verbose=False)
    losses = [row["train/loss"] for row in trainer.history]
    assert losses[-1] < losses[0], losses  # the same batch four times: the loss falls
    before = bundle.variables["params"]["layers_0"]["mlp"]
    after = state.params["params"]["layers_0"]["mlp"]
    for part in ("gate", "experts", "shared_experts", "shared_expert_gate"):  # every part of the layer learns
        moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), after[part], before[part])
        assert min(jax.tree_util.tree_leaves(moved)) > 0, part


SCRATCH = dict(vocab_size=97, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=48,
               max_seq_len=64)
# From-scratch mixtures, and the plainest family that computes each.
EXPORTS = {
    "mixtral": dict(mixture=dict(experts=4, top_k=2)),
    "qwen3_moe": dict(qk_norm=True, mixture=dict(experts=4, top_k=2, layers=[1], expert_features=16)),
    "qwen2_moe": dict(qkv_bias=True, mixture=dict(experts=4, top_k=2, norm_topk_prob=False, expert_features=16,
                                                  shared_features=24, shared_gate=True)),
}


@pytest.mark.parametrize("family", sorted(EXPORTS))
def test_a_from_scratch_mixture_is_written_as_the_plainest_family(family):
    model = models.build("causal_transformer", **SCRATCH, **EXPORTS[family])
    assert family_for(model.config).model_type == family


@pytest.mark.parametrize("family", [pytest.param(family, marks=[] if family == "mixtral" else pytest.mark.slow)
                                    for family in sorted(EXPORTS)])
def test_a_from_scratch_mixture_exports_and_transformers_computes_it(family, tmp_path):
    model = models.build("causal_transformer", **SCRATCH, **EXPORTS[family])
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    rng = np.random.default_rng(0)
    variables = jax.tree_util.tree_map(lambda x: x + jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype), variables)
    out = save_pretrained(model, variables, tmp_path / family)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = theirs_model(torch.from_numpy(TOKENS)).logits.numpy()
    ours = np.asarray(jax.jit(model.apply)(variables, TOKENS))
    bound = ulp_bound(moe_logit_ulps(theirs_model.config, model.config, TOKENS.shape[1]), np.abs(theirs).max())
    assert np.abs(theirs).max() > 2.0
    # Bounds 5.0e-4 to 5.8e-4. Observed: mixtral 1.1e-5, qwen2_moe 9.5e-6, qwen3_moe 8.0e-6.
    assert_within(ours, theirs, bound, f"{family} export")


@pytest.mark.parametrize("knobs, message", [
    (dict(mixture=dict(experts=4, score_function="sigmoid")),
     r"closest, mixtral \(MixtralConfig\), computes mixture score_function 'sigmoid' \(it computes 'softmax'\)"),
    (dict(mixture=dict(experts=4, capacity_factor=1.25)), r"mixture capacity_factor 1.25 \(it computes None\)"),
])
def test_a_mixture_no_family_computes_is_refused_by_name(knobs, message):
    model = models.build("causal_transformer", **SCRATCH, **knobs)
    with pytest.raises(ValueError, match=message):
        family_for(model.config)


# ---- config fields and bad input ----------------------------------------------------------------------


def test_config_fields_are_read_as_transformers_reads_them():
    qwen3 = {**sized("qwen3_moe"), "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3],
             "num_local_experts": 16, "norm_topk_prob": True, "output_router_logits": True,
             "router_aux_loss_coef": 0.02}
    del qwen3["num_experts"]
    qwen3 = decoder_kwargs(qwen3)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its attribute map)
    assert qwen3["mixture"].layers == (1,) and qwen3["mixture"].experts == 16 and qwen3["mixture"].norm_topk_prob
    # the router-loss fields set transformers' training loss, not the model
    assert decoder_kwargs({**sized("mixtral"), "output_router_logits": True, "router_aux_loss_coef": 0.1}) == \
        decoder_kwargs(sized("mixtral"))
    assert decoder_kwargs({**sized("qwen2_moe"), "num_experts": 0}).get("mixture") is None  # every layer dense
    with pytest.warns(UserWarning, match=r"router_jitter_noise 0.1: transformers multiplies .* in training mode only"):
        decoder_kwargs({**sized("mixtral"), "router_jitter_noise": 0.1})


@pytest.mark.parametrize("source, message", [
    ({**sized("qwen3_moe"), "num_experts": 4, "num_experts_per_tok": 5},
     r"field 'num_experts_per_tok' = 5 is not something Dew computes for qwen3_moe: a token picks between 1 and the "
     r"4 experts there are \(num_experts\)"),
    ({**sized("mixtral"), "num_local_experts": 0}, r"'num_local_experts' = 0 .* needs at least one expert"),
    ({**sized("qwen3_moe"), "num_experts": 8, "num_local_experts": 4},
     r"'num_local_experts' = 4 .* transformers' other name for num_experts, which says 8"),
    ({**sized("qwen2_moe"), "decoder_sparse_step": 0}, r"'decoder_sparse_step' = 0 .* use 1 or more"),
    ({**sized("qwen2_moe"), "shared_expert_intermediate_size": 0},
     r"'shared_expert_intermediate_size' = 0 .* always add a gated shared expert"),
])
def test_mixture_configs_dew_cannot_compute_are_refused_by_name(source, message):
    with pytest.raises(ValueError, match=message):
        decoder_kwargs(source)


def test_a_checkpoint_missing_an_expert_tensor_is_refused_naming_it(loaded, tmp_path):
    family, _, directory, _ = loaded
    tensors = load_file(directory / "model.safetensors")
    missing = next(name for name in sorted(tensors) if ".experts.2." in name)
    save_file({name: value for name, value in tensors.items() if name != missing}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"the checkpoint lacks 1 tensor\(s\) .* \['{missing}'\]"):
        load_pretrained(tmp_path)
