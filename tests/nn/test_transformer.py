"""The decoder against transformers on the same random weights, and its masking guarantees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.compiled import compiled
from tests.hf_llama import copy_into_torch  # noqa: E402
from tests.tolerances import decoder_ulps, ulp_bound  # noqa: E402

# fp32 logits of 2-layer width-32 decoders over 12 tokens, Dew against transformers (see decoder_ulps):
# 650 ulps of the largest logit, 2.6e-4 at 3.3. Observed: 3.3e-6 (llama-gqa).
PARITY_ULPS = decoder_ulps(layers=2, width=32, mlp_width=48, heads=4, head_dim=8, seq_len=12)

CASES = {
    "llama-gqa": dict(family="llama", num_kv_heads=2),
    "llama-tied-mha": dict(family="llama", num_kv_heads=4, tie_embeddings=True),
    "mistral-window": dict(family="mistral", num_kv_heads=2, sliding_window=5),
    "qwen3-qk-norm": dict(family="qwen3", num_kv_heads=2, qk_norm=True),
}


def _torch_model(family: str, dew_kwargs: dict):
    common = dict(
        vocab_size=dew_kwargs["vocab_size"], hidden_size=dew_kwargs["emb_features"],
        intermediate_size=dew_kwargs["mlp_features"], num_hidden_layers=dew_kwargs["num_layers"],
        num_attention_heads=dew_kwargs["num_heads"], num_key_value_heads=dew_kwargs["num_kv_heads"],
        max_position_embeddings=dew_kwargs["max_seq_len"], rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=dew_kwargs.get("tie_embeddings", False), attn_implementation="eager",
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        return transformers.LlamaForCausalLM(config)
    if family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=dew_kwargs["sliding_window"], head_dim=8)
        return transformers.MistralForCausalLM(config)
    config = transformers.Qwen3Config(**common, head_dim=8)
    return transformers.Qwen3ForCausalLM(config)


def _widen(variables):
    """Scale weights up (logits of order 10) and perturb the norms, so a wrong convention cannot hide."""

    def widen(path, x):
        if "scale" in str(path):
            return x + 0.1 * jax.random.normal(jax.random.key(len(str(path))), x.shape)
        return x * 8.0

    return jax.tree_util.tree_map_with_path(widen, variables)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    options = dict(CASES[case])
    family = options.pop("family")
    kwargs = dict(vocab_size=97, emb_features=32, num_layers=2, num_heads=4, mlp_features=48, max_seq_len=32, **options)
    model = models.build("causal_transformer", **kwargs)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int32)
    variables = compiled(model.init, jax.random.key(1), jnp.asarray(tokens))
    variables = _widen(variables)
    ours = np.asarray(compiled(model.apply, variables, jnp.asarray(tokens)))

    torch_model = _torch_model(family, kwargs).eval()
    copy_into_torch(variables, torch_model, kwargs["num_layers"])
    with torch.no_grad():
        theirs = torch_model(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=ulp_bound(PARITY_ULPS, np.abs(theirs).max()), rtol=0)


def test_future_tokens_do_not_change_earlier_logits(tiny_model, tiny_variables):
    tokens = np.random.default_rng(1).integers(0, 64, (1, 16)).astype(np.int32)
    changed = tokens.copy()
    changed[0, 10:] = (changed[0, 10:] + 7) % 64
    a = tiny_model.apply(tiny_variables, jnp.asarray(tokens))
    b = tiny_model.apply(tiny_variables, jnp.asarray(changed))
    np.testing.assert_array_equal(np.asarray(a[0, :10]), np.asarray(b[0, :10]))
    assert not np.allclose(np.asarray(a[0, 10:]), np.asarray(b[0, 10:]))


def test_packed_documents_do_not_see_each_other(tiny_model, tiny_variables):
    rng = np.random.default_rng(2)
    first, second = rng.integers(0, 64, 6), rng.integers(0, 64, 7)
    row = np.concatenate([first, second, [0, 0, 0]])[None].astype(np.int32)
    segments = np.array([[1] * 6 + [2] * 7 + [0] * 3], np.int32)
    positions = np.array([list(range(6)) + list(range(7)) + [0] * 3], np.int32)
    apply = jax.jit(lambda tokens: tiny_model.apply(tiny_variables, tokens, segment_ids=segments, positions=positions))
    packed = np.asarray(apply(jnp.asarray(row)))

    # Each document alone gives the same logits as inside the packed row: the same fp32 computation and
    # library over 16 keys against 6 or 7, reduced in other orders (decoder_ulps with one library): 64
    # ulps of the largest logit, 2.7e-6 at 0.36. Observed: 6.0e-8.
    alone_first = np.asarray(compiled(tiny_model.apply, tiny_variables, jnp.asarray(first[None].astype(np.int32))))
    alone_second = np.asarray(compiled(tiny_model.apply, tiny_variables, jnp.asarray(second[None].astype(np.int32))))
    ulps = decoder_ulps(layers=2, width=32, mlp_width=64, heads=4, head_dim=8, seq_len=16, libraries=1)
    for alone, inside in ((alone_first[0], packed[0, :6]), (alone_second[0], packed[0, 6:13])):
        np.testing.assert_allclose(inside, alone, atol=ulp_bound(ulps, np.abs(alone).max()), rtol=0)

    # Changing the first document leaves the second one's logits unchanged, bit for bit.
    changed = row.copy()
    changed[0, :6] = (changed[0, :6] + 5) % 64
    np.testing.assert_array_equal(np.asarray(apply(jnp.asarray(changed)))[0, 6:13], packed[0, 6:13])


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="num_heads 4 is not a multiple of num_kv_heads 3"):
        models.build("causal_transformer", vocab_size=8, emb_features=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(TypeError, match="its keywords are"):
        models.build("causal_transformer", vocab_size=8, hidden_size=32)
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        models.build("gpt5")


@pytest.mark.parametrize("knobs, message", [
    (dict(norm_style="layer"), "norm_style is 'layer'; it must be one of"),
    (dict(norm_placement="after"), "norm_placement is 'after'"),
    (dict(activation="relu"), "activation is 'relu'"),
    (dict(layer_types=("full_attention",)), "layer_types names 1 layers but num_layers is 2"),
    (dict(layer_types=("full_attention", "local")), "layer_types holds \\['local'\\]"),
    (dict(layer_types=("full_attention", "sliding_attention")), "names 'sliding_attention' layers but sliding_window is None"),
    (dict(local_rope_theta=10.0), "local_rope_theta applies to sliding layers"),
])
def test_bad_family_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        models.build("causal_transformer", vocab_size=8, emb_features=32, num_layers=2, num_heads=4, **knobs)


def test_layer_types_choose_window_and_rotary_base():
    config = models.build("causal_transformer", vocab_size=8, emb_features=32, num_layers=2, num_heads=4,
                          sliding_window=4, layer_types=("sliding_attention", "full_attention"), rope_theta=1e6,
                          local_rope_theta=1e4).config
    assert [config.layer_window(i) for i in range(2)] == [4, None]
    assert [config.layer_rope_theta(i) for i in range(2)] == [1e4, 1e6]
