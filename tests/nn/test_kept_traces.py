"""A decoder's traced shapes and linears kept between processes beside JAX's cache (`dew.compilation_cache.kept_trace`):
what a warm `dew serve` or `dew generate` reads instead of tracing the model again."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from dew import compilation_cache, models
from dew.nn import quantize, transformer
from dew.nn.lora import LoRA, LoRAModel

KNOBS = dict(vocab_size=64, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_features=64,
             max_seq_len=16)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Kept traces go to `tmp_path`, as if JAX's cache were set there (without setting JAX's own)."""
    monkeypatch.setattr(compilation_cache, "_root", lambda: str(tmp_path))
    return tmp_path / "dew-kept"


def entries(directory, kind):
    return sorted(path.name for path in directory.glob(f"{kind}-*")) if directory.is_dir() else []


def forbid_tracing(monkeypatch):
    def traced(*args, **kwargs):
        raise AssertionError("traced the model, where its kept trace should have been read")

    monkeypatch.setattr(jax, "eval_shape", traced)


def fresh_linears(monkeypatch):
    monkeypatch.setattr(quantize, "_LINEAR_PATHS", {})


def test_a_decoders_shapes_and_linears_are_read_back_as_traced(kept, monkeypatch):
    model = models.build("causal_transformer", **KNOBS, scan_layers=1)
    shapes = transformer.boxed_shapes.__wrapped__(model)  # not the in-process memo: a new process's first call
    variables = nn.meta.unbox(shapes)
    fresh_linears(monkeypatch)
    linears = quantize.linear_paths(model, variables)
    assert len(entries(kept, "shapes")) == 1 and len(entries(kept, "linears")) == 1
    assert linears and all(isinstance(path, tuple) for path in linears)

    with monkeypatch.context() as patch:  # another process: nothing traced, the same trees back
        forbid_tracing(patch)
        fresh_linears(patch)
        assert transformer.boxed_shapes.__wrapped__(model) == shapes
        assert quantize.linear_paths(model, variables) == linears
    # another model, or the same one under other software or another Dew, is another entry
    transformer.boxed_shapes.__wrapped__(models.build("causal_transformer", **{**KNOBS, "num_layers": 3}))
    with monkeypatch.context() as patch:
        patch.setattr(compilation_cache, "environment", lambda: "another Dew")
        assert transformer.boxed_shapes.__wrapped__(model) == shapes
    assert len(entries(kept, "shapes")) == 3


def test_a_damaged_entry_is_traced_again_and_replaced(kept, monkeypatch, caplog):
    model = models.build("causal_transformer", **KNOBS)
    shapes = transformer.boxed_shapes.__wrapped__(model)
    [name] = entries(kept, "shapes")
    (kept / name).write_text('{"params": {"embed_tokens": ')  # cut short
    with caplog.at_level(logging.WARNING, logger="dew.compilation_cache"):
        assert transformer.boxed_shapes.__wrapped__(model) == shapes
    assert "could not read the kept trace" in caplog.text
    with monkeypatch.context() as patch:
        forbid_tracing(patch)
        assert transformer.boxed_shapes.__wrapped__(model) == shapes


def test_only_a_decoder_is_kept_and_only_where_a_cache_is_set(kept, tmp_path, monkeypatch):
    decoder = models.build("causal_transformer", **KNOBS)
    adapted = LoRAModel(decoder, LoRA(2, 4.0, ("q_proj",)))
    assert compilation_cache.described(adapted) is None  # a LoRA model has more than a config: traced each time
    transformer.boxed_shapes.__wrapped__(adapted)
    assert entries(kept, "shapes") == []
    monkeypatch.setattr(compilation_cache, "_root", lambda: None)  # no JAX cache set: traced, nothing written
    shapes = transformer.boxed_shapes.__wrapped__(decoder)
    assert not (tmp_path / "dew-kept").exists()
    tokens = jnp.zeros((1, 4), jnp.int32)
    assert jax.tree_util.tree_structure(decoder.init(jax.random.key(0), tokens)) == \
        jax.tree_util.tree_structure(nn.meta.unbox(shapes))
