"""Qwen 3.5's vision tower and patch merger, Dew against transformers on the same random weights and images:
images encoded a second.

    python -m benchmarks.qwen35_tower [--side 448] [--images 2] [--layers 1] [--rounds 5]

Qwen 3.5's released tower shape (width 1152, 16 heads, MLP 4304, 16-pixel patches of two frames, 2 x 2
merged into a token of width 3584, 48 x 48 learned positions) with `--layers` of its 27 blocks (each costs
the same, so the ratio holds for the whole tower), over `--images` square images of `--side` pixels
(448: 28 x 28 = 784 patches, 196 tokens each). Both sides run float32 on the CPU: Dew one compiled call
over the images padded to one patch count, transformers its forward over the packed patches (eager
attention, one image at a time). The rounds alternate between the two; the medians are printed with their
ratio and the largest difference of the soft tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.common import machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch
    import transformers
    from flax import linen as nn
    from flax import traverse_util

    from dew.interop import tensors
    from dew.interop.vision import projector_rules, tower_rules
    from dew.nn.vision import Qwen35MergerConfig, Qwen35VisionConfig

    reference_config = transformers.Qwen3_5VisionConfig(depth=args.layers, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.Qwen3_5VisionModel(reference_config).eval()
    record = reference_config.to_dict()
    config = Qwen35VisionConfig.from_hf(record, "vision_config")
    merger = Qwen35MergerConfig(config.hidden_size, config.out_hidden_size, config.spatial_merge_size)
    state = {name: value.numpy() for name, value in reference.state_dict().items()}

    def read(rules, module, *example):
        shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *example)["params"])
        plan = tensors.plan(rules, shapes)

        class Reader:  # transformers' state dict, read the way the checkpoint readers are
            location = {name: "state dict" for name in state}

            def read(self, name, index=()):
                return np.array(state[name][index])

        return traverse_util.unflatten_dict({leaf.path: tensors.read_region(Reader(), leaf, None, np.float32)
                                             for leaf in plan.leaves})

    grid = args.side // config.patch_size
    patches = grid * grid
    tower, merge = config.build(), merger.build()
    pixels = np.random.default_rng(0).uniform(-2, 2, (args.images, patches, config.patch_features)).astype(np.float32)
    grids = np.tile(np.asarray([[1, grid, grid]], np.int32), (args.images, 1))
    tower_params = read(tower_rules("qwen3_5", config, ""), tower, pixels, grids)
    merger_params = read(projector_rules("qwen3_5", merger, "merger."), merge,
                         jax.ShapeDtypeStruct((1, patches, config.hidden_size), np.float32))
    encode = jax.jit(lambda p, m, x, g: merge.apply({"params": m}, tower.apply({"params": p}, x, g)))

    def ours():
        return np.asarray(jax.block_until_ready(encode(tower_params, merger_params, pixels, grids)))

    packed, packed_grids = torch.from_numpy(pixels.reshape(-1, config.patch_features)), torch.from_numpy(grids)

    def theirs():
        with torch.no_grad():
            return reference(packed, grid_thw=packed_grids).pooler_output.numpy()

    difference = np.abs(ours().reshape(-1, config.out_hidden_size) - theirs()).max()
    timings = {"dew": [], "transformers": []}
    for _ in range(args.rounds):
        for name, run in (("dew", ours), ("transformers", theirs)):
            started = time.perf_counter()
            run()
            timings[name].append(time.perf_counter() - started)
    dew, them = (statistics.median(timings[name]) for name in ("dew", "transformers"))
    print(f"{machine()}; Qwen 3.5 tower, {args.layers} of 27 blocks, {args.images} images of {args.side}x{args.side} "
          f"({patches} patches each), medians of {args.rounds} alternating rounds; largest difference of the soft "
          f"tokens {difference:.2e}")
    print(f"  dew {args.images / dew:8.2f} images/s   transformers {args.images / them:8.2f} images/s   "
          f"ratio {them / dew:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
