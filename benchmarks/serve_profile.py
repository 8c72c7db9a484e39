"""Where a `dew serve` step's time goes, in process (no HTTP): each compiled step over 1, 2, 4 ...
rows of the engine's slots, each admission (rows, prompt width), and a whole in-process run of
`--requests` prompts with `--streams` in flight through `Engine` (the host loop, without the server).

    PYTHONPATH=. python -m benchmarks.serve_profile [--slots 8] [--capacity 1024] [--quantize int8]
        [--programs [--admissions]] [--requests 32] [--streams 8 32] [--longest 200] [--prefill-chunk 256]

A prompt longer than the engine's chunk prefills its head, then one chunk between two steps: its
chunks count as admitting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import smollm2_directory
from benchmarks.serve_streams import prompts as passage_prompts

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed(call, repeats: int) -> float:
    """Median seconds of `repeats` calls of `call` (each returns arrays to wait on)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class Counter:
    def __init__(self, done):
        self.tokens, self.first, self.done, self.sent = 0, None, done, time.perf_counter()

    def token(self, token_id):
        if self.first is None:
            self.first = time.perf_counter() - self.sent
        self.tokens += 1
        return False

    def finish(self, reason, completion_tokens):
        self.done.release()

    def scores(self, entries):
        pass


def main():
    from dew.runs import pipeline
    from dew.sampling.sampling import Sampling
    from dew.serve.engine import Engine, Request

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--dtype", default="float32", help="the weights' and products' dtype (bfloat16: dew serve --dtype)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="*", default=[8])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--longest", type=int, default=200, help="the longest prompt, in tokens (from 20)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="the engine's prefill_chunk")
    parser.add_argument("--programs", action="store_true", help="time each step program alone")
    parser.add_argument("--admissions", action="store_true", help="and each admission program")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    started = time.perf_counter()
    task = pipeline(str(Path(smollm2_directory()) / GGUF), quantize=args.quantize,
                    dtype=args.dtype)
    print(f"loaded in {time.perf_counter() - started:.1f} s")
    chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    engine = Engine(task.model, task.params, slots=args.slots, capacity=args.capacity,
                    eos_token_ids=task.sampling.eos_token_ids, pad_id=task.sampling.pad_id, **chunk)
    prompts = passage_prompts(max(args.requests, 1), longest=args.longest)
    if args.programs:
        for key in [("step", rows) for rows in engine.step_rows] + [("admit", 1, 128)]:
            engine._compile(key)
        if args.admissions:
            engine.warm_up()
        engine._state = engine._state_made.result()  # the slots' state, made on the engine's own thread
        # fill every slot with a prompt of 128 tokens and a budget that never ends it
        from dew.serve.engine import Request as R
        requests = [R(prompts[0][:20] * 6, 500, Sampling(), 0, None) for _ in range(engine.slots)]
        admission = engine._admission(requests[:1], 128, np.zeros(1, np.int32))
        for slot in range(engine.slots):
            admission = engine._admission(requests[:1], 128, np.array([slot], np.int32))
            engine._state = engine._programs["admit", 1, 128](engine.params, engine._state, *admission.arguments())
        release = np.zeros(engine.slots, bool)
        for rows in engine.step_rows:
            def step():
                engine._state, out = engine._programs["step", rows](engine.params, engine._state, release)
                return out.tokens_B
            seconds = timed(step, args.repeats)
            print(f"step over {rows:3d} rows: {seconds * 1e3:7.1f} ms ({rows / seconds:6.1f} tokens/s)")
        for rows in engine.prefill_rows if args.admissions else ():
            for width in [w for w in engine.widths if ("admit", rows, w) in engine._programs]:
                slots = np.arange(rows, dtype=np.int32)
                admission = engine._admission(requests[:rows], width, slots) if width >= 120 else \
                    engine._admission([R(prompts[0][:width], 8, Sampling(), 0, None)] * rows, width, slots)

                def admit():
                    engine._state = engine._programs["admit", rows, width](engine.params, engine._state,
                                                                            *admission.arguments())
                    return engine._state.budget_B
                seconds = timed(admit, max(2, args.repeats // 2))
                print(f"admit {rows} rows at width {width:5d}: {seconds * 1e3:8.1f} ms")
        if args.admissions and ("extend", engine.chunk) in engine._programs:
            piece = (prompts[0] * engine.chunk)[: engine.chunk]
            tokens, valid = np.asarray([piece], np.int32), np.ones((1, engine.chunk), np.int32)

            def extend():  # a chunk after slot 0's 128 tokens (two calls: at most 640 positions)
                engine._state = engine._programs["extend", engine.chunk](
                    engine.params, engine._state, tokens, valid, np.zeros(1, np.int32), np.zeros(1, bool))
                return engine._state.budget_B
            print(f"chunk of {engine.chunk} after 128 or more positions: {timed(extend, 2) * 1e3:8.1f} ms")
        engine = Engine(task.model, task.params, slots=args.slots, capacity=args.capacity,
                        eos_token_ids=task.sampling.eos_token_ids, pad_id=task.sampling.pad_id, **chunk)
    if not args.streams:
        return
    started = time.perf_counter()
    engine.warm_up()
    print(f"compiled {len(engine._programs)} programs in {time.perf_counter() - started:.1f} s")
    spent = {"admitting": 0.0, "waiting on steps": 0.0}

    def timed_method(name, method, wait):
        def run(*args):
            if wait:  # the step dispatched before is the steps' time, not this
                started = time.perf_counter()
                jax.block_until_ready(engine._state.budget_B)
                spent["waiting on steps"] += time.perf_counter() - started
            started = time.perf_counter()
            result = method(*args)
            if wait:
                jax.block_until_ready(engine._state.budget_B)
            spent[name] += time.perf_counter() - started
            return result
        return run

    # the admissions, waited on, and the reading of each step's tokens (the device's time the host waits)
    engine._place = timed_method("admitting", engine._place, True)
    engine._go_on = timed_method("admitting", engine._go_on, True)
    engine._hand_out = timed_method("waiting on steps", engine._hand_out, False)
    engine.start()
    engine.ready.wait()
    for streams in args.streams:
        done = threading.Semaphore(0)
        gate = threading.Semaphore(streams)
        counters = []
        steps = engine.steps
        started = time.perf_counter()

        def feed():
            for index, prompt in enumerate(prompts):
                gate.acquire()
                counter = Counter(done)
                counters.append(counter)
                engine.submit([Request(prompt, args.new, Sampling(), index, counter)])

        def release():
            for _ in prompts:
                done.acquire()
                gate.release()

        threads = [threading.Thread(target=feed), threading.Thread(target=release)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        tokens = sum(c.tokens for c in counters)
        print(", ".join(f"{name} {value:.1f} s" for name, value in spent.items()))
        spent.update({name: 0.0 for name in spent})
        print(f"{streams} streams: {tokens / seconds:.1f} tokens/s, median TTFT "
              f"{statistics.median(c.first for c in counters if c.first is not None):.2f} s, {engine.steps - steps} steps, "
              f"{tokens} tokens in {seconds:.1f} s; load average {os.getloadavg()[0]:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
