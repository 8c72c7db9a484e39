"""DeepSeek V2, V3 and V3.2 against transformers on tiny random checkpoints: fp32 logits, 16 greedy tokens
through the latent cache, V3's multi-token-prediction depth against transformers' `MtpModel`, saving
back to transformers, and the config fields Dew refuses."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from dew.interop import load_pretrained, save_pretrained
from tests.compiled import compiled
from tests.interop.conftest import greedy_continuations, torch, transformers
from tests.tolerances import LIBRARY_ULPS, decoder_ulps, ulp_bound

from safetensors.torch import load_file, save_file  # noqa: E402  (torch is there: conftest skipped otherwise)
from transformers.modeling_layers import MtpModel  # noqa: E402

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8,
             v_head_dim=6, max_position_embeddings=64, attn_implementation="eager")
# One case per computation that differs: V3's sigmoid group-limited routing with a bias, interleaved
# rotary and an MTP depth; V2's softmax routing limited by groups, unnormalised, and YaRN's query scale.
pytestmark = pytest.mark.slow  # each case builds, saves and loads a checkpoint and runs both sides

CASES = {
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
           dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=1)),
    "v3-plain-q-halves": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(n_group=1, topk_group=1, q_lora_rank=None, rope_interleave=False,
                               num_nextn_predict_layers=0)),
    "v2-groups-yarn": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                       dict(n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                            max_position_embeddings=128,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                             "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 100.0})),
    # V3.2: each query attends to the 4 keys the lightning indexer ranks highest. A key picked otherwise
    # than transformers picks would move the logits by their own order, far past the bound: the
    # comparison fails loudly rather than hiding a near tie (exact ties: test_deepseek_ties.py).
    "v32-indexer": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                    dict(n_group=4, topk_group=2, index_topk=4, index_head_dim=8, index_n_heads=4)),
}
PROMPT = [5, 17, 3, 88, 41, 9]


def deepseek_model(case: str, seed: int = 0):
    """A transformers DeepSeek model of `case` with weights of order one (and a random balancing bias),
    and for V3 its `MtpModel` depth, random too."""
    config_class, model_class, options = CASES[case]
    config = getattr(transformers, config_class)(**{**SHAPE, **options})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    mtp = MtpModel(model, config.num_mtp_layers).eval() if getattr(config, "num_mtp_layers", 0) else None
    with torch.no_grad():
        for module in (model, mtp):
            for name, parameter in (module.named_parameters() if module is not None else ()):
                if "norm" in name:
                    parameter.add_(0.1 * torch.randn_like(parameter))
                else:
                    parameter.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.1)
    return model, mtp


def mtp_tensors(mtp, layers: int) -> dict:
    """The MTP depths' weights under DeepSeek's checkpoint names, `model.layers.{layers + k}.*`, experts one by one."""
    tensors = {}
    for name, value in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue  # the embedding and head it shares with the main model
        _, depth, rest = name.split(".", 2)
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        prefix = f"model.layers.{layers + int(depth)}."
        if rest.endswith("experts.gate_up_proj"):
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :half].contiguous()
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, half:].contiguous()
        elif rest.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            tensors[prefix + rest] = value.contiguous()
    return tensors


def save_with_mtp(model, mtp, directory):
    model.save_pretrained(directory)
    if mtp is not None:
        weights = load_file(directory / "model.safetensors")
        weights.update(mtp_tensors(mtp, model.config.num_hidden_layers))
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module", params=sorted(CASES))
def loaded(request, tmp_path_factory):
    model, mtp = deepseek_model(request.param)
    directory = save_with_mtp(model, mtp, tmp_path_factory.mktemp(request.param))
    return request.param, model, mtp, load_pretrained(directory)


def deepseek_ulps(config, seq_len: int) -> float:
    """`decoder_ulps` for a DeepSeek decoder: attention over `nope + rope` features, the widest
    feed-forward a token runs (its experts and the shared one side by side), and per layer the
    latent path's extra roundings (the query and latent projections and norms, `q_lora_rank +
    kv_lora_rank + 10` of them, as a random walk; their two rsqrts in full)."""
    layers = config.num_hidden_layers
    moe_width = config.moe_intermediate_size * (config.num_experts_per_tok + config.n_shared_experts)
    base = decoder_ulps(layers=layers, width=config.hidden_size, mlp_width=max(config.intermediate_size, moe_width),
                        heads=config.num_attention_heads, head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
                        seq_len=seq_len)
    latent = (config.q_lora_rank or 0) + config.kv_lora_rank + 10
    return base + math.sqrt(6 * layers * latent) + 2 * LIBRARY_ULPS * layers


# fp32 logits (largest 5.6-6.7) over 12 tokens: deepseek_ulps gives about 1000 ulps of the largest
# logit, bounds near 7e-4. A router that picked another expert than transformers' would move a logit by
# the order of the logits themselves, far past the bound. Observed: v3 8.3e-6, v3-plain-q-halves 6.7e-6,
# v2-groups-yarn 8.6e-6, v32-indexer 1.1e-5.
def test_logits_match_transformers(loaded):
    case, model, _, bundle = loaded
    tokens = np.random.default_rng(0).integers(0, 97, (2, 12))
    ours = np.asarray(compiled(bundle.model.apply, bundle.variables, jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(theirs).max() > 2.0
    bound = ulp_bound(deepseek_ulps(model.config, tokens.shape[1]), np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0, err_msg=case)


def test_greedy_tokens_match_transformers_generate(loaded):
    """16 tokens through the latent cache (decode in the absorbed form) against transformers' own cache."""
    case, model, _, bundle = loaded
    ours, theirs = greedy_continuations(model, bundle, PROMPT)
    assert ours == theirs, case


def test_mtp_depth_matches_transformers_mtp_model(loaded):
    """Depth 1 at position p reads the final-norm state at p and the token at p + 1, at rotary position
    p + 1, as transformers' MtpModel does; the last position reads past the end (never scored) and is
    left out. Same chain as the decoder plus one block, so the same bound (observed 1.2e-5)."""
    case, model, mtp, bundle = loaded
    if mtp is None:
        assert bundle.model.config.mtp_depths == 0, case  # config.json names no depths, or its weights hold none
        return
    assert bundle.model.config.mtp_depths == 1
    tokens = np.random.default_rng(1).integers(0, 97, (2, 13))
    S = 12
    output = bundle.model.apply(bundle.variables, jnp.asarray(tokens[:, :S], jnp.int32), head=False, depths=True)
    ours = np.asarray(output.head.logits(output.aux["depths"][0]))[:, :S - 1]
    with torch.no_grad():
        states = model(torch.from_numpy(tokens[:, :S]), output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(S)[None].expand(2, S) + 1
        depth = mtp.forward_layer(0, states, positions, None, input_ids=torch.from_numpy(tokens[:, 1:S + 1]))
        theirs = mtp._project_to_logits(depth).numpy()[:, :S - 1]
    bound = ulp_bound(deepseek_ulps(model.config, S) * 4 / 3, np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)


def test_v3_checkpoint_without_mtp_weights_loads_with_mtp_off(tmp_path):
    """transformers writes num_nextn_predict_layers 1 and no MTP weights; that loads with MTP off."""
    model, _ = deepseek_model("v3")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    bundle = load_pretrained(tmp_path)
    assert bundle.model.config.mtp_depths == 0
    assert not any(key.startswith("mtp_") for key in bundle.variables["params"])


def test_save_reloads_in_transformers_with_equal_logits(loaded, tmp_path):
    """Dew writes the latent attention, the experts one by one, the balancing bias and the MTP depth
    under DeepSeek's names; fp32 weights round-trip exactly, so transformers computes the same logits
    bit for bit."""
    case, model, mtp, bundle = loaded
    save_pretrained(bundle.model, bundle.variables, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.from_numpy(np.random.default_rng(2).integers(0, 97, (2, 12)))
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy(), err_msg=case)
    if mtp is None:
        return
    # MtpModel.from_pretrained finds depths only at DeepSeek-V3's own layer 61, so the depth's tensors are
    # compared by name with the ones it was loaded from
    written = load_file(tmp_path / "model.safetensors")
    for name, value in mtp_tensors(mtp, model.config.num_hidden_layers).items():
        np.testing.assert_array_equal(written[name].numpy(), value.numpy(), err_msg=name)


@pytest.mark.parametrize("field, value, named", [
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("qk_rope_head_dim", 5, "must be even"),
    ("n_group", None, "n_group"),
])
def test_v3_config_refusals_name_the_field(tmp_path, field, value, named):
    model, _ = deepseek_model("v3")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        load_pretrained(tmp_path)


def test_deepseek_v3_original_config_fields_are_read(tmp_path):
    """DeepSeek's own config.json spells its routing and training knobs; the ones saying what transformers
    computes load, the training-only ones change nothing."""
    model, _ = deepseek_model("v3")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(moe_layer_freq=1, scoring_func="sigmoid", topk_method="noaux_tc", aux_loss_alpha=0.001,
                  seq_aux=True, ep_size=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    bundle = load_pretrained(tmp_path)
    mixture = bundle.model.config.mixture
    assert (mixture.score_function, mixture.bias, mixture.groups, mixture.groups_per_token) == ("sigmoid", True, 4, 2)
    assert mixture.layers == (1, 2) and mixture.scaling == 2.5
