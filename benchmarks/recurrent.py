"""Recurrent models against transformers' torch paths on the same weights and inputs (fp32, CPU): prefill
tokens/s of a whole prompt, and decode tokens/s of one token a step through a cache filled to a context,
for a small Mamba2 (every layer a Mamba2 mixer) and a small hybrid (Qwen 3.5's dense text decoder: three
Gated DeltaNet layers, then an attention layer). transformers runs its torch fallbacks (no mamba_ssm,
causal_conv1d or flash-linear-attention kernels on a CPU).

    PYTHONPATH=. python benchmarks/recurrent.py

Wall time and process CPU time are both printed (the machine is shared); a ratio above 1 means Dew is faster.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks.common import machine, timed_wall_and_cpu
from dew.interop import load_pretrained

VOCAB = 1024
MODELS = {
    "mamba2": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=256, num_heads=8, head_dim=64, expand=2, state_size=64, n_groups=1,
        chunk_size=256, num_hidden_layers=4)),
    "hybrid (qwen3_5_text)": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32)),
}


def pair(name: str, directory: Path):
    """(the transformers model, Dew's bundle of the same weights)."""
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    model.save_pretrained(directory)
    return model, load_pretrained(directory)


def ratio_line(what: str, tokens: int, dew: tuple[float, float], theirs: tuple[float, float]) -> str:
    (dew_wall, dew_cpu), (wall, cpu) = dew, theirs
    return (f"{what}: Dew {tokens / dew_wall:9.1f} tokens/s ({dew_wall * 1e3:7.2f} ms wall, {dew_cpu * 1e3:7.2f} ms "
            f"CPU); transformers {tokens / wall:9.1f} tokens/s ({wall * 1e3:7.2f} ms wall, {cpu * 1e3:7.2f} ms CPU); "
            f"{wall / dew_wall:.2f}x wall, {cpu / dew_cpu:.2f}x CPU")


def prefill(model, bundle, seq_len: int) -> str:
    ids = np.random.default_rng(seq_len).integers(0, VOCAB, (1, seq_len))
    forward = jax.jit(lambda v, t: bundle.model.apply(v, t))
    tokens = jnp.asarray(ids, jnp.int32)
    dew = timed_wall_and_cpu(lambda: forward(bundle.variables, tokens).block_until_ready(), repeats=5)
    with torch.no_grad():
        theirs = timed_wall_and_cpu(lambda: model(torch.from_numpy(ids), use_cache=False).logits, repeats=3)
    return ratio_line(f"prefill {seq_len:5d} tokens", seq_len, dew, theirs)


def decode(model, bundle, rows: int, context: int) -> str:
    ids = np.random.default_rng(context).integers(0, VOCAB, (rows, context))
    decoder = bundle.model
    cache = decoder.init_cache(rows, context + 16)
    _, cache = jax.jit(lambda v, t, c: decoder.apply(v, t, cache=c))(bundle.variables, jnp.asarray(ids, jnp.int32),
                                                                       cache)
    step = jax.jit(lambda v, t, c: decoder.apply(v, t, cache=c)[0])
    one = jnp.asarray(ids[:, -1:], jnp.int32)
    dew = timed_wall_and_cpu(lambda: step(bundle.variables, one, cache).block_until_ready(), repeats=10)
    with torch.no_grad():
        past = model(torch.from_numpy(ids), use_cache=True).cache
        last = torch.from_numpy(ids[:, -1:])
        # each call appends one token to the cache it is given: an attention layer's grows by ten in all
        theirs = timed_wall_and_cpu(lambda: model(last, cache=past, use_cache=True).logits, repeats=10)
    return ratio_line(f"decode batch {rows}, context {context:5d}", rows, dew, theirs)


if __name__ == "__main__":
    print(machine(), f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    for name in MODELS:
        with tempfile.TemporaryDirectory() as directory:
            model, bundle = pair(name, Path(directory))
        print(f"-- {name}")
        for seq_len in (512, 2048):
            print(prefill(model, bundle, seq_len))
        for rows in (1, 8):
            for context in (256, 2048):
                print(decode(model, bundle, rows, context))
