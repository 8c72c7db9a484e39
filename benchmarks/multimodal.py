"""Gemma 3 with an image, Dew against transformers on the same random weights and inputs: the image
prefill (tower, projector and the prompt's decoder pass) and cached decoding, in tokens a second.

    python -m benchmarks.multimodal [--size tiny|siglip] [--tower-layers 2] [--new-tokens 16] [--rounds 5]

`tiny` is the test fixture's shape (28-pixel images, width 32); `siglip` is Gemma 3's own tower at
896x896 (4096 patches of width 1152, 16 heads, MLP 4304, 256 soft tokens), `--tower-layers` of its 27
layers (each costs the same, so the ratio holds for the whole tower), in front of a 2-layer decoder of
width 1152. Both sides run float32 on the CPU, greedy: Dew one compiled prefill and a loop of its compiled
decode step, transformers its forward (eager attention) for the prefill and a loop of one-token
forwards through its own cache. The rounds
alternate between the two and the medians are printed with their ratio, the CPU and the load.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import machine

SIZES = {
    "tiny": dict(vision=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=28, patch_size=14),
                 text=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=256), tokens=4),
    "siglip": dict(vision=dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=896,
                               patch_size=14),
                   text=dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=144, vocab_size=4096), tokens=256),
}


def build(size: str, tower_layers: int, directory: Path) -> Path:
    """A random Gemma 3 checkpoint of `size`, saved by transformers into `directory`."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    shape = SIZES[size]
    text = dict(shape["text"], num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                sliding_window=512, max_position_embeddings=2048, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(shape["vision"], model_type="siglip_vision_model", num_hidden_layers=tower_layers,
                  vision_use_head=False)
    vocab = text["vocab_size"]
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=shape["tokens"],
                          boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(directory)
    return directory


def inputs_of(size: str, prompt: int = 32):
    """One row: `prompt` text tokens around one image's soft tokens, and its pixels in [-1, 1]."""
    shape = SIZES[size]
    vocab, tokens, side = shape["text"]["vocab_size"], shape["tokens"], shape["vision"]["image_size"]
    rng = np.random.default_rng(0)
    text = rng.integers(4, vocab - 3, prompt).tolist()
    ids = text[: prompt // 2] + [vocab - 3] + [vocab - 1] * tokens + [vocab - 2] + text[prompt // 2:]
    pixels = rng.uniform(-1, 1, (1, 3, side, side)).astype(np.float32)
    return np.asarray([ids], np.int32), pixels, vocab - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--tower-layers", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch
    from transformers import Gemma3ForConditionalGeneration

    from dew.data.inputs import ModelInputs
    from dew.interop import load_pretrained
    from dew.sampling import Sampling
    from dew.sampling.generate import decode_step, start

    with tempfile.TemporaryDirectory() as scratch:
        directory = build(args.size, args.tower_layers, Path(scratch))
        ids, pixels, image_token = inputs_of(args.size)
        bundle = load_pretrained(directory, dtype="float32", max_seq_len=2048)
        reference = Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    is_image = ids == image_token
    groups = np.where(is_image, 0, -1).astype(np.int32)
    indices = np.where(is_image, np.cumsum(is_image, axis=1) - 1, -1).astype(np.int32)
    inputs = ModelInputs.of(ids, image_indices=indices, image_groups=groups).replace(
        conditioning={"pixel_values": pixels[:, None]})
    model, params = bundle.model, bundle.variables
    capacity = ids.shape[1] + args.new_tokens
    media = {"image_indices": jnp.asarray(indices), "image_groups": jnp.asarray(groups),
             "pixel_values": jnp.asarray(pixels[:, None])}
    valid = jnp.ones(ids.shape, jnp.int32)
    prefill = jax.jit(lambda p, t, v, m: start(model, p, t, v, capacity, False, m))
    step = jax.jit(lambda p, cache, token: decode_step(model, p, token, jnp.ones((1,), bool), cache))

    def dew_prefill():
        return jax.block_until_ready(prefill(params, jnp.asarray(ids), valid, media))

    def dew_decode():
        state = dew_prefill()
        token, cache = jnp.argmax(state.logits_BV, -1).astype(jnp.int32), state.cache
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            logits, cache = step(params, cache, token)
            token = jnp.argmax(logits, -1).astype(jnp.int32)
        jax.block_until_ready(token)
        return time.perf_counter() - started

    torch_inputs = dict(input_ids=torch.tensor(ids, dtype=torch.long), pixel_values=torch.tensor(pixels),
                        token_type_ids=torch.tensor(is_image.astype(np.int64)))

    def their_prefill():
        with torch.no_grad():
            reference(**torch_inputs)

    def their_decode():
        """Greedy decoding through transformers' own cache, one forward a token, after a prefill."""
        with torch.no_grad():
            output = reference(**torch_inputs, use_cache=True)
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            cache = output.cache
            started = time.perf_counter()
            for _ in range(args.new_tokens):
                output = reference(input_ids=token, cache=cache, use_cache=True)
                token, cache = output.logits[:, -1].argmax(-1, keepdim=True), output.cache
            return time.perf_counter() - started

    # the same greedy tokens, or the two sides time different work
    ours = bundle.text_generation(sampling=Sampling(temperature=0))(inputs, 4).continuations()[0]
    with torch.no_grad():
        theirs = reference.generate(**torch_inputs, do_sample=False, max_new_tokens=4)[0, ids.shape[1]:].tolist()
    print(f"greedy tokens: dew {ours}, transformers {theirs[:len(ours)]}")
    dew_prefill(), their_prefill(), dew_decode(), their_decode()  # compile and warm up
    timings = {"dew prefill": [], "transformers prefill": [], "dew decode": [], "transformers decode": []}
    for _ in range(args.rounds):
        for name, run in (("dew prefill", dew_prefill), ("transformers prefill", their_prefill)):
            started = time.perf_counter()
            run()
            timings[name].append(time.perf_counter() - started)
        timings["dew decode"].append(dew_decode())
        timings["transformers decode"].append(their_decode())
    median = {name: statistics.median(values) for name, values in timings.items()}
    print(f"{machine()}; Gemma 3 {args.size}: tower {args.tower_layers} layers, {ids.shape[1]} prompt tokens "
          f"({SIZES[args.size]['tokens']} of them one image's), {args.new_tokens} new tokens, "
          f"medians of {args.rounds} alternating rounds")
    for kind, tokens in (("prefill", ids.shape[1]), ("decode", args.new_tokens)):
        dew, theirs = median[f"dew {kind}"], median[f"transformers {kind}"]
        print(f"  {kind:8s} dew {tokens / dew:10.1f} tokens/s   transformers {tokens / theirs:10.1f} tokens/s   "
              f"ratio {theirs / dew:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
