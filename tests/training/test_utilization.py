"""`dew.training.utilization`: the model FLOPs of a step counted from shapes, the cached peak, and `mfu` in
the trainer's log."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from dew.nn.mla import LatentAttention
from dew.nn.moe import Mixture
from dew.nn.transformer import CausalTransformer, DecoderConfig
from dew.training import utilization
from dew.training.utilization import flops_per_position, peak_flops

BASE = dict(vocab_size=1000, emb_features=64, num_layers=2, num_heads=4, mlp_features=256, max_seq_len=128)
# Per layer: q, k, v, o (4 x 64 x 64) and gate, up, down (3 x 64 x 256); the head 64 x 1000.
LAYER, HEAD = 4 * 64 * 64 + 3 * 64 * 256, 64 * 1000


def test_dense_decoder_counts_palms_way():
    flops = flops_per_position(CausalTransformer(DecoderConfig(**BASE)), 128)
    assert flops == 6 * (2 * LAYER + HEAD) + 12 * 2 * 4 * 16 * 128
    tied = flops_per_position(CausalTransformer(DecoderConfig(**BASE, tie_embeddings=True)), 128)
    assert tied == flops  # the tied table is counted once, as the head; an untied one is looked up only


def test_windows_and_experts_and_latent_attention():
    windowed = DecoderConfig(**BASE, sliding_window=32, layer_types=("sliding_attention", "full_attention"))
    assert flops_per_position(CausalTransformer(windowed), 128) == 6 * (2 * LAYER + HEAD) + 12 * 4 * 16 * (32 + 128)
    mixture = Mixture(experts=4, top_k=1, layers=(1,))
    sparse = flops_per_position(CausalTransformer(DecoderConfig(**BASE, mixture=mixture)), 128)
    router = 64 * 4
    expected = 6 * (2 * 4 * 64 * 64 + 3 * 64 * 256 + 3 * 64 * 256 * 4 / 4 + router + HEAD) + 12 * 2 * 4 * 16 * 128
    assert sparse == pytest.approx(expected)  # one of four experts' weights per token
    latent = LatentAttention(kv_rank=32, q_rank=None, nope_dim=16, rope_dim=8, value_dim=16)
    mla = DecoderConfig(**{**BASE, "num_heads": 4}, latent=latent)
    heads_width = 4 * (16 + 8 + 16) / 2
    model = CausalTransformer(mla)
    assert flops_per_position(model, 256) - flops_per_position(model, 128) == 12 * 2 * heads_width * 128


def test_the_peak_keeps_the_best_rate_seen(tmp_path, monkeypatch):
    """A probe on a busy machine reads low: each process probes once, and the cache keeps the best."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rates = iter([2e11, 1e11, 3e11])
    monkeypatch.setattr(utilization, "_probe", lambda dtype: next(rates))
    cached = lambda: json.loads((tmp_path / "dew" / "peak_flops.json").read_text())
    for expected in (2e11, 2e11, 3e11):  # three processes: a fast probe, a slow one, a faster one
        peak_flops.cache_clear()
        assert peak_flops(jnp.float32) == expected
        assert list(cached().values()) == [expected] and "float32" in next(iter(cached()))
    assert peak_flops(jnp.float32) == 3e11  # within a process, probed once
    peak_flops.cache_clear()


def test_an_accelerator_divides_by_its_kinds_peak(monkeypatch):
    """MFU on a known accelerator divides by its dense peak by specification (never a probe of a small product,
    which read a TPU v5e at 2% of its rate and gave an MFU above 1000%); an unknown kind is probed."""
    assert utilization.device_peak("TPU v5 lite", jnp.bfloat16) == 197e12
    assert utilization.device_peak("TPU v5 lite", jnp.float32) == 197e12  # one bfloat16 pass at default precision
    assert utilization.device_peak("TPU v5", jnp.bfloat16) == 459e12  # v5p, not v5e
    assert utilization.device_peak("NVIDIA A100-SXM4-80GB", jnp.bfloat16) == 312e12
    assert utilization.device_peak("NVIDIA A100-SXM4-80GB", jnp.float32) == 156e12  # TF32
    assert utilization.device_peak("NVIDIA H100 PCIe", jnp.bfloat16) == 756e12
    assert utilization.device_peak("NVIDIA H100 80GB HBM3", jnp.bfloat16) == 989e12
    assert utilization.device_peak("NVIDIA L40S", jnp.bfloat16) == 362e12  # not the L4's
    assert utilization.device_peak("NVIDIA L4", jnp.float16) == 121e12
    assert utilization.device_peak("Some New Chip", jnp.bfloat16) is None

    class Device:
        platform, device_kind = "tpu", "TPU v5 lite"

    monkeypatch.setattr(utilization.jax, "local_devices", lambda: [Device()])
    monkeypatch.setattr(utilization, "_probe", lambda dtype: pytest.fail("a known kind is not probed"))
    peak_flops.cache_clear()
    try:
        assert peak_flops(jnp.bfloat16) == 197e12
    finally:
        peak_flops.cache_clear()


def test_trainer_logs_mfu(tmp_path, monkeypatch):
    import jax
    import numpy as np
    import optax

    from dew.data.dataset import Dataset
    from dew.objectives.lm import LMObjective
    from dew.training import Trainer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    peak_flops.cache_clear()
    monkeypatch.setattr(utilization, "_probe", lambda dtype: 1e11)
    model = CausalTransformer(DecoderConfig(**{**BASE, "max_seq_len": 16}))
    rows = np.random.default_rng(0).integers(0, 1000, (4, 17)).astype(np.int32)
    data = Dataset(train=lambda partition: iter([{"text": rows}] * 3), val=None, records=4, batch=4)
    trainer = Trainer(LMObjective(model, 16, ema_decay=None), optax.sgd(1e-2), key=jax.random.key(0))
    trainer.fit(data, steps=3, log_every=1)
    logged = [record["mfu"] for record in trainer.history if "mfu" in record]
    per_step = flops_per_position(model, 16) * 16 * 4
    assert len(logged) == 3
    for record in trainer.history:
        assert record["mfu"] == pytest.approx(per_step / record["step_s"] / 1e11)
    peak_flops.cache_clear()
