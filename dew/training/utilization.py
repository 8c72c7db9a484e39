"""Model FLOPs utilization: how much of what the machine can multiply a training step uses.

`flops_per_position(model, seq_len)` is the model's training FLOPs per position of a `[B, seq_len]` batch,
counted from its shapes as PaLM's appendix counts them: `6 N` for the `N` weights each position
multiplies (embedding lookups excluded, a tied head counted once as the head, a mixture's experts
counted at `top_k / experts` of their weights) plus `12 H D S` for each attention layer's scores and
weighted values over `S` keys (a sliding layer's window when shorter; causality not discounted).
State-space layers count their projections only. `peak_flops(dtype)` is the machine's rate for the
products it runs, probed once a process by a matrix product on the default device, the best rate
seen kept per CPU and dtype; `mfu = positions per second x flops_per_position / peak_flops`.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dew.kernels.matmul import dot
from dew.kernels.policy import using
from dew.nn.multimodal import LANGUAGE_MODEL, MultimodalTransformer
from dew.nn.transformer import CausalTransformer

_PROBE = 1024  # the probe's square products: large enough to reach the products' rate, a second at most


def flops_per_position(model, seq_len: int) -> float | None:
    """Training FLOPs (forward and backward) per position of a `[B, seq_len]` batch (see the module);
    None for a model Dew does not count this way (a decoder, a LoRA decoder and a multimodal model's
    text side are counted; a multimodal model's tower is not)."""
    decoder = getattr(model, "model", model)  # a LoRA model counts its decoder's products
    if not isinstance(decoder, (CausalTransformer, MultimodalTransformer)):
        return None
    config = model.config
    specs = config.layer_specs
    shapes, names = model.variable_shapes()["params"], model.logical_names()["params"]  # one trace, kept
    if isinstance(decoder, MultimodalTransformer):
        shapes, names = shapes[LANGUAGE_MODEL], names[LANGUAGE_MODEL]
    mixture = getattr(config, "mixture", None)
    weights = 0.0
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    for leaf, spec in zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(names, is_leaf=is_spec)):
        axes = tuple(spec)
        if len(leaf.shape) < 2 or "norm" in axes:
            continue
        if axes[:1] == ("vocab",) and not config.tie_embeddings:
            continue  # the embedding table is looked up, not multiplied; the untied head is counted
        share = mixture.top_k / mixture.experts if mixture is not None and "expert" in axes else 1.0
        weights += share * float(np.prod(leaf.shape))
    attention = 0.0
    for spec in specs:
        heads, width = _attention_width(spec.mixer)
        window = getattr(spec.mixer, "window", None)
        attention += heads * width * (seq_len if window is None else min(window, seq_len))
    return 6.0 * weights + 12.0 * attention


def _attention_width(mixer) -> tuple[int, float]:
    """(query heads, the mean of a head's query/key and value widths) of an attention mixer; (0, 0)
    for a mixer without attention scores (a state-space layer)."""
    latent = getattr(mixer, "latent", None)
    if latent is not None:
        return mixer.num_heads, (latent.nope_dim + latent.rope_dim + latent.value_dim) / 2
    if hasattr(mixer, "head_dim") and hasattr(mixer, "num_heads"):
        return mixer.num_heads, float(mixer.head_dim)
    return 0, 0.0


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "dew" / "peak_flops.json"


def _machine_key(dtype) -> str:
    device = jax.local_devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{device.platform}:{device.device_kind}|{cpu}|{os.cpu_count()} cpus|{jnp.dtype(dtype).name}|jax {jax.__version__}"


@functools.lru_cache(maxsize=8)
def peak_flops(dtype=jnp.float32) -> float:
    """FLOP/s of the default device's products in `dtype`: the best of XLA's and Dew's native product
    (`dew.kernels`) on `_PROBE`-square operands. A probe on a busy machine reads low, so each process
    probes once and the cache keeps the best rate this machine has shown: the peak only rises."""
    key, path = _machine_key(dtype), _cache_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    cached = known.get(key)
    measured = _probe(jnp.dtype(dtype))
    if isinstance(cached, (int, float)) and cached >= measured:
        return float(cached)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        known[key] = measured
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(known, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError:
        pass  # a read-only home: this process's own measurement serves
    return measured


def _probe(dtype) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((_PROBE, _PROBE)), dtype)
    best = 0.0
    for policy in ("xla", "native"):
        with using(policy):
            product = jax.jit(lambda x, y: dot(x, y, out_dtype=jnp.float32))
            jax.block_until_ready(product(a, a))
        for _ in range(5):
            started = time.perf_counter()
            jax.block_until_ready(product(a, a))
            best = max(best, 2 * _PROBE**3 / (time.perf_counter() - started))
    return best


__all__ = ["flops_per_position", "peak_flops"]
