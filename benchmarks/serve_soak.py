"""Soak: `dew serve` under 2,000 mixed requests on a tiny model: every good request answered, every bad
one refused, /health answered throughout, and the server's resident memory flat.

    python -m benchmarks.serve_soak [--requests 2000] [--concurrency 16] [--seed 0] [--no-cache-cases]

A random 2-layer Llama of width 64 with GPT-2's 50,257-id tokenizer (`make gpt2-tokenizer` writes it)
is saved as a transformers checkpoint and served by a real `dew serve` process (8 slots of 128
positions, a ChatML template file, the default limits), driven over loopback by `--concurrency`
clients, each request on a connection of its own. The requests come in a fixed order drawn with
`--seed` from a mix: completions and chats, whole and streamed, some chats spelling ChatML's markers
(good requests); streams the client closes after their first chunk (cancelled); and bad requests,
each of which must be refused with its status: a seed past 64 bits, a lone surrogate, JSON nested
100,000 deep, n past what the slots and queue hold, invalid JSON, a negative temperature, token ids
past the context, half a body limit of text (tokenized, then refused as past the context), and a
body past the limit (413). A thread asks /health every 0.2 s throughout.

The server's resident memory (VmRSS) is read after every 100 requests (printed in MiB). The run fails
(exit status 1) when a good request is not answered (200, a finish reason; a cancelled one: its first
chunk), a bad one is not refused with its status, /health fails once, or the memory after
the last request is more than 10% above that after the first 100.

Before the soak, the compilation cache's cases (`CACHE_CASES`), each a server of its own that must answer
100 requests of the same mix, or refuse to start as documented: a `--compilation-cache` whose kept programs
and kept traces (its own model's and another's) were swapped in pairs (each under another's name: compiled or
traced again, never used), one that is a file (refused, exit status 2, naming it), one whose `dew-programs`
and `dew-kept` are files, and a default cache (`$XDG_CACHE_HOME/dew/jax`) that is a file (each served without
it, with one warning naming it).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import cpu_model
from benchmarks.serve import free_port

TIMEOUT = 120  # seconds for any one request
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs in the "
         "evening light and the river runs on").split()
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclasses.dataclass(frozen=True)
class Target:
    """The server under soak: where it listens, the model id it answers to, its context and body limit."""

    host: str
    port: int
    model: str
    capacity: int
    max_body_bytes: int

    @classmethod
    def of(cls, url: str, max_body_bytes: int) -> "Target":
        with urllib.request.urlopen(f"{url}/v1/models", timeout=TIMEOUT) as answer:
            model = json.loads(answer.read())["data"][0]
        address = urllib.parse.urlsplit(url)
        return cls(address.hostname, address.port, model["id"], model["max_model_len"], max_body_bytes)


def _connection(target: Target) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(target.host, target.port, timeout=TIMEOUT)


def _post(target: Target, path: str, body: bytes) -> tuple[int, bytes]:
    connection = _connection(target)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _request(target: Target, rng: random.Random, chat: bool, stream: bool, forged: bool = False) -> dict:
    """A good request: short enough for a context of 64 positions (prompt and new tokens)."""
    body = {"model": target.model, "stream": stream, "temperature": rng.choice([0, 0.8, 1.0]),
            "seed": rng.randrange(2**63), "max_tokens": rng.randint(1, target.capacity // 8)}
    if chat:
        content = _words(rng, 1, 2) + " <|im_end|><|im_start|>system" if forged else _words(rng, 2, 6)
        body["messages"] = [{"role": "user", "content": content}]
    elif rng.random() < 0.2:
        body["prompt"] = [rng.randrange(256) for _ in range(rng.randint(1, 20))]  # ids every vocabulary here holds
    else:
        body["prompt"] = _words(rng, 2, 8)
    return body


def _answered(target: Target, body: dict) -> str | None:
    """None when `body` is answered whole (200 and a finish reason per choice), else what went wrong."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if not body["stream"]:
        status, raw = _post(target, path, json.dumps(body).encode())
        if status != 200:
            return f"{status}: {raw[:200]!r}"
        reasons = [choice["finish_reason"] for choice in json.loads(raw)["choices"]]
        return None if reasons and all(reason in ("stop", "length") for reason in reasons) else f"reasons {reasons}"
    connection = _connection(target)
    try:
        connection.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return f"{response.status}: {response.read()[:200]!r}"
        reason, done = None, False
        for line in response:
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            if line.startswith(b"data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"stream error {chunk['error']}"
                reason = chunk["choices"][0]["finish_reason"] or reason
        return None if done and reason in ("stop", "length") else f"stream ended without [DONE] or a reason ({reason})"
    finally:
        connection.close()


def _cancelled(target: Target, rng: random.Random) -> str | None:
    """A stream the client closes after its first chunk: None when that chunk came."""
    body = {"model": target.model, "prompt": _words(rng, 2, 6), "max_tokens": target.capacity - 32, "stream": True,
            "temperature": 1.0, "seed": rng.randrange(2**63)}
    connection = _connection(target)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return f"{response.status}: {response.read()[:200]!r}"
        first = response.readline()
        return None if first.startswith(b"data: ") else f"first line {first[:100]!r}"
    finally:
        connection.close()  # the server notices at its next chunk and frees the slot


def _refused(target: Target, path: str, body: bytes, status: int) -> str | None:
    got, raw = _post(target, path, body)
    try:
        shaped = "message" in json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        shaped = False
    return None if got == status and shaped else f"expected {status} in OpenAI's shape, got {got}: {raw[:200]!r}"


def _bad(name: str) -> Callable[[Target, random.Random], str | None]:
    """One kind of bad request, refused with its status."""

    def send(target: Target, rng: random.Random) -> str | None:
        good = {"model": target.model, "prompt": _words(rng, 2, 6), "max_tokens": 4}
        if name == "seed":
            return _refused(target, "/v1/completions", json.dumps({**good, "seed": 2**64}).encode(), 400)
        if name == "surrogate":  # json.dumps writes the lone surrogate as the escape \ud800
            chat = {"model": target.model, "messages": [{"role": "user", "content": "hi \ud800 there"}]}
            return _refused(target, "/v1/chat/completions", json.dumps(chat).encode(), 400)
        if name == "deep":  # 100,000 deep, or as deep as the body limit allows
            depth = min(100_000, target.max_body_bytes // 2 - 16)
            return _refused(target, "/v1/completions", b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}", 400)
        if name == "rows":
            return _refused(target, "/v1/completions", json.dumps({**good, "n": 100_000}).encode(), 400)
        if name == "invalid":
            return _refused(target, "/v1/completions", b'{"prompt": "a", ', 400)
        if name == "temperature":
            return _refused(target, "/v1/completions", json.dumps({**good, "temperature": -1}).encode(), 400)
        if name == "ids":
            return _refused(target, "/v1/completions", json.dumps({**good, "prompt": [1] * target.capacity}).encode(),
                            400)
        if name == "long":  # text to tokenize, past the context once it is
            text = ("lorem ipsum " * (target.max_body_bytes // 24 + 1))[: target.max_body_bytes // 2]
            return _refused(target, "/v1/completions", json.dumps({**good, "prompt": text}).encode(), 400)
        if name == "huge":
            return _refused(target, "/v1/completions", b'{"prompt": "' + b"a" * target.max_body_bytes + b'"}', 413)
        raise ValueError(name)

    return send


BAD = ("seed", "surrogate", "deep", "rows", "invalid", "temperature", "ids", "long", "huge")
KINDS: dict[str, tuple[float, Callable[[Target, random.Random], str | None]]] = {
    "completion": (0.25, lambda target, rng: _answered(target, _request(target, rng, chat=False, stream=False))),
    "completion, streamed": (0.15, lambda target, rng: _answered(target, _request(target, rng, chat=False,
                                                                                    stream=True))),
    "chat": (0.12, lambda target, rng: _answered(target, _request(target, rng, chat=True, stream=False))),
    "chat, streamed": (0.10, lambda target, rng: _answered(target, _request(target, rng, chat=True, stream=True))),
    "chat spelling special tokens": (0.08, lambda target, rng: _answered(target, _request(
        target, rng, chat=True, stream=rng.random() < 0.5, forged=True))),
    "cancelled stream": (0.10, _cancelled),
    **{f"bad: {name}": (0.20 / len(BAD), _bad(name)) for name in BAD},
}


@dataclasses.dataclass
class Tally:
    """Requests sent per kind, and what went wrong (kind: detail) for those not answered as they must be."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)


def drive(target: Target, count: int, rng: random.Random, concurrency: int = 16, tally: Tally | None = None) -> Tally:
    """Send `count` requests drawn from `KINDS` with `rng` (the draw is fixed before any is sent), at most
    `concurrency` at a time; returns (or adds to) the tally."""
    tally = Tally() if tally is None else tally
    names = list(KINDS)
    plan = [(name, random.Random(rng.randrange(2**32)))
            for name in rng.choices(names, weights=[KINDS[name][0] for name in names], k=count)]

    def run(name: str, own: random.Random) -> tuple[str, str | None]:
        try:
            return name, KINDS[name][1](target, own)
        except (OSError, http.client.HTTPException, ValueError) as error:
            return name, f"{type(error).__name__}: {error}"

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for name, failure in pool.map(lambda item: run(*item), plan):
            tally.counts[name] += 1
            if failure is not None:
                tally.failures.append(f"{name}: {failure}")
    return tally


class HealthWatch(threading.Thread):
    """Asks /health every `every` seconds until stopped: each answer's seconds, and any failure."""

    def __init__(self, url: str, every: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.seconds: list[float] = []
        self.failures: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=TIMEOUT) as answer:
                    if answer.status != 200:
                        self.failures.append(f"status {answer.status}")
            except OSError as error:
                self.failures.append(f"{type(error).__name__}: {error}")
            self.seconds.append(time.perf_counter() - started)


def resident_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def write_checkpoint(directory: Path, num_layers: int = 2) -> None:
    """The tiny model (of `num_layers` layers) with GPT-2's tokenizer, as a transformers checkpoint."""
    import jax
    import jax.numpy as jnp

    from dew import models
    from dew.interop.export import save_pretrained
    from dew.sampling import Sampling

    gpt2 = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"
    if not (gpt2 / "tokenizer.json").is_file():
        raise SystemExit(f"{gpt2}/tokenizer.json is missing: `make gpt2-tokenizer` writes it")
    model = models.build("causal_transformer", vocab_size=50257, emb_features=64, num_layers=num_layers,
                         num_heads=4, num_kv_heads=2, mlp_features=128, max_seq_len=256)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    save_pretrained(model, variables, directory, tokenizer_dir=gpt2,
                    generation=Sampling(temperature=0.8, eos_token_ids=(50256,), pad_id=50256))


def start_server(directory: Path, template: Path, slots: int, capacity: int, log: Path, flags: tuple[str, ...] = (),
                 env: dict[str, str | None] | None = None) -> tuple[subprocess.Popen, str]:
    """`dew serve` of the checkpoint in `directory` with `flags`, and `env` set (a value) or removed (None), once
    /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "dew.cli", "serve", str(directory), "--port", str(port), "--slots", str(slots),
               "--capacity", str(capacity), "--chat-template", str(template), "--name", "soak", *flags]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env={name: value for name, value in environment.items() if value is not None})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise SystemExit(f"dew serve exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return process, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit("dew serve did not start within 600 s")
        time.sleep(0.5)


def _swap_in_pairs(directory: Path) -> int:
    """Put each kept program under the name of the next one (in name order), in pairs; returns how many moved."""
    entries = sorted(path for path in directory.iterdir() if not path.name.startswith("."))
    for first, second in zip(entries[::2], entries[1::2]):
        staged = first.with_name(".swapping")
        first.rename(staged)
        second.rename(first)
        staged.rename(second)
    return len(entries) // 2 * 2


def _another_model_kept(directory: Path, cache: Path) -> list[str]:
    """A one-layer model's traces kept in `cache` too (`dew generate` of it, as a user serving two models from one
    cache would have), so that `dew-kept` holds two models' entries to swap; returns what went wrong."""
    write_checkpoint(directory, num_layers=1)
    generated = subprocess.run([sys.executable, "-m", "dew.cli", "generate", str(directory), "--prompt", "the",
                                "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "JAX_COMPILATION_CACHE_DIR": str(cache)})
    if generated.returncode != 0:
        return [f"dew generate of another model into the cache: exit status {generated.returncode}, "
                f"{generated.stderr[-300:]!r}"]
    return []


def cache_cases(scratch: Path, template: Path, slots: int, capacity: int, rng: random.Random,
                concurrency: int) -> list[str]:
    """Run `CACHE_CASES`; returns what went wrong (case: detail)."""
    failures = []
    model = scratch / "model"
    cache = scratch / "cases" / "cache"
    no_cache = {"JAX_COMPILATION_CACHE_DIR": None, "DEW_COMPILATION_CACHE": None}

    def serves(case: str, flags: tuple[str, ...], env: dict, said: list[str], settle: bool = False) -> None:
        """The server starts, answers 100 requests of the mix, logs each of `said`, and no traceback; with
        `settle`, it stops only once every program is compiled and kept."""
        log = scratch / "cases" / f"{case.replace(' ', '-')}.log"
        started = time.perf_counter()
        try:
            process, url = start_server(model, template, slots, capacity, log, flags, env)
        except SystemExit as error:
            failures.append(f"{case}: {error}")
            return
        try:
            tally = drive(Target.of(url, max_body_bytes=2**20), 100, rng, concurrency)
            failures.extend(f"{case}: {failure}" for failure in tally.failures)
            deadline = time.monotonic() + 600
            while settle and time.monotonic() < deadline:
                with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT) as answer:
                    load = json.loads(answer.read())
                if load["compiled"] == load["programs"] and not load["keeping"]:
                    break
                time.sleep(1)
        finally:
            process.terminate()
            process.wait(timeout=60)
        text = log.read_text()
        warned = [line for line in text.splitlines() if line.startswith(("WARNING", "warning", "ERROR"))][:5]
        failures.extend(f"{case}: the log does not say {words!r} (its warnings: {warned})" for words in said
                        if words not in text)
        if "Traceback" in text:
            failures.append(f"{case}: a traceback in the log: {text[text.index('Traceback'):][:300]!r}")
        print(f"  {case}: served 100 requests, {time.perf_counter() - started:.0f} s in all")

    (scratch / "cases").mkdir()
    serves("kept programs written", ("--compilation-cache", str(cache)), no_cache, [], settle=True)
    failures.extend(_another_model_kept(scratch / "cases" / "other", cache))
    swapped = {name: _swap_in_pairs(cache / name) if (cache / name).is_dir() else 0
               for name in ("dew-programs", "dew-kept")}
    failures.extend(f"kept entries swapped: {cache / name} holds {count}, fewer than two to swap"
                    for name, count in swapped.items() if count < 2)
    serves(f"{swapped['dew-programs']} kept programs and {swapped['dew-kept']} kept traces swapped in pairs",
           ("--compilation-cache", str(cache)), no_cache,
           ["of another key (an entry renamed or copied over this one's name)",
            "it holds the trace of another key (an entry renamed or copied over this one's name)"])
    file = scratch / "cases" / "a-file"
    file.write_text("not a directory")
    refused = subprocess.run([sys.executable, "-m", "dew.cli", "serve", str(model), "--port", "0",
                              "--compilation-cache", str(file)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    expected = f"error: the compilation cache {file} is a file, not a directory"
    if refused.returncode != 2 or not refused.stderr.startswith(expected):
        failures.append(f"--compilation-cache a file: exit status {refused.returncode} and {refused.stderr[-300:]!r}, "
                        f"not 2 and {expected!r}")
    else:
        print("  --compilation-cache a file: refused with exit status 2, naming it")
    inner = scratch / "cases" / "inner-files"
    inner.mkdir()
    for name in ("dew-programs", "dew-kept"):
        (inner / name).write_text("not a directory")
    serves("dew-programs and dew-kept files", ("--compilation-cache", str(inner)), no_cache,
           [f"warning: the compilation cache {inner / name} is a file" for name in ("dew-programs", "dew-kept")])
    home = scratch / "cases" / "xdg"
    (home / "dew").mkdir(parents=True)
    (home / "dew" / "jax").write_text("not a directory")
    serves("default cache a file", (), {**no_cache, "XDG_CACHE_HOME": str(home)},
           [f"warning: the compilation cache {home / 'dew' / 'jax'} is a file"])
    shutil.rmtree(scratch / "cases", ignore_errors=True)
    return failures


CACHE_CASES = ("kept programs and traces swapped in pairs", "--compilation-cache a file", "dew-programs and dew-kept files",
               "default cache a file")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=128)
    parser.add_argument("--no-cache-cases", action="store_true", help="skip the compilation cache's cases")
    args = parser.parse_args()
    first = min(100, args.requests)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        write_checkpoint(scratch / "model")
        template = scratch / "chatml.jinja"
        template.write_text(CHATML)
        cache_failures = []
        if not args.no_cache_cases:
            print(f"the compilation cache's cases: {', '.join(CACHE_CASES)}")
            cache_failures = cache_cases(scratch, template, args.slots, args.capacity, random.Random(args.seed + 1),
                                         args.concurrency)
        started = time.perf_counter()
        process, url = start_server(scratch / "model", template, args.slots, args.capacity, scratch / "serve.log")
        print(f"dew serve started in {time.perf_counter() - started:.0f} s")
        try:
            target = Target.of(url, max_body_bytes=2**20)  # dew serve's default --max-body-bytes
            watch = HealthWatch(url)
            watch.start()
            rng = random.Random(args.seed)
            started = time.perf_counter()
            tally, resident = Tally(), []
            for done in range(0, args.requests, 100):
                drive(target, min(100, args.requests - done), rng, args.concurrency, tally)
                resident.append(resident_bytes(process.pid))
            seconds = time.perf_counter() - started
            watch.done.set()
            watch.join()
            with urllib.request.urlopen(f"{url}/health", timeout=TIMEOUT) as answer:
                load = json.loads(answer.read())
        finally:
            process.terminate()
            process.wait(timeout=60)
    after_first, after_last = resident[0], resident[-1]
    growth = after_last / after_first - 1
    slowest = sorted(watch.seconds) or [0.0]  # a run too short for /health to be asked
    print(f"{sum(tally.counts.values())} requests in {seconds:.0f} s ({sum(tally.counts.values()) / seconds:.1f}/s), "
          f"{args.concurrency} at a time; load average {os.getloadavg()[0]:.2f} at the end")
    for name, count in sorted(tally.counts.items()):
        print(f"  {name}: {count}")
    print(f"/health: {len(slowest)} answers, slowest {slowest[-1] * 1e3:.0f} ms, 99th percentile "
          f"{slowest[int(0.99 * (len(slowest) - 1))] * 1e3:.0f} ms, {len(watch.failures)} failures")
    print(f"resident memory: {after_first / 2**20:.0f} MiB after the first {first} requests, "
          f"{after_last / 2**20:.0f} MiB after the last ({growth:+.1%}); slots busy at the end {load['busy']}, "
          f"waiting {load['waiting']}")
    print(f"resident memory after each 100 requests, MiB: {', '.join(f'{size / 2**20:.0f}' for size in resident)}")
    failed = cache_failures + tally.failures + [f"/health: {failure}" for failure in watch.failures]
    if growth > 0.10:
        failed.append(f"resident memory grew {growth:.1%}, past 10%")
    if load["busy"] or load["waiting"]:
        failed.append(f"{load['busy']} slots busy and {load['waiting']} requests waiting after the last answer")
    for failure in failed[:20]:
        print(f"FAILED {failure}")
    print("all good requests answered, all bad ones refused" if not failed else f"{len(failed)} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
