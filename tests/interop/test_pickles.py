"""PyTorch pickle checkpoints: converted once to safetensors, or read from SFconvertbot's pull request on the Hub."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants as constants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from huggingface_hub.errors import EntryNotFoundError

from dew.interop import load_pretrained
from tests.interop.conftest import save_checkpoint, torch, torch_model

MAIN, PULL_REQUEST, STALE_PARENT = "c" * 40, "d" * 40, "e" * 40
TOKENS = np.asarray([[4, 8, 15, 16, 23, 42]], np.int32)


def write_pickles(model, directory: Path, shards: int = 1) -> Path:
    """`model` as transformers wrote checkpoints before safetensors: configs, a tokenizer and
    pytorch_model.bin, or `shards` pickles named by pytorch_model.bin.index.json."""
    save_checkpoint(model, directory, tokenizer=True)
    (directory / "model.safetensors").unlink()
    state = model.state_dict()  # a tied head shares its storage with the embedding here, as torch.save keeps it
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return directory
    names = list(state)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file_name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({names[k]: state[names[k]] for k in part}, directory / file_name)
        weight_map.update({names[k]: file_name for k in part})
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _logits(bundle) -> np.ndarray:
    return np.asarray(bundle.model.apply(bundle.variables, TOKENS))


@pytest.fixture
def dew_cache(tmp_path, monkeypatch):
    """A Dew cache of this test's own; the converted copies land in its dew/converted/."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "dew" / "converted"


@pytest.mark.parametrize("case, shards, dtype", [("llama", 1, "float32"), ("llama", 2, "float32"),
                                                  ("llama-bias-tied-mha", 1, "float32"), ("llama", 1, "bfloat16")])
def test_pickles_load_as_their_safetensors_export(case, shards, dtype, tmp_path, dew_cache):
    model = torch_model(case).to(getattr(torch, dtype))
    reference = load_pretrained(save_checkpoint(model, tmp_path / "safetensors"))
    source = write_pickles(model, tmp_path / "pickles", shards)
    loaded = load_pretrained(source)
    assert loaded.model.config.param_dtype == reference.model.config.param_dtype == jnp.dtype(dtype)
    assert loaded.directory == source and loaded.tokenizer.encode("w3 w9") == [3, 9]
    leaves = zip(jax.tree_util.tree_leaves(loaded.variables), jax.tree_util.tree_leaves(reference.variables))
    for ours, theirs in leaves:
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    np.testing.assert_array_equal(_logits(loaded), _logits(reference))  # exact: the same tensors, converted once
    (converted,) = dew_cache.iterdir()
    suffixes = sorted(path.suffix for path in converted.iterdir())
    assert suffixes == ([".safetensors"] if shards == 1 else [".json"] + [".safetensors"] * shards)


_LOAD_WITHOUT_TORCH = """
import sys
import numpy as np
sys.modules["torch"] = None  # any import of torch fails
from dew.interop import load_pretrained
bundle = load_pretrained(sys.argv[1])
np.save(sys.argv[2], np.asarray(bundle.model.apply(bundle.variables, np.asarray([[4, 8, 15, 16, 23, 42]], np.int32))))
"""


def test_later_loads_read_the_copy_without_torch(tmp_path, dew_cache):
    source = write_pickles(torch_model("llama"), tmp_path / "pickles", shards=2)
    expected = _logits(load_pretrained(source))
    later = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOAD_WITHOUT_TORCH), str(source),
                            str(tmp_path / "logits.npy")], capture_output=True, text=True)
    assert later.returncode == 0, later.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), expected)
    assert len(list(dew_cache.iterdir())) == 1


_KILLED_CONVERSION = """
import os, signal, sys
import dew.interop.torch_files as torch_files
convert_file = torch_files._convert_file
def convert_then_die(*args):  # the first shard is written, the copy is not whole
    convert_file(*args)
    os.kill(os.getpid(), signal.SIGKILL)
torch_files._convert_file = convert_then_die
from dew.interop import load_pretrained
load_pretrained(sys.argv[1])
"""


def test_killed_conversion_leaves_no_copy_that_loads(tmp_path, dew_cache):
    source = write_pickles(torch_model("llama"), tmp_path / "pickles", shards=2)
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_CONVERSION), str(source)],
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    left = list(dew_cache.iterdir())
    assert len(left) == 1 and left[0].name.endswith(".tmp")  # only the staging directory is left
    reference = load_pretrained(save_checkpoint(torch_model("llama"), tmp_path / "safetensors"))
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(left[0], (two_days_ago, two_days_ago))  # abandoned a while ago: the next conversion removes it
    np.testing.assert_array_equal(_logits(load_pretrained(source)), _logits(reference))
    assert [path.name.endswith(".tmp") for path in dew_cache.iterdir()] == [False]


def test_without_torch_the_refusal_names_the_extra_and_the_space(tmp_path, dew_cache, monkeypatch):
    source = write_pickles(torch_model("llama"), tmp_path / "pickles")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pytorch_model.bin'\] are PyTorch pickles: .*pip install 'dew-ml\[torch\]'"
                                          r".*https://huggingface.co/spaces/safetensors/convert"):
        load_pretrained(source)
    assert not dew_cache.exists()


@pytest.fixture
def pickle_repo(tmp_path):
    """`dew-tests/pickles` in the Hub cache: main holds two pickle shards (and a stray copy Dew must not
    fetch); SFconvertbot's refs/pr/1 on top of it adds model.safetensors. Returns the safetensors reference."""
    model = torch_model("llama")
    exported = save_checkpoint(model, tmp_path / "safetensors", tokenizer=True)
    repo = Path(constants.HF_HUB_CACHE) / "models--dew-tests--pickles"
    write_pickles(model, repo / "snapshots" / MAIN, shards=2)
    (repo / "snapshots" / MAIN / "consolidated.pth").write_bytes(b"a copy Dew must not fetch")
    shutil.copytree(exported, repo / "snapshots" / PULL_REQUEST)
    for ref, commit in {"main": MAIN, "refs/pr/1": PULL_REQUEST}.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    yield load_pretrained(exported)
    shutil.rmtree(repo)


class ConversionPullRequests:
    """The Hub's answers about `dew-tests/pickles`: a stale SFconvertbot pull request on another commit,
    then refs/pr/1 on main."""

    parents = {"refs/pr/2": STALE_PARENT, "refs/pr/1": MAIN}

    def get_repo_discussions(self, repo_id, **filters):
        assert repo_id == "dew-tests/pickles"
        assert filters == dict(author="SFconvertbot", discussion_type="pull_request", discussion_status="open")
        return iter(SimpleNamespace(git_reference=ref) for ref in self.parents)

    def list_repo_commits(self, repo_id, revision):
        return [SimpleNamespace(commit_id="f" * 40), SimpleNamespace(commit_id=self.parents[revision])]


def test_hub_pickles_load_from_the_conversion_pull_request(pickle_repo, monkeypatch, caplog, dew_cache):
    monkeypatch.setattr(huggingface_hub, "HfApi", ConversionPullRequests)
    monkeypatch.setitem(sys.modules, "torch", None)  # the pull request's safetensors need no torch
    caplog.set_level(logging.INFO, logger="dew.interop")
    loaded = load_pretrained("dew-tests/pickles")
    assert loaded.revision == PULL_REQUEST
    assert "refs/pr/1" in caplog.text and "refs/pr/2" not in caplog.text
    np.testing.assert_array_equal(_logits(loaded), _logits(pickle_repo))
    assert not dew_cache.exists()


def test_hub_pickles_offline_are_converted(pickle_repo, monkeypatch, caplog, dew_cache):
    caplog.set_level(logging.DEBUG, logger="dew.interop")
    requested = []
    fetch = huggingface_hub.hf_hub_download
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, **kw: requested.append(name) or fetch(repo, name, **kw))
    loaded = load_pretrained("dew-tests/pickles")  # offline: no pull request lookup, the pickles are converted
    assert loaded.revision == MAIN
    assert "no lookup of SFconvertbot pull requests on dew-tests/pickles" in caplog.text
    assert sorted(name for name in requested if ".bin" in name or name.endswith(".pth")) == [
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json"]
    np.testing.assert_array_equal(_logits(loaded), _logits(pickle_repo))
    assert len(list(dew_cache.iterdir())) == 1


def test_gguf_only_hub_repo_names_its_files_and_the_argument(monkeypatch):
    repo = Path(constants.HF_HUB_CACHE) / "models--dew-tests--gguf-only"
    (repo / "snapshots" / MAIN).mkdir(parents=True)
    (repo / "snapshots" / MAIN / "Model-Q4_K_M.gguf").write_bytes(b"only listed, never read")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    expected = (r"GGUF file\(s\) \['Model-Q4_K_M.gguf'\]: load one with "
                r"load_pretrained\(..., gguf_file='Model-Q4_K_M.gguf'\)")
    with pytest.raises(FileNotFoundError, match=expected):  # offline: the cached snapshot is listed
        load_pretrained("dew-tests/gguf-only")

    def no_config(repo_id, filename, **kwargs):
        raise EntryNotFoundError(f"{repo_id} has no {filename}")

    listing = SimpleNamespace(list_repo_files=lambda repo_id, revision: ["README.md", "Model-Q4_K_M.gguf"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *args, **kwargs: None)  # the Hub answers
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_config)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: listing)
    with pytest.raises(FileNotFoundError, match=expected):  # online: the Hub lists the repository
        load_pretrained("dew-tests/gguf-only")


class _RunsCode:
    """What a malicious pickle holds: unpickling it calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_wants_to_run_code_is_refused_as_such(tmp_path, dew_cache):
    source = write_pickles(torch_model("llama"), tmp_path / "pickles")
    marker = tmp_path / "ran"
    torch.save({**torch.load(source / "pytorch_model.bin", weights_only=True),
                "lm_head.extra": _RunsCode(marker)}, source / "pytorch_model.bin")
    with pytest.raises(ValueError) as refused:
        load_pretrained(source)
    assert str(refused.value) == (
        f"{source / 'pytorch_model.bin'} asks to call {os.system.__module__}.system when it is unpickled: the file "
        "wants to run code, and Dew will not load it (it reads pickles with torch.load(weights_only=True), which runs "
        "none); load the model's safetensors weights instead")
    assert "weights_only=False" not in str(refused.value)  # torch's own advice would run it
    assert not marker.exists() and not (dew_cache.exists() and any(dew_cache.iterdir()))
