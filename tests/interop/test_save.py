"""`Pretrained.save`: exports load back here and in transformers, and replace an earlier export atomically."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from dew.errors import describe, exit_status
from dew.interop import load_pretrained
from dew.interop.safetensors_files import os_errors
from tests.interop.conftest import save_checkpoint, torch, torch_model, transformers
from tests.tolerances import transformers_decoder_ulps, ulp_bound

TOKENS = np.random.default_rng(3).integers(0, 97, (2, 10))


def _logits(bundle, variables=None):
    return np.asarray(bundle.model.apply(variables or bundle.variables, jnp.asarray(TOKENS, jnp.int32)))


def _assert_transformers_logits(directory, ours):
    """transformers' fp32 logits of the export against Dew's of the same weights, 2-layer width-32 decoders
    over 10 tokens: 562-605 ulps of the largest logit (transformers_decoder_ulps), 6e-4 to 8e-4. Observed:
    1.9e-5 (llama, shifted weights, logits up to 9.1), 9.2e-6 (llama, sharded), 2.9e-6 (gemma3)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
    bound = ulp_bound(transformers_decoder_ulps(model.config, TOKENS.shape[1]), np.abs(theirs).max())
    np.testing.assert_allclose(theirs, ours, atol=bound, rtol=0)


def _shifted(variables):
    """Different weights of the same shape, as a training step would give."""
    return jax.tree_util.tree_map(lambda x: x * 1.25 + 0.01, variables)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return load_pretrained(save_checkpoint(torch_model("gemma3-local-global"), tmp_path_factory.mktemp("gemma3")))


@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_export_loads_back_here_and_in_transformers(which, llama_checkpoint, gemma3, tmp_path):
    bundle = load_pretrained(llama_checkpoint[0]) if which == "llama" else gemma3
    trained = _shifted(bundle.variables)
    out = bundle.save(tmp_path / "export", variables=trained)
    again = load_pretrained(out)
    np.testing.assert_array_equal(_logits(again), _logits(bundle, trained))
    _assert_transformers_logits(out, _logits(bundle, trained))
    assert again.config == {**bundle.config, "dtype": "float32"}
    assert json.loads((out / "generation_config.json").read_text()) == bundle.generation_config
    if which == "llama":
        assert (out / "tokenizer.json").read_bytes() == (llama_checkpoint[0] / "tokenizer.json").read_bytes()
        assert again.generation == bundle.generation
    else:
        assert "lm_head.weight" not in json.dumps(list(again.variables["params"]))  # tied: no head written


def test_sharded_export_and_replacing_it(llama_checkpoint, tmp_path):
    bundle = load_pretrained(llama_checkpoint[0])
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.fp16.safetensors").write_bytes(b"not ours")
    bundle.save(out, max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    np.testing.assert_array_equal(_logits(load_pretrained(out)), _logits(bundle))
    _assert_transformers_logits(out, _logits(bundle))

    bundle.save(out, variables=_shifted(bundle.variables))  # one file over the sharded export
    assert not (out / "model.safetensors.index.json").exists()
    assert not any((out / shard).exists() for shard in shards)
    assert (out / "model.fp16.safetensors").read_bytes() == b"not ours"
    np.testing.assert_array_equal(_logits(load_pretrained(out)), _logits(bundle, _shifted(bundle.variables)))


_KILLED_SAVE = """
import os, signal, sys
import jax
from dew.interop import load_pretrained, safetensors_files

source, target, point = sys.argv[1:]
bundle = load_pretrained(source)

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "mid-shards":
    write_shard, written = safetensors_files._write_shard, []
    def write_then_die(*args):
        written.append(write_shard(*args))
        if len(written) == 2:
            die()
        return written[-1]
    safetensors_files._write_shard = write_then_die
else:  # every new shard and config is on disk; the index that switches to them is not
    safetensors_files.write_atomically = die
bundle.save(target, variables=jax.tree_util.tree_map(lambda x: x * 3.0, bundle.variables), max_shard_size="20KB")
"""


@pytest.mark.parametrize("point", ["mid-shards", "before-index"])
def test_killed_save_leaves_previous_export_loadable(point, llama_checkpoint, tmp_path):
    bundle = load_pretrained(llama_checkpoint[0])
    out = bundle.save(tmp_path / "export", max_shard_size="20KB")
    before = set(out.iterdir())
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(llama_checkpoint[0]), str(out),
                             point], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert {path.suffix for path in set(out.iterdir()) - before} == {".safetensors"}  # new shards, no index
    np.testing.assert_array_equal(_logits(load_pretrained(out)), _logits(bundle))


def test_variables_of_another_model_are_refused(llama_checkpoint, gemma3, tmp_path):
    bundle = load_pretrained(llama_checkpoint[0])
    with pytest.raises(ValueError, match="do not have this model's parameter tree"):
        bundle.save(tmp_path / "wrong", variables=gemma3.variables)
    params = bundle.variables["params"]
    wider = {"params": {**params, "norm": {"scale": jnp.ones(33)}}}
    with pytest.raises(ValueError, match=r"\['norm'\]\['scale'\] with shape \(33,\); this model has \(32,\)"):
        bundle.save(tmp_path / "wrong", variables=wider)
    assert not (tmp_path / "wrong").exists()


def test_a_write_the_system_refuses_is_the_oserror_it_wraps(tmp_path):
    with pytest.raises(OSError) as refused, os_errors(tmp_path):  # safetensors' own error for a failed write
        save_file({"x": np.ones(4, np.float32)}, str(tmp_path / "missing" / "model.safetensors"))
    assert isinstance(refused.value, FileNotFoundError) and refused.value.filename == str(tmp_path)
    assert describe(refused.value) == f"{tmp_path}: No such file or directory" and exit_status(refused.value) == 2
