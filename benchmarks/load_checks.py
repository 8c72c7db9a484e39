"""What a load's checks of its files cost: the GGUF header walk against gguf's own reader, and the
finite-weights test against the rest of a safetensors load.

    python benchmarks/load_checks.py

The GGUF file holds a 151,936-token vocabulary with its merges, types and scores (Qwen2's size), the
header gguf's reader spends longest on; a forged 153-byte file claiming a 2^40-element array shows
the refusal's time and traced memory. The safetensors checkpoint is a bfloat16 Llama of 166M
parameters (width 1024, 8 layers, 32,000 tokens) of random weights; the finite test's time is summed
over the tensors one load reads.
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

LLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, dtype="bfloat16")


def best(function, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def gguf_header(directory: Path) -> None:
    import gguf

    from dew.interop.gguf_files import check_header

    path = directory / "vocabulary.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    tokens = 151_936
    writer.add_token_list([f"token{i}" for i in range(tokens)])
    writer.add_token_merges([f"left{i} right{i}" for i in range(151_387)])
    writer.add_token_types([1] * tokens)
    writer.add_token_scores([0.0] * tokens)
    writer.add_tensor("token_embd.weight", np.zeros((tokens, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    walk, read = best(lambda: check_header(path)), best(lambda: gguf.GGUFReader(path), repeats=1)
    print(f"GGUF header of a {tokens:,}-token vocabulary: check_header {walk:.3f} s, gguf.GGUFReader {read:.1f} s")

    key = b"tokenizer.ggml.token_type"
    forged = directory / "forged.gguf"
    header = b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + struct.pack("<IIQ", 9, 0, 1 << 40)
    forged.write_bytes(header + bytes(153 - len(header)))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        check_header(forged)
    except ValueError:
        refused = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"forged 153-byte GGUF claiming 2^40 elements: refused in {refused * 1e3:.2f} ms, {peak:,} bytes traced")


def finite_weights(directory: Path) -> None:
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    import dew.interop.tensors as tensors
    from dew.interop import load_pretrained

    checkpoint = directory / "llama"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(LLAMA))
    d, f, v, kv = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"], 4 * 64
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for layer in range(LLAMA["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update({prefix + "input_layernorm.weight": (d,), prefix + "post_attention_layernorm.weight": (d,),
                       prefix + "self_attn.q_proj.weight": (d, d), prefix + "self_attn.k_proj.weight": (kv, d),
                       prefix + "self_attn.v_proj.weight": (kv, d), prefix + "self_attn.o_proj.weight": (d, d),
                       prefix + "mlp.gate_proj.weight": (f, d), prefix + "mlp.up_proj.weight": (f, d),
                       prefix + "mlp.down_proj.weight": (d, f)})
    rng = np.random.default_rng(0)
    save_file({name: (0.02 * rng.standard_normal(shape, np.float32)).astype(jnp.bfloat16)
               for name, shape in shapes.items()}, str(checkpoint / "model.safetensors"))

    check, spent = tensors.check_finite, {"seconds": 0.0, "bytes": 0}

    def timed(array, *args):
        started = time.perf_counter()
        check(array, *args)
        spent["seconds"] += time.perf_counter() - started
        spent["bytes"] += array.nbytes

    tensors.check_finite = timed
    load_pretrained(checkpoint)  # the page cache holds the file from here on
    for _ in range(3):
        spent.update(seconds=0.0, bytes=0)
        load = best(lambda: load_pretrained(checkpoint), repeats=1)
        print(f"bf16 Llama, {spent['bytes'] / 1e6:,.0f} MB: load {load:.2f} s, of which the finite test "
              f"{spent['seconds']:.3f} s ({spent['bytes'] / spent['seconds'] / 1e9:.2f} GB/s)")
    tensors.check_finite = check


def main():
    with tempfile.TemporaryDirectory() as directory:
        gguf_header(Path(directory))
        finite_weights(Path(directory))


if __name__ == "__main__":
    main()
