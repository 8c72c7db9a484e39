"""Training on an accelerator: Dew's train step against a plain JAX Llama of ours, same shape, batch and AdamW.

    python -m benchmarks.accelerator [--shapes gpt2,medium,long,1b] [--steps 10] [--head] [--reference-remat ...]

For each shape, both sides train with bfloat16 compute, AdamW and no moving average, on whatever backend jax
finds; printed per side: the remat it ran (Dew's: what `remat="auto"` chose; the reference's: the first of
`--reference-remat` that compiled), the first step's compile seconds, the median step, tokens/s, MFU (the
model's FLOPs counted PaLM's way, `dew.training.utilization.flops_per_position`, over the device's peak,
`peak_flops`) and the step's memory by XLA's analysis; then Dew's speed over the reference's.

The reference is the shortest honest JAX Llama step: stacked layers under one `lax.scan`, `jax.checkpoint`
with a policy, attention in Pallas's splash kernel on a TPU (`jax.nn.dot_product_attention` elsewhere; causal,
512 tiles, queries scaled first), float32 logits for the loss. Dew's side scores without its token accuracy
(`token_accuracy=False`), as the reference does.

`--head` times the seed's head claims on this device: the chunked loss's forward and backward with bfloat16
operands against float32 ones, and with the token accuracy against without it.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import machine, timed
from dew import Trainer, models
from dew.nn.head import chunked_cross_entropy
from dew.objectives.lm import LMObjective
from dew.training import memory
from dew.training.mesh import place_batch
from dew.training.utilization import flops_per_position, peak_flops

SHAPES = {
    "gpt2": dict(layers=12, width=768, heads=12, kv_heads=12, mlp=2048, vocab=50304, seq=1024, batch=32),
    "medium": dict(layers=24, width=1024, heads=16, kv_heads=8, mlp=2816, vocab=32000, seq=2048, batch=8),
    "long": dict(layers=12, width=768, heads=12, kv_heads=12, mlp=2048, vocab=50304, seq=8192, batch=2),
    # About a billion parameters: kept in bfloat16, AdamW's first moment too, so that it fits one 16 GB chip.
    "1b": dict(layers=18, width=2048, heads=16, kv_heads=8, mlp=5632, vocab=32000, seq=2048, batch=8,
               param_dtype="bfloat16"),
}
REFERENCE_POLICIES = {"none": None, "dots": jax.checkpoint_policies.checkpoint_dots,
                      "full": jax.checkpoint_policies.nothing_saveable}


def optimizer(shape: dict):
    mu = jnp.bfloat16 if shape.get("param_dtype") == "bfloat16" else None
    return optax.adamw(1e-4, weight_decay=0.1, mu_dtype=mu)


def dew_model(shape: dict):
    return models.build("causal_transformer", vocab_size=shape["vocab"], emb_features=shape["width"],
                        num_layers=shape["layers"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                        mlp_features=shape["mlp"], max_seq_len=shape["seq"], dtype=jnp.bfloat16,
                        param_dtype=shape.get("param_dtype", "float32"), scan_layers=1)


def dew_side(shape: dict, rows: np.ndarray):
    """(run one step to completion, compile seconds, the memory plan's line, the step's bytes)."""
    model = dew_model(shape)
    objective = LMObjective(model, shape["seq"], ema_decay=None, token_accuracy=False)
    trainer = Trainer(objective, optimizer(shape), key=jax.random.key(0))
    state = trainer.init_state()
    placed = place_batch(trainer.mesh, {"text": rows})
    started = time.perf_counter()
    step = trainer.compile_step(state, placed)
    compile_seconds = time.perf_counter() - started
    holder = {"state": state}

    def run():
        holder["state"], out = step(holder["state"], placed)
        jax.block_until_ready(out)

    plan = trainer.memory_plan
    return run, compile_seconds, plan.remat if plan else model.config.remat, memory.compiled_bytes(step)


# -- the plain reference -------------------------------------------------------------------------------------

def reference_params(shape: dict, key) -> dict:
    """A Llama's weights as one dict, the layers stacked on a leading axis (normal(0.02), norms at 1)."""
    L, E, H, K, F, V = (shape[k] for k in ("layers", "width", "heads", "kv_heads", "mlp", "vocab"))
    D = E // H
    dtype = jnp.dtype(shape.get("param_dtype", "float32"))
    sizes = {"embed": (V, E), "wq": (L, E, H * D), "wk": (L, E, K * D), "wv": (L, E, K * D), "wo": (L, H * D, E),
             "gate": (L, E, F), "up": (L, E, F), "down": (L, F, E), "head": (E, V)}
    keys = jax.random.split(key, len(sizes))
    params = {name: (0.02 * jax.random.normal(k, size)).astype(dtype) for k, (name, size) in zip(keys, sizes.items())}
    params.update(attn_norm=jnp.ones((L, E), dtype), mlp_norm=jnp.ones((L, E), dtype), norm=jnp.ones((E,), dtype))
    return params


def dew_variables(params: dict) -> dict:
    """The reference's weights in the tree Dew's decoder of the same shape keeps (one scanned run)."""
    L = params["wq"].shape[0]
    attention = {name: {"kernel": params[key]} for name, key in
                 (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo"))}
    mlp = {f"{name}_proj": {"kernel": params[name]} for name in ("gate", "up", "down")}
    layers = {"input_layernorm": {"scale": params["attn_norm"]}, "post_attention_layernorm": {"scale": params["mlp_norm"]},
              "self_attn": attention, "mlp": mlp}
    return {"params": {"embed_tokens": {"embedding": params["embed"]}, f"layers_0to{L - 1}": layers,
                       "norm": {"scale": params["norm"]}, "lm_head": {"kernel": params["head"]}}}


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x_BSHD, cos_SD, sin_SD):
    half = x_BSHD.shape[-1] // 2
    x32 = x_BSHD.astype(jnp.float32)
    turned = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
    return (x32 * cos_SD[:, None] + turned * sin_SD[:, None]).astype(x_BSHD.dtype)


def _attention(q_BSHD, k_BSKD, v_BSKD, splash: bool):
    """Causal attention: splash over `[H, S, D]` per row (queries scaled first), or jax.nn's."""
    B, S, H, D = q_BSHD.shape
    if not splash:
        return jax.nn.dot_product_attention(q_BSHD, k_BSKD, v_BSKD, is_causal=True)
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    block = min(512, S)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([sa.CausalMask((S, S))]), head_shards=1, q_seq_shards=1,
                                block_sizes=sizes)
    q = (q_BSHD * jnp.asarray(D**-0.5, q_BSHD.dtype)).transpose(0, 2, 1, 3)
    out = jax.vmap(kernel)(q, k_BSKD.transpose(0, 2, 1, 3), v_BSKD.transpose(0, 2, 1, 3))
    return out.transpose(0, 2, 1, 3)


def reference_loss(params: dict, tokens_BT, shape: dict, policy, splash: bool, dtype=jnp.bfloat16):
    """Mean next-token cross entropy of the plain Llama over `[B, S + 1]` tokens, float32 logits."""
    H, K = shape["heads"], shape["kv_heads"]
    inputs, targets = tokens_BT[:, :-1], tokens_BT[:, 1:]
    B, S = inputs.shape
    E = params["embed"].shape[1]
    D = E // H
    frequencies = 10000.0 ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angles = jnp.arange(S, dtype=jnp.float32)[:, None] * frequencies[None, :]
    cos, sin = jnp.tile(jnp.cos(angles), (1, 2)), jnp.tile(jnp.sin(angles), (1, 2))

    def layer(x, p):
        h = _rms(x, p["attn_norm"])
        q = _rope((h @ p["wq"].astype(dtype)).reshape(B, S, H, D), cos, sin)
        k = _rope((h @ p["wk"].astype(dtype)).reshape(B, S, K, D), cos, sin)
        v = (h @ p["wv"].astype(dtype)).reshape(B, S, K, D)
        if not splash and K != H:
            k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
        x = x + _attention(q, k, v, splash).reshape(B, S, H * D) @ p["wo"].astype(dtype)
        h = _rms(x, p["mlp_norm"])
        gate = jax.nn.silu((h @ p["gate"].astype(dtype)).astype(jnp.float32)).astype(dtype)
        return x + (gate * (h @ p["up"].astype(dtype))) @ p["down"].astype(dtype), None

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    layers = {name: params[name] for name in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "gate", "up", "down")}
    x, _ = jax.lax.scan(layer, params["embed"][inputs].astype(dtype), layers)
    logits = (_rms(x, params["norm"]) @ params["head"].astype(dtype)).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def reference_side(shape: dict, rows: np.ndarray, remats: tuple[str, ...]):
    """(run one step, compile seconds of the remat that compiled, that remat, the step's bytes)."""
    params = reference_params(shape, jax.random.key(0))
    tx = optimizer(shape)
    state = (params, tx.init(params))
    tokens = jnp.asarray(rows)
    splash = jax.default_backend() == "tpu"
    for remat in remats:

        def step(state, tokens, policy=REFERENCE_POLICIES[remat]):
            params, opt = state
            loss, grads = jax.value_and_grad(reference_loss)(params, tokens, shape, policy, splash)
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), loss

        started = time.perf_counter()
        try:
            compiled = jax.jit(step, donate_argnums=0).lower(state, tokens).compile()
        except jax.errors.JaxRuntimeError as error:
            if not memory.out_of_memory(error):
                raise
            print(f"  reference remat {remat!r} does not fit ({time.perf_counter() - started:.1f} s to learn it)")
            continue
        compile_seconds = time.perf_counter() - started
        holder = {"state": state}

        def run():
            holder["state"], loss = compiled(holder["state"], tokens)
            jax.block_until_ready(loss)

        return run, compile_seconds, remat, memory.compiled_bytes(compiled)
    raise SystemExit(f"the reference fits under none of {remats}")


# -- the head's claims -----------------------------------------------------------------------------------------

def head_times(rows: int, width: int, vocab: int, steps: int) -> dict[str, float]:
    """Seconds of the chunked loss's forward and backward over `[rows, width]` states and a `[width, vocab]` head:
    bfloat16 operands with the accuracy, float32 ones with it, bfloat16 without it."""
    key = jax.random.key(1)
    hidden = jax.random.normal(key, (rows, width), jnp.float32)
    weight = 0.02 * jax.random.normal(jax.random.fold_in(key, 1), (width, vocab), jnp.float32)
    targets = jax.random.randint(jax.random.fold_in(key, 2), (rows,), 0, vocab)
    times = {}
    for name, dtype, accuracy in (("bfloat16", jnp.bfloat16, True), ("float32", jnp.float32, True),
                                  ("bfloat16, no accuracy", jnp.bfloat16, False)):
        def loss(h, w, dtype=dtype, accuracy=accuracy):
            ce, _, correct = chunked_cross_entropy(h.astype(dtype), w.astype(dtype), targets, False, None, None,
                                                   accuracy)
            return jnp.sum(ce) + (0.0 if correct is None else jax.lax.stop_gradient(jnp.sum(correct)))

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        times[name] = timed(lambda: jax.block_until_ready(grad(hidden, weight)), steps)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="gpt2,medium,long,1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sides", default="dew,reference")
    parser.add_argument("--reference-remat", default="dots,full",
                        help="the reference's remat policies, tried in order until one compiles (none, dots, full)")
    parser.add_argument("--head", action="store_true", help="time the seed's head claims too")
    args = parser.parse_args(argv)
    print(machine())
    device = jax.local_devices()[0]
    limit = memory.device_memory()
    print(f"device {device.device_kind!r}: memory {limit[0] / 2**30:.2f} GiB" if limit else f"device {device.device_kind!r}")
    for dtype in (jnp.bfloat16, jnp.float32):  # what the table's peaks are checked against
        size = 8192 if jax.default_backend() != "cpu" else 1024
        a = jax.random.normal(jax.random.key(0), (size, size), dtype)
        product = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
        rate = 2 * size**3 / timed(lambda: jax.block_until_ready(product(a)), 5)
        print(f"  a {size}-square {jnp.dtype(dtype).name} product: {rate / 1e12:.1f} TFLOP/s "
              f"(peak_flops {peak_flops(dtype) / 1e12:.1f})")
    sides = args.sides.split(",")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        rows = np.random.default_rng(0).integers(0, shape["vocab"], (shape["batch"], shape["seq"] + 1)).astype(np.int32)
        tokens = shape["batch"] * shape["seq"]
        flops = flops_per_position(dew_model(shape), shape["seq"]) * tokens
        peak = peak_flops(jnp.bfloat16)
        print(f"{name}: {shape}, {flops / tokens / 6 / 1e6:.0f}M multiplied weights, peak {peak / 1e12:.0f} TFLOP/s")
        seconds = {}
        for side in sides:
            make = dew_side if side == "dew" else functools.partial(reference_side,
                                                                   remats=tuple(args.reference_remat.split(",")))
            run, compile_seconds, remat, size = make(shape, rows)
            seconds[side] = timed(run, args.steps)
            print(f"  {side:9s} remat {remat:12s} compile {compile_seconds:6.1f} s  step {seconds[side] * 1e3:8.1f} ms  "
                  f"{tokens / seconds[side]:9.0f} tokens/s  MFU {flops / seconds[side] / peak:6.1%}  "
                  f"memory {size / 2**30:5.2f} GiB", flush=True)
            del run
        if len(seconds) == 2:
            print(f"  dew / reference speed: {seconds['reference'] / seconds['dew']:.2f}x")
    if args.head:
        shape = SHAPES["gpt2"]
        times = head_times(shape["batch"] * shape["seq"], shape["width"], shape["vocab"], args.steps)
        base = times["bfloat16"]
        print("head (chunked loss, forward and backward, 32 x 1024 rows, 768 x 50,304):")
        for name, value in times.items():
            print(f"  {name:24s} {value * 1e3:8.2f} ms  ({value / base:.2f}x bfloat16's)")


if __name__ == "__main__":
    main()
