"""Hub ids and `repo@revision` through huggingface_hub, against a local cache (the Hub is never reached)."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants as constants
import jax.numpy as jnp
import numpy as np
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from dew.interop import load_pretrained

MAIN, OLD = "a" * 40, "b" * 40
TOKENS = jnp.asarray([[4, 8, 15, 16, 23, 42]], jnp.int32)


@pytest.fixture(scope="module")
def cached_repo(llama_checkpoint):
    """`dew-tests/tiny` in the cache: main is a sharded export plus a stray copy, branch `old` one file."""
    bundle = load_pretrained(llama_checkpoint[0])
    repo = Path(constants.HF_HUB_CACHE) / "models--dew-tests--tiny"
    bundle.save(repo / "snapshots" / MAIN, max_shard_size="20KB")
    (repo / "snapshots" / MAIN / "consolidated.safetensors").write_bytes(b"a copy Dew must not fetch")
    params = bundle.variables["params"]
    old = {"params": {**params, "norm": {"scale": params["norm"]["scale"] * 2.0}}}
    bundle.save(repo / "snapshots" / OLD, variables=old)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "old").write_text(OLD)
    yield bundle, old
    shutil.rmtree(repo)


def test_hub_id_fetches_configs_index_and_named_shards(cached_repo, monkeypatch):
    bundle, _ = cached_repo
    requested = []
    fetch = huggingface_hub.hf_hub_download
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, **kw: requested.append(name) or fetch(repo, name, **kw))
    loaded = load_pretrained("dew-tests/tiny")
    assert loaded.revision == MAIN
    assert requested[0] == "config.json" and "model.safetensors.index.json" in requested
    weights = [name for name in requested if name.endswith(".safetensors")]
    assert len(weights) > 2 and "consolidated.safetensors" not in weights and "model.safetensors" not in weights
    np.testing.assert_array_equal(np.asarray(loaded.model.apply(loaded.variables, TOKENS)),
                                  np.asarray(bundle.model.apply(bundle.variables, TOKENS)))
    assert loaded.tokenizer.encode("w3 w9") == [3, 9]


def test_revision_pins_a_branch_or_commit(cached_repo):
    bundle, old = cached_repo
    expected = np.asarray(bundle.model.apply(old, TOKENS))
    for source in ("dew-tests/tiny@old", f"dew-tests/tiny@{OLD}"):
        loaded = load_pretrained(source)
        assert loaded.revision == OLD
        np.testing.assert_array_equal(np.asarray(loaded.model.apply(loaded.variables, TOKENS)), expected)


def test_missing_repository_says_what_is_missing(cached_repo):
    with pytest.raises(LocalEntryNotFoundError):
        load_pretrained("dew-tests/absent")
