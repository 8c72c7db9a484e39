"""Model FLOPs utilization: how much of what the machine can multiply a training step uses.

`flops_per_position(model, seq_len)` is the model's training FLOPs per position of a `[B, seq_len]` batch,
counted from its shapes as PaLM's appendix counts them: `6 N` for the `N` weights each position
multiplies (embedding lookups excluded, a tied head counted once as the head, a mixture's experts
counted at `top_k / experts` of their weights) plus `12 H D S` for each attention layer's scores and
weighted values over `S` keys (a sliding layer's window when shorter; causality not discounted).
State-space layers count their projections only. `peak_flops(dtype)` is the default device's rate for the
products it runs: for an accelerator whose kind `PEAKS` names, its dense peak by specification; for another
accelerator, a product large enough to reach its rate, measured; on the CPU, a product measured once a
process, the best rate seen kept per CPU and dtype. `mfu = positions per second x flops_per_position /
peak_flops`.
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

_PROBE = 1024  # the CPU probe's square products: large enough to reach the products' rate, a second at most
_ACCELERATOR_PROBE = 8192  # an accelerator's: large enough to reach its rate, which a 1024-square product does not
# Dense peak FLOP/s of one device as jax counts them (a TPU v2 or v3 core; a v4 or v5p chip), by device kind:
# (bfloat16 products, float32 products). XLA multiplies float32 operands at its default precision in one
# bfloat16 pass on a TPU and in TF32 on an NVIDIA GPU since Ampere, so those are the float32 rates.
PEAKS = {
    "TPU v2": (22.5e12, 22.5e12),
    "TPU v3": (61.5e12, 61.5e12),
    "TPU v4": (275e12, 275e12),
    "TPU v5 lite": (197e12, 197e12),  # v5e
    "TPU v5e": (197e12, 197e12),
    "TPU v5": (459e12, 459e12),  # v5p
    "TPU v5p": (459e12, 459e12),
    "TPU v6 lite": (918e12, 918e12),  # v6e, Trillium
    "TPU v6e": (918e12, 918e12),
    "NVIDIA A100": (312e12, 156e12),
    "NVIDIA H100 PCIe": (756e12, 378e12),
    "NVIDIA H100": (989e12, 495e12),  # SXM
    "NVIDIA H200": (989e12, 495e12),
    "NVIDIA L40S": (362e12, 183e12),
    "NVIDIA L4": (121e12, 60e12),
}


def device_peak(kind: str, dtype) -> float | None:
    """The dense peak FLOP/s `PEAKS` gives a device of `kind` (jax's `device_kind`) for `dtype` products (bfloat16
    or float16 take the first rate, anything else the second), None for a kind it does not name. The longest
    name that `kind` starts with is taken (an "NVIDIA A100-SXM4-80GB" is an "NVIDIA A100")."""
    names = [name for name in PEAKS if kind == name or kind.startswith(name + " ") or kind.startswith(name + "-")]
    if not names:
        return None
    half, single = PEAKS[max(names, key=len)]
    return half if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else single


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
    """FLOP/s of the default device's products in `dtype`: an accelerator's dense peak where `PEAKS` names its
    kind; otherwise the best of XLA's and Dew's native product (`dew.kernels`) on square operands (`_PROBE` on the
    CPU, `_ACCELERATOR_PROBE` on an accelerator). A probe on a busy machine reads low, so each process probes
    once and the cache keeps the best rate this machine has shown: the peak only rises."""
    device = jax.local_devices()[0]
    known_peak = device_peak(device.device_kind, dtype) if device.platform != "cpu" else None
    if known_peak is not None:
        return known_peak
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
    size = _PROBE if jax.default_backend() == "cpu" else _ACCELERATOR_PROBE
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    best = 0.0
    for policy in ("xla", "native") if jax.default_backend() == "cpu" else ("xla",):
        with using(policy):
            product = jax.jit(lambda x, y: dot(x, y, out_dtype=jnp.float32))
            jax.block_until_ready(product(a, a))
        for _ in range(5):
            started = time.perf_counter()
            jax.block_until_ready(product(a, a))
            best = max(best, 2 * size**3 / (time.perf_counter() - started))
    return best


__all__ = ["PEAKS", "device_peak", "flops_per_position", "peak_flops"]
