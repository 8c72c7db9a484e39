"""Decoding at long contexts: Dew against transformers (sdpa, KV cache on), batch 8, same weights.

    python -m benchmarks.long_context [--contexts 512 2048 8192] [--new 16] [--rounds 5] [--batch 8]
        [--llama-server PATH/llama-server [--llama-kv f32|f16] [--llama-wait passive|default]]
    python -m benchmarks.long_context --one-layer     (the attention kernel alone against XLA's form)
    python -m benchmarks.long_context --products [--rows 1 8 32] [--write-table]
                                      (a step's float32 products: XLA, oneDNN and Dew's few-rows kernel)

A randomly initialised Llama of SmolLM2-135M's shape (30 layers of 576, 9 query heads over 3 key/value
heads of 64, vocabulary 49,152) with `max_seq_len` raised to hold the longest context, float32, the
same weights on both sides. Each side's cache starts filled to the context with standard normal keys
and values (a prefill of 8 x 8,192 tokens would take minutes and is not what is measured), then decodes
`--new` greedy tokens a row: Dew through `dew.sampling.generate.advance` in one compiled scan (the
decode step `generate` and the serving engine run; its cache holds the context plus the new tokens,
as `generate` sizes it), transformers as a loop of forward calls on its `DynamicCache` with the argmax
fed back (what its `generate` does, without the logits processors). Rounds alternate the sides; each
round restarts from the context; the median round gives tokens/s. "Dew, XLA attention" is the same
step with decoding's attention kernel refused (`dew.kernels.decode_attention`), as before it existed,
and "in a capacity of" the shortest context in a cache of `--slot` slots (a serving slot's).

With `--llama-server`, llama.cpp's server is a third side: the same weights written as an F32 GGUF by Dew's
own writer (`dew.interop.gguf_out.write_gguf`), served with `--batch` parallel slots of context plus new
tokens each (`-np`, `-c` their sum), 2 threads waiting without spinning (`-t 2 -tb 2 --poll 0`,
OMP_WAIT_POLICY=PASSIVE; with `--llama-wait default`, OpenMP's and ggml's own wait: spinning briefly, its
fastest on a quiet machine), its keys and values in `--llama-kv` (float32 by default, as Dew and
transformers keep them; llama.cpp's own default is f16). Its cache is filled once per context by a prompt of `context`
random token ids in one slot, saved and restored into the others (a prefill of 8 x 8,192 tokens would take
many minutes); each round then sends that prompt to every slot at once through `/completion` (token ids,
greedy, `ignore_eos`, `n_predict` = `--new`), and the server reuses the slot's keys and values for all but
the prompt's last token. Its decode rate comes from each response's `timings`: llama.cpp starts a request's
generation clock once its first token is sampled (that token comes from the prompt's evaluation), so
`predicted_ms` spans `--new` - 1 decode steps (its `predicted_per_second` counts those too). The figure is
the tokens of those steps summed over the slots, over the longest slot's `predicted_ms` (the slots decode
in the same batches; prefill excluded); the sum of the slots' own `predicted_per_second` is printed beside
it, and the two agree when the slots' decoding overlaps.

`--products` times the float32 products of a decode step of that model (`[rows, 576] x [576, 576 | 192 |
1536]`, `[rows, 1536] x [1536, 576]`), each as 30 chained products of 30 different weights (a step's layers:
the weights come from memory, not the cache), in XLA, oneDNN and Dew's few-rows kernel, alternating, the
median of `--rounds` kept; `--write-table` records them in the kernel table (`dew/kernels/table.json`) for
this CPU's class, `"few_rows": true` where the kernel took at most `MARGIN` of XLA's time.

Also printed: the bytes a step must read (every weight once, each row's keys and values up to its
context) over the step's time, against the machine's copy bandwidth, so the fall of tokens/s with the
context can be set against the growth of the bytes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, machine
from benchmarks.generate import SHAPES, random_llama
from dew.kernels import decode_attention as decode_kernel
from dew.kernels import matmul
from dew.sampling import Sampling
from dew.nn.quantize import stacked_in_place
from dew.sampling.generate import DecodeState, advance
from dew.sampling.sampling import SamplingParams


# torch's OpenMP team spin-waits between operations by default; on a machine whose cores are shared
# (2 cores, other work running) a spinning thread descheduled mid-barrier stalls every step by seconds.
# Passive waiting is the setting a shared machine needs (Dew's products run on XLA's own threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def dew_decoder(model, steps: int, refuse: tuple[str, ...] = ()):
    """A compiled `steps` greedy decode steps from a `DecodeState` (donated), returning the state and the
    tokens; traced with decoding's attention kernel refused where `refuse` names "attention", and with the
    few-rows kernel refused (every float32 product XLA's) where it names "products"."""

    @functools.partial(jax.jit, donate_argnums=1)
    def run(params, state, keys_B, sampling):
        params = stacked_in_place(model, params)  # as generate and the serving engine hold them

        def step(state, t):
            state, (token_B, _, _) = advance(model, params, state, keys_B, t, sampling, (), 0)
            return state, token_B
        return jax.lax.scan(step, state, jnp.arange(steps))

    if not refuse:
        return run

    def refused(*args):
        with contextlib.ExitStack() as patches:
            if "attention" in refuse:
                patches.enter_context(mock.patch.object(decode_kernel, "usable", lambda *a, **k: False))
            if "products" in refuse:
                patches.enter_context(mock.patch.object(matmul, "choose_few_rows", lambda *a, **k: False))
            return run(*args)
    return refused


def dew_cache(model, batch: int, context: int, capacity: int, seed: int):
    """A cache of `capacity` slots a row, the first `context` filled with standard normal keys and values
    (one layer's draw, rescaled per layer), made where it lives (no host copy of gigabytes at 8,192)."""

    @jax.jit
    def make(key):
        cache = model.init_cache(batch, capacity)  # zeros XLA never materializes: every slot is drawn or zeroed
        filled = (jnp.arange(capacity) < context)[:, None]

        def draw(key, x_LBKTD):
            # one layer's draw, scaled a little differently in every layer: a fused broadcast, so making
            # the cache holds no second copy of it
            layer_BKTD = jax.random.normal(key, x_LBKTD.shape[1:], x_LBKTD.dtype)
            scales_L = 1.0 + 0.01 * jnp.arange(x_LBKTD.shape[0], dtype=x_LBKTD.dtype)
            return jnp.where(filled, layer_BKTD[None] * scales_L[:, None, None, None, None], 0)

        runs = tuple(run.replace(keys=draw(jax.random.fold_in(key, 2 * i), run.keys),
                                 values=draw(jax.random.fold_in(key, 2 * i + 1), run.values))
                     for i, run in enumerate(cache.runs))
        return cache.replace(runs=runs, lengths=jnp.full((batch,), context, jnp.int32))

    return make(jax.random.key(seed))


def torch_cache(config, batch: int, context: int, seed: int):
    """A transformers cache of `context` standard normal keys and values a row, `[B, K, context, D]` two a
    layer (other values than Dew's: no step's time depends on them)."""
    import torch
    from transformers import DynamicCache

    torch.manual_seed(seed)
    shape = (batch, config.num_kv_heads, context, config.head_dim)
    return DynamicCache([(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_layers)])


def llama_gguf(model, variables, directory: Path) -> Path:
    """The model's weights as an F32 GGUF in `directory`, by Dew's writer, with SmolLM2's tokenizer (from the
    float32 transformers export `benchmarks.serve` keeps; the ids sent are random, the vocabulary only has to
    fit)."""
    from benchmarks.serve import hf_directory
    from dew.interop.families import FAMILIES
    from dew.interop.gguf_out import write_gguf

    tokenizer = hf_directory(Path(tempfile.gettempdir()) / "dew-bench-smollm2-hf")
    return write_gguf(directory / "long-context.gguf", model, FAMILIES["llama"], variables, tokenizer, "f32")


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


@contextlib.contextmanager
def llama_server(path: str, gguf: Path, vocab: int, batch: int, context: int, new: int, kv: str, logs: Path,
                 wait: str = "passive"):
    """llama.cpp's server on `gguf` with `batch` slots of `context + new` positions, keys and values in `kv`,
    every slot's cache filled with the same `context` random ids below `vocab` (one prefill, saved and
    restored into the other slots), its threads waiting as `wait` says (`benchmarks.serve.llama_wait`);
    yields (its base URL, the prompt) and stops it on leaving."""
    from benchmarks.serve import Server, launch, llama_wait

    slot = context + new
    env, words = llama_wait(wait)
    poll = ("--poll", "0") if env else ()
    server = Server("llama-server", [
        path, "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}", "-np", str(batch), "-c", str(batch * slot),
        "-t", "2", "-tb", "2", *poll, "--cache-ram", "0", "-ctk", kv, "-ctv", kv,
        "--slot-save-path", str(logs)], f"-t 2 -tb 2{' --poll 0' if poll else ''}, {words}", env=env,
        unset=not env)
    log = logs / f"llama-server-{context}.log"
    process, url, _ = launch(server, log)
    try:
        prompt = np.random.default_rng(context).integers(0, vocab, context).tolist()
        first = _post(f"{url}/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "ignore_eos": True,
                                            "cache_prompt": True}, timeout=3600)
        filled = first["id_slot"]
        _post(f"{url}/slots/{filled}?action=save", {"filename": "filled.bin"}, timeout=600)
        for other in range(batch):
            if other != filled:
                _post(f"{url}/slots/{other}?action=restore", {"filename": "filled.bin"}, timeout=600)
        yield url, prompt
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def llama_round(url: str, prompt: list[int], batch: int, new: int) -> tuple[float, float, list[dict]]:
    """(decode tokens/s over the common decode time, the sum of the slots' own rates, every response's
    timings) of `batch` requests of `prompt` sent at once."""
    body = {"prompt": prompt, "n_predict": new, "temperature": 0.0, "ignore_eos": True, "cache_prompt": True}
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        answers = list(pool.map(lambda _: _post(f"{url}/completion", body, timeout=600), range(batch)))
    timings = [answer["timings"] for answer in answers]
    if any(t["predicted_n"] != new for t in timings):
        raise RuntimeError(f"llama-server decoded {[t['predicted_n'] for t in timings]} tokens, not {new} each")
    steps = sum(t["predicted_n"] - 1 for t in timings)
    return (steps / (max(t["predicted_ms"] for t in timings) / 1e3),
            sum(t["predicted_per_second"] for t in timings), timings)


MARGIN = 0.95  # the few-rows kernel is chosen where it takes at most this share of XLA's time


def products(rows_list, rounds: int, write: bool) -> None:
    """Time a decode step's float32 products (module docstring) and optionally record them in the table."""
    from dew.files import write_atomically
    from dew.kernels import matmul, policy

    layers, found = 30, {}
    matmul.status()  # registers oneDNN's handlers
    for rows in rows_list:
        for k, n in ((576, 576), (576, 192), (576, 1536), (1536, 576)):
            w = jax.random.normal(jax.random.key(1), (layers, k, n), jnp.float32)
            x = jax.random.normal(jax.random.key(2), (rows, k), jnp.float32)
            kinds = {"xla": lambda x, w: matmul.xla_product(x, w, False, False),
                     "onednn": lambda x, w: matmul.onednn_product(x, w, False, False),
                     "few_rows": matmul.few_rows_product}

            def chained(product, k=k, n=n):
                def step(x, w_KN):  # the next product's input depends on this one's output
                    y = product(x, w_KN)
                    return x + 1e-3 * jnp.tanh(y[:, :k] if n >= k else jnp.pad(y, ((0, 0), (0, k - n)))), None
                return jax.jit(lambda x, w: jax.lax.scan(step, x, w)[0])

            runs = {name: chained(product) for name, product in kinds.items()}
            times = {name: [] for name in runs}
            for round_ in range(rounds + 1):
                for name, run in runs.items():
                    started = time.perf_counter()
                    run(x, w).block_until_ready()
                    times[name].append(time.perf_counter() - started)
            median = {name: statistics.median(values[1:]) / layers for name, values in times.items()}
            key = policy.product_key(1, rows, k, n, jnp.float32, False, False, jnp.float32)
            found[key] = {"xla_s": round(median["xla"], 7), "onednn_s": round(median["onednn"], 7),
                          "onednn": False, "few_rows_s": round(median["few_rows"], 7),
                          "few_rows": median["few_rows"] <= MARGIN * median["xla"]}
            print(f"{key}: " + ", ".join(f"{name} {value * 1e6:,.0f} us ({w[0].nbytes / value / 1e9:.1f} GB/s)"
                                         for name, value in median.items())
                  + f"; few-rows / XLA {median['few_rows'] / median['xla']:.2f}; load average {load()}", flush=True)
    if write:
        table = json.loads(policy.TABLE.read_text())
        entry = table["classes"].setdefault(policy.cpu_class(), {"products": {}})
        for key, value in found.items():  # "onednn" false: these products are under MIN_FLOPS, XLA's or Dew's
            entry["products"][key] = {**entry["products"].get(key, {}), **value}
        entry["few_rows_measured"] = {"command": "python -m benchmarks.long_context --products --write-table",
                                      "cpu": machine(), "date": time.strftime("%Y-%m-%d"), "rounds": rounds,
                                      "load_average": load(), "margin": MARGIN}
        write_atomically(policy.TABLE, json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(found)} products in {policy.TABLE} for {policy.cpu_class()}")


def one_layer(contexts, batch: int, rounds: int = 7) -> None:
    """Time the kernel against XLA's form (`attend` under the decode mask, the layer sliced out of a
    two-layer cache as the decoder does) on one layer of SmolLM2's attention, every slot filled, and
    print each one's rate of reading the keys and values."""
    from dew.nn.attention import attend

    K, H, D = 3, 9, 64
    for context in contexts:
        keys = jax.random.normal(jax.random.key(0), (2, batch, K, context, D), jnp.float32)
        values = jax.random.normal(jax.random.key(1), keys.shape, jnp.float32)
        q = jax.random.normal(jax.random.key(2), (batch, H, D), jnp.float32)
        starts, ends = jnp.zeros((batch,), jnp.int32), jnp.full((batch,), context, jnp.int32)
        mask = jnp.ones((batch, 1, context), bool)
        forms = {"kernel": jax.jit(lambda q, k, v, layer: decode_kernel.decode_attention(q, k, v, layer, starts, ends,
                                                                                         D**-0.5)),
                 "XLA": jax.jit(lambda q, k, v, layer: attend(q[:, None], k[layer], v[layer], mask)[:, 0])}
        line = []
        for name, form in forms.items():
            form(q, keys, values, jnp.int32(1)).block_until_ready()
            times = []
            for _ in range(rounds):
                started = time.perf_counter()
                form(q, keys, values, jnp.int32(1)).block_until_ready()
                times.append(time.perf_counter() - started)
            median = statistics.median(times)
            line.append(f"{name} {median * 1e3:.2f} ms ({2 * keys[1].nbytes / median / 1e9:.1f} GB/s)")
        print(f"one layer, batch {batch}, {context:,} slots: {', '.join(line)}; load average {load()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--new", type=int, default=16, help="tokens decoded a row per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--slot", type=int, default=2048,
                        help="also the shortest context in a cache of this many slots (a serving slot's capacity)")
    parser.add_argument("--xla-up-to", type=int, default=2048,
                        help="time Dew with XLA's attention only where the cache holds at most this many slots "
                             "plus the new tokens (it scores every slot: minutes a round at 8,192)")
    parser.add_argument("--xla-products", action="store_true",
                        help="also time Dew with every float32 product XLA's (the few-rows kernel refused)")
    parser.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary: adds it as a side")
    parser.add_argument("--llama-wait", choices=["passive", "default"], default="passive",
                        help="llama-server's threads: OMP_WAIT_POLICY=PASSIVE with --poll 0, or OpenMP's and ggml's own "
                             "wait (spin, then sleep), its fastest on a quiet machine")
    parser.add_argument("--llama-kv", choices=["f32", "f16"], default="f32",
                        help="llama-server's key and value type (-ctk/-ctv; its own default is f16)")
    parser.add_argument("--products", action="store_true",
                        help="only time a decode step's float32 products in XLA, oneDNN and Dew's few-rows kernel")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="rows of the products (--products)")
    parser.add_argument("--write-table", action="store_true",
                        help="record the products' times and choices in the kernel table (--products)")
    parser.add_argument("--one-layer", action="store_true",
                        help="only time the kernel against XLA's form on one layer's cache at each context")
    args = parser.parse_args()
    if args.products:
        print(f"machine: {machine()}; load average {load()}")
        return products(args.rows, args.rounds, args.write_table)
    if args.one_layer:
        print(f"machine: {machine()}; load average {load()}")
        return one_layer(args.contexts, args.batch)
    import torch

    longest = max(args.contexts)
    shape = dict(SHAPES["smollm2"], max_seq_len=longest + args.new)
    model, variables, torch_model, _ = random_llama(shape)
    c = model.config
    params = jax.jit(model.stack_variables)(variables)
    scratch = tempfile.TemporaryDirectory(prefix="dew-long-context-")
    gguf = llama_gguf(model, variables, Path(scratch.name)) if args.llama_server else None
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(variables))
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}, torch {torch.__version__} with {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ['OMP_WAIT_POLICY']}; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; load average {load()}")
    print(f"model: random Llama of SmolLM2-135M's shape, max_seq_len {c.max_seq_len}; batch {args.batch}, {args.new} "
          f"new tokens a round, {args.rounds} rounds; decode attention kernel: {decode_kernel.status()[1]}; few-rows "
          f"kernel: {matmul.few_rows_status()[1]}")
    B = args.batch
    sampling = SamplingParams.of([Sampling(temperature=0.0)] * B)
    keys_B = jax.random.split(jax.random.key(0), B)
    ours, before = dew_decoder(model, args.new), dew_decoder(model, args.new, ("attention",))
    xla_products = dew_decoder(model, args.new, ("products",))
    cases = [(context, context + args.new) for context in args.contexts]
    if min(args.contexts) < args.slot:
        cases.append((min(args.contexts), args.slot + args.new))
    for context, capacity in cases:
        with_torch = capacity == context + args.new
        with contextlib.ExitStack() as stack:
            llama = None
            if gguf is not None and with_torch:
                llama = stack.enter_context(llama_server(args.llama_server, gguf, c.vocab_size, B, context, args.new,
                                                         args.llama_kv, Path(scratch.name), args.llama_wait))
            run_case(args, model, params, torch_model, context, capacity, with_torch, llama, weight_bytes, bandwidth,
                     sides={"dew": ours, **({"dew, XLA attention": before}
                                            if capacity <= args.xla_up_to + args.new else {}),
                            **({"dew, XLA products": xla_products} if args.xla_products else {})},
                     sampling=sampling, keys_B=keys_B)


def run_case(args, model, params, torch_model, context, capacity, with_torch, llama, weight_bytes, bandwidth, sides,
             sampling, keys_B):
    """Alternating rounds of every side at one context, printed as one line."""
    import torch

    c, B = model.config, args.batch
    first = torch.zeros((B, 1), dtype=torch.long)

    def torch_round():
        cache = torch_cache(c, B, context, seed=context)
        started = time.perf_counter()
        token = first
        with torch.no_grad():
            for _ in range(args.new):
                logits = torch_model(input_ids=token, cache=cache, use_cache=True).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - started

    def dew_round(run):
        state = DecodeState(dew_cache(model, B, context, capacity, seed=context),
                            jnp.zeros((B, c.vocab_size), jnp.float32), jnp.zeros((B,), bool),
                            jnp.zeros((B,), jnp.int32), None)
        jax.block_until_ready(state)
        started = time.perf_counter()
        _, tokens = run(params, state, keys_B, sampling)  # the state is donated
        jax.block_until_ready(tokens)
        return time.perf_counter() - started

    # Every round makes its caches afresh, one side's at a time (at 8,192 each holds 2.9 GiB), and
    # restarts from the context; the first round compiles and is not counted.
    seconds = {name: [] for name in (*(["transformers"] if with_torch else []), *sides)}
    llama_rates, llama_own = [], []
    for round_ in range(args.rounds + 1):
        if with_torch:  # torch first: XLA's worker threads linger briefly after a call
            seconds["transformers"].append(torch_round())
        if llama is not None:
            rate, own, _ = llama_round(*llama, B, args.new)
            llama_rates.append(rate)
            llama_own.append(own)
        for name, run in sides.items():
            seconds[name].append(dew_round(run))
    seconds = {name: times[1:] for name, times in seconds.items()}
    # A step reads every weight once and each row's keys and values up to its context (the mean over
    # the round); XLA's attention reads the whole capacity.
    cache_bytes = 2 * c.num_layers * B * c.num_kv_heads * c.head_dim * 4 * (context + args.new / 2)
    rates = {name: B * args.new / statistics.median(times) for name, times in seconds.items()}
    if llama is not None:
        rates["llama-server"] = statistics.median(llama_rates[1:])
    where = f"context {context:,}" + ("" if with_torch else f" in a capacity of {capacity:,}")
    parts = [f"{name} {rate:,.1f} tokens/s" for name, rate in rates.items()]
    read = rates["dew"] / B * (weight_bytes + cache_bytes)
    ratio = f"; dew / transformers {rates['dew'] / rates['transformers']:.2f}x" if with_torch else ""
    if llama is not None:
        ratio += (f"; dew / llama-server {rates['dew'] / rates['llama-server']:.2f}x (llama-server's own rates summed "
                  f"{statistics.median(llama_own[1:]):,.1f}, KV {args.llama_kv})")
    gain = "".join(f"; dew / {name[5:]} {rates['dew'] / rates[name]:.2f}x"
                   for name in ("dew, XLA attention", "dew, XLA products") if name in rates)
    print(f"{where}: {', '.join(parts)}{ratio}{gain};"
          f" dew reads {(weight_bytes + cache_bytes) / 2**20:,.0f} MiB a step at {read / 1e9:.1f} GB/s "
          f"({read / bandwidth:.0%} of copy); load average {load()}; peak resident "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")


if __name__ == "__main__":
    main()
