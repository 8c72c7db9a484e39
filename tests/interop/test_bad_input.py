"""Bad checkpoints are refused with the file, the tensor or field, and what would load."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dew.interop import load_pretrained, safetensors_files


@pytest.fixture
def checkpoint(llama_checkpoint, tmp_path):
    """A writable copy of the tiny Llama checkpoint and its tensors."""
    directory = tmp_path / "copy"
    shutil.copytree(llama_checkpoint[0], directory)
    return directory, load_file(directory / "model.safetensors")


def _rewrite(directory, tensors, name="model.safetensors"):
    save_file(tensors, str(directory / name), metadata={"format": "pt"})


def test_truncated_file(checkpoint):
    directory, _ = checkpoint
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file .* truncated or corrupt"):
        load_pretrained(directory)


def test_missing_tensor(checkpoint):
    directory, tensors = checkpoint
    del tensors["model.layers.1.mlp.up_proj.weight"]
    _rewrite(directory, tensors)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) .*'model.layers.1.mlp.up_proj.weight'"):
        load_pretrained(directory)


def test_extra_tensor(checkpoint):
    directory, tensors = checkpoint
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"]
    _rewrite(directory, tensors)
    with pytest.raises(ValueError, match=r"has no place for, such as \['model.layers.2.mlp.up_proj.weight'\]"):
        load_pretrained(directory)


def test_shape_mismatch(checkpoint):
    directory, tensors = checkpoint
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    _rewrite(directory, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape "
                                         r"\(8, 32\); .* needs \(16, 32\)"):
        load_pretrained(directory)


def test_quantized_tensor(checkpoint):
    directory, tensors = checkpoint
    tensors["model.norm.weight"] = np.ones(32, np.int8)
    _rewrite(directory, tensors)
    with pytest.raises(ValueError, match="'model.norm.weight' in model.safetensors is stored as I8"):
        load_pretrained(directory)


def _shard(directory, tensors, second: set[str]):
    (directory / "model.safetensors").unlink()
    first = {k: v for k, v in tensors.items() if k not in second}
    _rewrite(directory, first, "a.safetensors")
    _rewrite(directory, {k: tensors[k] for k in second}, "b.safetensors")
    weight_map = {**{k: "a.safetensors" for k in first}, **{k: "b.safetensors" for k in second}}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_tensor_in_two_shards(checkpoint):
    directory, tensors = checkpoint
    _shard(directory, tensors, {"model.norm.weight"})
    _rewrite(directory, tensors, "b.safetensors")  # the second shard holds everything again
    with pytest.raises(ValueError, match=r"tensor '.*' is stored in two shards, a.safetensors and b.safetensors"):
        load_pretrained(directory)


def test_index_and_shards_disagree(checkpoint):
    directory, tensors = checkpoint
    _shard(directory, tensors, {"model.norm.weight", "model.embed_tokens.weight"})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "a.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'model.norm.weight' is stored in b.safetensors but .* lists it in a.safetensors"):
        load_pretrained(directory)
    index["weight_map"]["model.embed_tokens.weight"] = "a.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json lists tensor\(s\) \['model.embed_tokens.weight', 'model.norm.weight'\] that no shard holds"):
        load_pretrained(directory)
    index["weight_map"]["model.norm.weight"] = "c.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"names shard\(s\) \['c.safetensors'\]"):
        load_pretrained(directory)


def test_unknown_model_type(checkpoint):
    directory, _ = checkpoint
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "no_such_type"}))
    with pytest.raises(ValueError, match=r"config.json names model_type 'no_such_type', which is neither a Dew family"):
        load_pretrained(directory)


def test_directory_without_safetensors(checkpoint):
    directory, _ = checkpoint
    (directory / "model.safetensors").rename(directory / "Model-Q4_K_M.gguf")
    with pytest.raises(FileNotFoundError, match=r"GGUF file\(s\) \['Model-Q4_K_M.gguf'\]: .*gguf_file='Model-Q4_K_M.gguf'"):
        load_pretrained(directory)
    (directory / "Model-Q4_K_M.gguf").rename(directory / "pytorch_model-00001-of-00002.bin")
    with pytest.raises(FileNotFoundError, match=r"PyTorch pickles \['pytorch_model-00001-of-00002.bin'\] but neither "
                                                r"pytorch_model.bin nor the pytorch_model.bin.index.json"):
        load_pretrained(directory)
    (directory / "pytorch_model-00001-of-00002.bin").rename(directory / "pytorch_model.bin")  # safetensors bytes
    with pytest.raises(ValueError, match=r"pytorch_model.bin is not a PyTorch weights file torch.load\(weights_only=True\) "
                                         r"reads \(Unsupported operand \d+\): it is truncated or corrupt") as refused:
        load_pretrained(directory)
    assert "weights_only=False" not in str(refused.value)  # torch's advice, which would run a pickle's code
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a Hub repository id"):
        load_pretrained(str(directory / "no such" / "dir"))


def test_generic_fallback_refuses_what_only_native_loads_have(checkpoint):
    directory, _ = checkpoint
    with pytest.raises(NotImplementedError, match=r"fallback='torchax' runs transformers' own model, so \['quantize'\]"):
        load_pretrained(directory, fallback="torchax", quantize="int8")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "{outside}", "sub/../../outside.safetensors"])
def test_index_naming_a_shard_outside_the_directory_is_refused_before_anything_is_opened(shard, checkpoint,
                                                                                          monkeypatch):
    directory, tensors = checkpoint
    outside = directory.parent / "outside.safetensors"
    _rewrite(directory.parent, tensors, outside.name)  # a file that would load, were the index followed
    shard = shard.format(outside=outside)
    (directory / "model.safetensors").unlink()
    weight_map = {name: shard for name in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    opened = []
    monkeypatch.setattr(safetensors_files, "safe_open", lambda path, **kwargs: opened.append(path))
    with pytest.raises(ValueError, match=rf"index.json names '{re.escape(shard)}' as the shard of tensor '.*': a shard "
                                         rf"is a file name inside {re.escape(str(directory))}, not an absolute path"):
        load_pretrained(directory)
    assert opened == []


def test_weights_that_are_not_finite_are_refused_naming_the_tensor(checkpoint):
    directory, tensors = checkpoint
    _rewrite(directory, {name: np.full_like(array, np.nan) for name, array in tensors.items()})  # every weight NaN
    with pytest.raises(ValueError, match=r"tensor '[\w.]+' in model.safetensors holds [\d,]+ NaN or infinite value\(s\) "
                                         r"among the [\d,]+ read \(the first, nan, at position 0\): the checkpoint is "
                                         r"damaged or was saved from a run that diverged"):
        load_pretrained(directory)
    key = tensors["model.layers.0.self_attn.k_proj.weight"].astype(np.float16)
    key[1, 5] = np.inf  # one value in a half-precision tensor
    _rewrite(directory, {**tensors, "model.layers.0.self_attn.k_proj.weight": key})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.k_proj.weight' in model.safetensors holds 1 "
                                         r"NaN or infinite value\(s\) among the 512 read \(the first, inf, at position "
                                         r"37\)"):
        load_pretrained(directory)
    _rewrite(directory, tensors)
    load_pretrained(directory)
