"""`dew serve` as a real process on loopback, and the tiny checkpoint it serves.

`running(...)` starts `dew serve` on a free 127.0.0.1 port, waits for /health and always ends the
process; the session's `server` (8 slots, short read timeout, small body limit) serves
test_server.py and test_limits.py. The checkpoint is a 2-layer Llama with random weights of order one,
a 300-id byte-level BPE with ChatML's special tokens, and a ChatML template.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import threading
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import pytest

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SLOTS, CAPACITY, QUEUE = 8, 64, 64
READ_TIMEOUT, MAX_BODY, MAX_CONNECTIONS = 2, 65536, 48
# Every request in test_server.py pads to one prompt width (16) and asks for 6 or 12 tokens, so the
# in-process oracle compiles `generate` only a few times.
NAME = "tiny-chat"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs".split()


def tiny_llama(vocab_size: int, eos: int):
    """The 2-layer Llama the session's server serves."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=eos, bos_token_id=None, pad_token_id=eos))


def write_checkpoint(directory, build=tiny_llama):
    """The tiny chat checkpoint in `directory`, its model made by `build(vocab_size, eos_id)` (a
    transformers model); returns its transformers tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS[(i * 7) % len(WORDS):] + WORDS[: (i * 7) % len(WORDS)]) for i in range(50)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                                chat_template=CHATML)
    fast.save_pretrained(directory)
    eos = tokenizer.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    model = build(tokenizer.get_vocab_size(), eos).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return fast


def assert_served_as_generated(task, requests, wait: float = 120) -> None:
    """Serve `requests` (whose consumers are `Tokens`) through an engine of 2 slots and 32 positions, all
    submitted at once so some wait for a slot, and assert each got what a one-row `generate` of its prompt,
    policy and seed draws."""
    from dew.sampling import Sampling, generate
    from dew.serve import Engine

    engine = Engine(task.model, task.params, slots=2, capacity=32, prefill_rows=2)
    engine.start()
    try:
        engine.submit(requests[:2])
        engine.submit(requests[2:])
        for request in requests:
            assert request.consumer.done.wait(wait), "a request did not finish"
    finally:
        engine.close()
    for request in requests:
        s = request.sampling
        solo = generate(task.model, task.params, [list(request.prompt)], request.max_tokens,
                        key=jax.random.key(request.seed), sampling=Sampling(s.temperature, s.top_k))
        assert request.consumer.tokens == solo.continuations()[0]


class Tokens:
    """A `dew.serve.engine` consumer that keeps a request's tokens."""

    def __init__(self):
        self.tokens, self.done = [], threading.Event()

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return False

    def finish(self, reason: str, completion_tokens: int) -> None:
        self.done.set()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def post_raw(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@dataclasses.dataclass
class Process:
    """A `dew serve` process: its URL, the process and its log file (stdout and stderr)."""

    url: str
    port: int
    process: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text()


def command(*arguments: str, prelude: str | None = None) -> list[str]:
    """`dew ARGUMENTS` as this interpreter runs it, after `prelude` (Python run in the process first)."""
    if prelude is None:
        return [sys.executable, "-m", "dew.cli", *arguments]
    return [sys.executable, "-c", f"{prelude}\nimport sys\nfrom dew.cli import main\nsys.exit(main(sys.argv[1:]))",
            *arguments]


@contextlib.contextmanager
def running(directory, *flags: str, log: Path, prelude: str | None = None, ready: bool = True, timeout: float = 180,
            env: dict[str, str | None] | None = None):
    """`dew serve DIRECTORY FLAGS` on a free loopback port, waited for (`ready`: until /health answers
    200), and ended (terminated, then killed) whatever happens. `env` sets (a value) or removes (None)
    environment variables of the process."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu", **(env or {})}
    env = {name: value for name, value in env.items() if value is not None}
    with open(log, "w") as output:
        process = subprocess.Popen(command("serve", str(directory), "--port", str(port), *flags, prelude=prelude),
                                   stdout=output, stderr=subprocess.STDOUT, env=env)
        served = Process(f"http://127.0.0.1:{port}", port, process, Path(log))
        try:
            deadline = time.monotonic() + timeout
            while ready:
                if process.poll() is not None:
                    raise RuntimeError(f"dew serve exited with {process.returncode}: {served.text()[-3000:]}")
                with contextlib.suppress(OSError):
                    if get(f"{served.url}/health")[0] == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dew serve did not answer /health within {timeout} s")
                time.sleep(0.5)
            yield served
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def generated_alone(model, variables, prompt, max_tokens: int, *, seed: int, sampling, n: int = 1):
    """(each continuation's tokens, whether EOS ended it) of a one-row `generate` of `prompt`, `max_tokens` long.

    The generate runs as long as the model allows after the prompt's bucket of `PROMPT_BUCKET` positions (a
    prompt within a bucket of the model's end: `max_tokens`) and is cut to `max_tokens`: a row draws step t
    from `fold_in` of its key (the seed's, folded with the prompt's index and the row's continuation) and t,
    whatever the length or the row count. So the requests of a test share one program per prompt bucket and
    sampling filters, not one per length."""
    from dew.sampling import generate
    from dew.sampling.generate import PROMPT_BUCKET

    width = -(-len(prompt) // PROMPT_BUCKET) * PROMPT_BUCKET
    longest = max(model.config.max_seq_len - width, max_tokens)
    generation = generate(model, variables, [list(prompt)], longest, key=jax.random.key(seed), sampling=sampling,
                          n=n)
    rows = [row[:max_tokens] for row in generation.continuations()]
    ended = [bool(done) and int(count) <= max_tokens for done, count in zip(generation.terminated, generation.new_tokens)]
    return rows, ended


@dataclasses.dataclass
class Server:
    url: str
    process: subprocess.Popen
    hf_tokenizer: object
    pretrained: object

    def client(self, **options):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60, **options)

    def health(self) -> dict:
        return get(f"{self.url}/health")[1]

    def solo(self, prompt_ids, max_tokens, seed=0, n=1, **sampling):
        """The texts, finish reasons and token counts of a one-row `generate` of this request
        (`generated_alone`)."""
        policy = dataclasses.replace(self.pretrained.generation, **sampling)
        rows, ended = generated_alone(self.pretrained.model, self.pretrained.variables, prompt_ids, max_tokens,
                                      seed=seed, sampling=policy, n=n)
        eos = set(policy.eos_token_ids)
        texts = [self.hf_tokenizer.decode([t for t in row if t not in eos], skip_special_tokens=True) for row in rows]
        return texts, ["stop" if end else "length" for end in ended], [len(row) for row in rows]

    def chat_ids(self, messages) -> list[int]:
        return list(self.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))

    def ids(self, text: str) -> list[int]:
        return self.hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory):
    """(the tiny chat checkpoint's directory, its transformers tokenizer)."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("tiny-chat")
    return directory, write_checkpoint(directory)


@pytest.fixture(scope="session")
def server(tiny_chat):
    pytest.importorskip("fastapi")
    from dew.interop import load_pretrained

    directory, hf_tokenizer = tiny_chat
    with running(directory, "--slots", str(SLOTS), "--capacity", str(CAPACITY), "--queue", str(QUEUE),
                 "--prefill-rows", "2", "--name", NAME, "--read-timeout", str(READ_TIMEOUT), "--max-body-bytes",
                 str(MAX_BODY), "--max-connections", str(MAX_CONNECTIONS), log=directory / "serve.log") as served:
        yield Server(served.url, served.process, hf_tokenizer, load_pretrained(directory))
