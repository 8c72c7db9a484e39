"""PEFT's LoRA format: Dew's adapters load into `peft` on the transformers model with equal logits, and
adapters PEFT wrote load onto Dew's decoder; an adapter for another base is refused."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dew.interop import load_pretrained
from dew.interop.peft import load_peft, save_peft
from dew.nn.lora import LoRA, adapters
from tests.tolerances import assert_within, transformers_decoder_ulps, ulp_bound

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TOKENS = np.array([[5, 17, 3, 88, 41, 9, 60, 2], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)


def _bound(config, theirs, rank: int) -> float:
    """Dew against transformers plus PEFT, fp32: the decoder's rounding chain (transformers_decoder_ulps),
    and in each adapted projection x A (`width` terms), (x A) B (`rank` terms), the scaling and the add,
    carried along the chain the same way: seven projections a layer."""
    ulps = transformers_decoder_ulps(config, TOKENS.shape[1]) + config.num_hidden_layers * 7 * (
        config.hidden_size + rank + 2)
    return ulp_bound(ulps, np.abs(theirs).max())


def _peft_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.numpy()


def _randomised(variables, seed: int):
    """The adapters of `variables` drawn at order 0.1 (B included), so they change the logits."""
    key = jax.random.key(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "lora_" not in name:
            return leaf
        return 0.1 * jax.random.normal(jax.random.fold_in(key, hash(name) % 2**31), leaf.shape, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, variables)


@pytest.fixture(scope="module")
def bundle(llama_checkpoint):
    return load_pretrained(llama_checkpoint[0], dtype="float32")


def test_dew_adapters_load_into_peft_with_equal_logits_and_back(bundle, llama_checkpoint, tmp_path):
    directory, torch_model = llama_checkpoint
    lora = LoRA(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    adapted = lora.adapt(bundle.model)
    variables = _randomised(adapted.attach(jax.random.key(0), bundle.variables), 1)
    save_peft(tmp_path / "adapter", adapted, variables, base_model=str(directory))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]

    import copy

    theirs_model = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(tmp_path / "adapter")).eval()
    theirs = _peft_logits(theirs_model)
    ours = np.asarray(adapted.apply(variables, jnp.asarray(TOKENS)))
    # Observed: 1.2e-5 against a bound of 6.4e-4 at the largest logit.
    assert_within(ours, theirs, _bound(torch_model.config, theirs, 4), "adapted logits against peft's")
    assert not np.allclose(theirs, _peft_logits(torch_model), atol=1e-3)  # the adapters do change them

    # Back: the same adapters, bit for bit (float32 written, float32 read), on the same targets.
    loaded_model, loaded = load_peft(tmp_path / "adapter", bundle.model, bundle.variables)
    assert sorted(loaded_model.lora.targets) == ["mlp/down_proj", "self_attn/q_proj", "self_attn/v_proj"]
    ours_adapters = jax.tree_util.tree_leaves_with_path(adapters(adapted.stack_variables(variables)))
    theirs_adapters = dict(jax.tree_util.tree_leaves_with_path(adapters(loaded)))
    assert len(ours_adapters) == len(theirs_adapters) == 2 * 3 * 2
    for path, leaf in ours_adapters:
        np.testing.assert_array_equal(np.asarray(theirs_adapters[path]), np.asarray(leaf))


def test_peft_written_adapters_load_onto_dew(bundle, llama_checkpoint, tmp_path):
    import copy

    _, torch_model = llama_checkpoint
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "o_proj", "gate_proj"],
                             init_lora_weights=False)  # random B: the adapters change the logits
    torch.manual_seed(0)
    theirs_model = peft.get_peft_model(copy.deepcopy(torch_model), config).eval()
    theirs_model.save_pretrained(tmp_path / "peft")
    model, variables = load_peft(tmp_path / "peft", bundle.model, bundle.variables)
    assert model.lora.rank == 2 and model.lora.scale == 3.0
    ours = np.asarray(model.apply(variables, jnp.asarray(TOKENS)))
    theirs = _peft_logits(theirs_model)
    # Observed: 6.6e-6 against a bound of 7.7e-4.
    assert_within(ours, theirs, _bound(torch_model.config, theirs, 2), "logits of peft's adapters in Dew")


def test_an_adapter_for_another_base_is_refused(bundle, tmp_path):
    lora = LoRA(rank=4, alpha=8.0, targets=("q_proj",))
    adapted = lora.adapt(bundle.model)
    save_peft(tmp_path / "adapter", adapted, adapted.attach(jax.random.key(0), bundle.variables))
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wider = {**tensors, name: np.zeros((4, 48), np.float32)}  # a base 48 wide
    save_file(wider, weights)
    with pytest.raises(ValueError, match=rf"adapter tensor '{name}' .* has shape \[4, 48\]; on this model it is "
                                         r"\[4, 32\] .*made for another base"):
        load_peft(tmp_path / "adapter", bundle.model, bundle.variables)
    deeper = {**tensors, name.replace("layers.0", "layers.2"): tensors[name]}  # a third layer
    save_file(deeper, weights)
    with pytest.raises(ValueError, match="this model has no place for, such as "
                                         "'base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight'"):
        load_peft(tmp_path / "adapter", bundle.model, bundle.variables)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                                          "lora_alpha": 8, "use_dora": True}))
    with pytest.raises(ValueError, match="sets use_dora to True, which Dew's LoRA does not compute"):
        load_peft(tmp_path / "adapter", bundle.model, bundle.variables)
