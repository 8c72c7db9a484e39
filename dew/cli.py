"""The `dew` command: `dew train`, `dew tokenize`, `dew generate`, `dew serve`, `dew export`, `dew plot`,
`dew runs`, `dew launch`.

    dew tokenize --input data/kjv.txt.xz --out data/kjv-byte --tokenizer byte
    dew train data:token-windows --data.path data/kjv-byte --trainer.run-dir runs/kjv
    dew generate runs/kjv --prompt "And God said" --max-new-tokens 40
    dew serve runs/kjv --port 8000
    dew export runs/kjv exported/kjv
    dew runs runs
    dew plot runs/kjv runs/other --out curves.png
    dew launch --allocator jemalloc -- dew train data:token-windows --data.path data/kjv-byte

Each command's `--help` lists its flags; `dew train` is `python recipes/lm/train.py`; `dew --version`
prints the version. A refusal or a fault prints one `error:` line; the exit statuses are in
`dew.errors`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Literal

import tyro
from tyro.conf import Positional

def tokenize(input: str, out: str, tokenizer: str, val_fraction: float = 0.01, workers: int | None = None,
             eos_between_files: bool = False, field: str = "text", force: bool = False) -> None:
    """Tokenize text or records into train.bin, val.bin and meta.json, the token files a run trains on.

    Memory stays bounded: text is read and tokenized about 1 MiB at a time, cut at line ends (a long record's text
    too). A JSON Lines record of more than 256 MiB, and text with no line end for more than 8 Mi characters, are
    refused naming where they are (split them into records, or break the text into lines).

    Args:
        input: A text file (.txt; .xz and .gz are decompressed), a JSON Lines file (.jsonl, .jsonl.gz,
            .jsonl.xz), a Parquet file, a Hugging Face datasets directory (Dataset.save_to_disk's), or a
            directory of such files.
        out: The directory for train.bin, val.bin and meta.json.
        tokenizer: "byte", a Hugging Face tokenizer name, or a tokenizer.json path.
        val_fraction: The share of the tokens, from the start, held out as val.bin.
        workers: Tokenizing processes (None: every core).
        eos_between_files: Put the tokenizer's EOS id between consecutive text files (records always have
            it between them).
        field: The string field of each record that holds its text (JSON Lines, Parquet, datasets).
        force: Replace the token files already in OUT (without it they are refused).
    """
    from dew.data.tokenize import existing_token_files, tokenize_text

    started = time.perf_counter()
    replaced = existing_token_files(out) if force and out else None
    meta = tokenize_text(input, out, tokenizer, val_fraction, workers, eos_between_files=eos_between_files,
                         field=field, force=force)
    tokens = meta["train_tokens"] + meta["val_tokens"]
    seconds = time.perf_counter() - started
    print(f"{out}: {tokens:,} tokens ({meta['val_tokens']:,} val, {meta['dtype']}, {meta['tokenizer']}) "
          f"in {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s"
          + (f"; they replace the {replaced} it held" if replaced else ""))


def plot(runs: Positional[Annotated[tuple[str, ...], tyro.conf.arg(metavar="RUN [RUN ...]")]], out: str) -> None:
    """Plot runs' train and validation loss and perplexity against steps and tokens, overlaid, as a PNG.

    Args:
        runs: Run directories.
        out: The image to write, e.g. curves.png.
    """
    from dew.recipes.plot import plot_runs

    print(f"wrote {plot_runs(runs, out)}")


def generate(source: Positional[Annotated[str, tyro.conf.arg(metavar="SOURCE")]], prompt: str,
             max_new_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
             seed: int = 0, n: int = 1, live: bool = False, quantize: Literal["int8", "gguf"] | None = None,
             dtype: Literal["float32", "bfloat16"] | None = None) -> None:
    """Continue a prompt from a run or a published checkpoint, printing the text as it is produced.

    Sampling defaults to the source's own (the run's preview policy, or generation_config.json);
    the flags below override it field by field. Control characters in the text are printed escaped.

    Args:
        source: A run directory (holding run.json), one of its checkpoints (RUN/checkpoints/STEP), a
            Hugging Face checkpoint directory or Hub id, or a GGUF file.
        prompt: The text to continue.
        max_new_tokens: Tokens to generate (default: the source's budget).
        temperature: 0 is greedy.
        top_k: Keep the k most likely tokens.
        top_p: Keep the smallest set of tokens whose probability reaches p.
        min_p: Drop the tokens less likely than min_p times the most likely one.
        repetition_penalty: Divide the positive logits (multiply the negative ones) of tokens already in
            the text by this; 1 changes nothing.
        seed: The sampling seed.
        n: Continuations of the prompt; with more than one they print when all are done. As many as fit
            in memory beside the weights (more are refused, naming the most that fit).
        live: Use a run's live weights instead of its moving average.
        quantize: int8 holds the weights as 8-bit integers (a quarter of float32's bytes), for faster
            decoding on a CPU; gguf (a GGUF file) keeps the file's own 4-bit or 8-bit blocks as they are.
        dtype: The weights' and products' dtype (default: the source's own; float32 for a checkpoint or
            GGUF file). bfloat16 holds the weights and the KV cache in bfloat16 (half float32's bytes) and
            multiplies in bfloat16 with float32 sums (oneDNN's bfloat16 gemm where the CPU has it); norms,
            softmax and logits stay float32, as transformers runs a bfloat16 model. Not for a run directory.
    """
    import dataclasses

    from dew.inference import MaskedGeneration
    from dew.inference.block import BlockGeneration
    from dew.inference.text import printable
    from dew.runs import pipeline
    from dew.sampling.sampling import check_seed

    check_seed(seed, "--seed")  # before loading anything
    task = pipeline(source, ema=not live, quantize=quantize, dtype=dtype)
    if task.tokenizer is None:
        raise ValueError(f"{source} has no tokenizer to encode the prompt with")
    overrides = {name: value for name, value in
                 (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                  ("repetition_penalty", repetition_penalty)) if value is not None}
    if isinstance(task, (MaskedGeneration, BlockGeneration)):  # whole spans at once: nothing to stream, no policy
        if overrides:
            flag = "--" + next(iter(overrides)).replace("_", "-")
            how = ("a masked-diffusion model, which unmasks with MDLM's sampler" if isinstance(task, MaskedGeneration)
                   else "a DiffusionGemma model, which refines canvases with its generation_config's BlockProcess")
            raise ValueError(f"{flag} sets autoregressive sampling, and {source} is {how}: drop the sampling flags")
        ids = task.encode(prompt)[0] if isinstance(task, MaskedGeneration) else task.prompts(prompt)[0]
        if isinstance(task, MaskedGeneration):
            generated = task([ids], max_new_tokens, seed=seed, n=n)
        else:  # each row its own noise: n rows of the prompt are n draws
            generated = task([ids] * n, max_new_tokens, seed=seed)
        for index, text in enumerate(generated.text):
            print(printable(text) if n == 1 else f"[{index}] {printable(text)}")
        return
    task = task.with_sampling(dataclasses.replace(task.sampling, **overrides))
    prompt_ids = task.encode(prompt)[0]
    streamed: list[int] = []
    shown = [task.tokenizer.decode(prompt_ids)]
    begun = [False]

    def begin() -> None:
        """Print the prompt once generation has begun, past every check: a refusal follows no text."""
        if not begun[0]:
            sys.stdout.write(printable(shown[0]))
            begun[0] = True

    def show(tokens, live_rows) -> None:
        begin()
        if live_rows[0]:
            streamed.append(int(tokens[0]))
            text = task.tokenizer.decode(prompt_ids + streamed)
            # Print only once the text grows, so a partial multi-byte character is never shown.
            if text.startswith(shown[0]) and not text.endswith("\ufffd"):
                sys.stdout.write(printable(text[len(shown[0]):]))
                sys.stdout.flush()
                shown[0] = text

    # Control characters a model emits are printed escaped, never sent raw to the terminal.
    if n == 1:
        result = task([prompt_ids], max_new_tokens, seed=seed, on_token=show)
        begin()
        rest = result.text[0]
        sys.stdout.write(printable(rest[len(shown[0]):]) + "\n" if rest.startswith(shown[0]) else "\n")
    else:
        for index, text in enumerate(task([prompt_ids], max_new_tokens, seed=seed, n=n).text):
            print(f"[{index}] {printable(text)}")


def serve(source: Positional[Annotated[str, tyro.conf.arg(metavar="SOURCE")]], host: str = "127.0.0.1",
          port: int = 8000, slots: int = 32, capacity: int | None = None, queue: int = 256, prefill_rows: int = 4,
          prefill_chunk: int = 256, name: str | None = None, chat_template: str | None = None, special_tokens_in_messages: bool = False,
          max_body_bytes: int = 2**20, read_timeout: float = 30.0, keep_alive_timeout: float = 5.0,
          max_connections: int = 512, live: bool = False, quantize: Literal["int8", "gguf"] | None = None,
          max_images: int = 4, max_image_pixels: int = 4096 * 4096, max_image_bytes: int = 16 * 2**20,
          fetch_images: bool = False, max_audio_clips: int = 4, max_audio_seconds: float = 30.0,
          max_audio_bytes: int = 16 * 2**20, max_logprobs: int = 20, compilation_cache: str | None = None,
          dtype: Literal["float32", "bfloat16"] | None = None, reuse_prefixes: bool = True) -> None:
    """Serve a model over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health)
    with continuous batching, until interrupted. Needs the serve extra (pip install 'dew-ml[serve]').

    The address is taken and the chat template checked before the model compiles: a port in use
    exits with status 1, a bad address or template with status 2. The port opens once the weights are
    loaded; /health answers 503 "compiling" until the first programs are compiled (requests sent
    meanwhile wait in the queue), then 200, while the rest compile in the background. Should the engine fail while
    serving (a bug, logged with its traceback), the server stops with status 1, for a supervisor
    to start it again.

    Args:
        source: A run directory, one of its checkpoints (RUN/checkpoints/STEP), a Hugging Face
            checkpoint directory or Hub id in the local cache, or a GGUF file.
        host: The address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
        port: The port to listen on, 1 to 65535 (0: any free port, logged).
        slots: Requests generated at once (rows of the KV cache); more wait in the queue. A step computes the
            first 1, 2, 4 ... slots that hold every busy one, so idle slots cost memory, not time.
        capacity: Positions per request, prompt plus new tokens (default: the model's max_seq_len, at most 1024).
        queue: Requests that may wait for a slot; past that a request is answered 503 (and one that could
            never fit, more rows than slots plus queue, 400).
        prefill_rows: The most new prompts prefilled together.
        prefill_chunk: A longer prompt is prefilled this many tokens at a time into its slot, one chunk
            between two decode steps, so the rows already drawing keep drawing (at least 16).
        reuse_prefixes: A prompt (of at most prefill_chunk tokens) that begins with tokens a slot's cache
            holds (a conversation going on, a shared system prompt, another prompt of the same arrival) is
            prefilled after a copy of their keys and values. Its numbers then differ from a whole prefill's in
            the last bits (the same sums in another order), as rows batched differently do.
        name: The model id clients send (default: SOURCE as given).
        chat_template: A Jinja chat template file, used instead of the checkpoint's.
        special_tokens_in_messages: Encode special-token text inside a chat message (such as <|im_start|>)
            as the special token, as transformers and vLLM do. By default it is plain text, so a client
            cannot forge the template's turn boundaries.
        max_body_bytes: The largest request body in bytes (1 MiB holds some 250,000 tokens of English text);
            a larger one is answered 413 before it is read.
        read_timeout: Seconds a client has to send a request's head, and again its body (then 408 and
            the connection is closed).
        keep_alive_timeout: Seconds an idle connection stays open between requests.
        max_connections: Connections open at once; past that a new one is answered 503 and closed.
        live: Use a run's live weights instead of its moving average.
        quantize: int8 holds the weights as 8-bit integers (a quarter of float32's bytes), for faster
            decoding on a CPU; gguf (a GGUF file) keeps the file's own 4-bit or 8-bit blocks as they are.
        dtype: The weights' and products' dtype (default: the source's own; float32 for a checkpoint or
            GGUF file). bfloat16 holds the weights and the KV cache in bfloat16 (half float32's bytes) and
            multiplies in bfloat16 with float32 sums (oneDNN's bfloat16 gemm where the CPU has it); norms,
            softmax and logits stay float32, as transformers runs a bfloat16 model. Not for a run directory.
        max_images: The most images one chat request may hold (a model that reads images; past it, 400).
        max_image_pixels: The most pixels (width times height) of one image.
        max_image_bytes: The most encoded bytes of one image.
        fetch_images: Fetch images sent as http(s) URLs (by default only inline data: URLs are read).
        max_audio_clips: The most audio clips (input_audio parts, base64 WAV) one chat request may hold (a
            model that hears them, Gemma 4's and Gemma 3n's; past it, 400).
        max_audio_seconds: The longest clip, in seconds.
        max_audio_bytes: The most encoded bytes of one clip.
        max_logprobs: The most alternatives a request may ask for at each position (a completion's
            logprobs, a chat's top_logprobs); past it, 400.
        compilation_cache: The directory of JAX's persistent compilation cache, which a restarted server
            reads its compiled programs from, made where missing (default: $XDG_CACHE_HOME/dew/jax, or
            JAX_COMPILATION_CACHE_DIR); a path that cannot be a directory (a file) is refused.
    """
    import importlib.util
    import logging

    missing = [package for package in ("fastapi", "uvicorn", "jinja2") if importlib.util.find_spec(package) is None]
    if missing:
        raise ImportError(f"dew serve needs {', '.join(missing)}: pip install 'dew-ml[serve]'")
    from dew.serve.audio import AudioLimits
    from dew.serve.images import ImageLimits
    from dew.serve.network import Limits, bind
    from dew.sampling.generate import PROMPT_BUCKET
    from dew.serve.service import Served

    limits = Limits(max_body_bytes, read_timeout, keep_alive_timeout, max_connections)
    images = ImageLimits(max_images, max_image_pixels, max_image_bytes, fetch_images)
    audio = AudioLimits(max_audio_clips, max_audio_seconds, max_audio_bytes)
    if prefill_chunk < PROMPT_BUCKET:
        raise ValueError(f"--prefill-chunk is {prefill_chunk}; it must be at least {PROMPT_BUCKET}, the narrowest "
                         "prompt width")
    class Stderr(logging.StreamHandler):
        """Writes each line to sys.stderr as it is when the line is logged, not as it was when made: a stderr
        replaced later (a program that runs `dew serve` in its own process, a test's capture) gets the lines."""

        def emit(self, record: logging.LogRecord) -> None:  # under the handler's lock
            self.stream = sys.stderr
            super().emit(record)

    log = logging.getLogger("dew.serve")  # lines in uvicorn's format, whatever the root logger holds
    if not log.handlers:
        handler = Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    listener = bind(host, port)  # before loading: a taken port or a bad address is refused at once
    if compilation_cache is not None:
        from dew import compilation_cache as cache

        cache.configure(compilation_cache)
    try:
        served = Served.load(source, slots=slots, capacity=capacity, queue=queue, prefill_rows=prefill_rows,
                             prefill_chunk=prefill_chunk, name=name, chat_template_file=chat_template, live=live, quantize=quantize,
                             special_tokens_in_messages=special_tokens_in_messages, images=images,
                             max_log_probs=max_logprobs, audio=audio, dtype=dtype, reuse_prefixes=reuse_prefixes)
    except BaseException:
        listener.close()
        raise
    # FastAPI's and the routes' imports run while the engine makes its KV cache on a thread of its own
    from dew.serve.app import run

    engine = served.engine
    address = listener.getsockname()
    log.info(
        "serving %s as model %r: %d slots of %d positions (prompt widths %s), queue %d, chat template %s; "
        "listening on http://%s:%d", source, served.name, engine.slots, engine.capacity,
        ", ".join(map(str, engine.widths)), engine.queue_limit, served.chat.source if served.chat else "none",
        f"[{address[0]}]" if ":" in address[0] else address[0], address[1])
    run(served, listener, limits)


def export(run: Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]],
           out: Positional[Annotated[str, tyro.conf.arg(metavar="OUT")]], live: bool = False,
           step: int | None = None, force: bool = False, format: Literal["safetensors", "gguf"] | None = None,
           outtype: Literal["f32", "f16", "q8_0"] = "f16") -> None:
    """Write a trained run as a transformers checkpoint (config.json of the family that computes it,
    safetensors, tokenizer files, generation_config.json), which transformers, vLLM and dew serve load;
    or, with --format gguf (or an OUT ending in .gguf), as one GGUF file (llama.cpp's names, the tokenizer
    and its chat template) for llama.cpp and Ollama.

    The export is whole or absent: Ctrl-C before the new files take their names leaves OUT as it was (exit
    130); once they have, the command reports them and exits 0.

    Args:
        run: A run directory (holding run.json), or one of its checkpoints (RUN/checkpoints/STEP).
        out: The directory to write: a new or empty one, outside the run directory; with --format gguf, the
            file to write (e.g. exported/kjv.gguf).
        live: Export the live weights instead of the moving average.
        step: The checkpoint to export (default: the newest that reads).
        force: Write into an OUT that holds files: an earlier export there is replaced atomically, other
            files are kept (a GGUF OUT is replaced).
        format: safetensors (a transformers checkpoint) or gguf (one file); by default gguf when OUT ends in
            .gguf, else safetensors.
        outtype: The GGUF file's matrices: f32, f16, or q8_0 (llama.cpp's 8-bit blocks; rows that are not
            whole blocks of 32 as f16). Norms and biases are always f32.
    """
    import json
    from pathlib import Path

    from dew.interop.safetensors_files import INDEX, SINGLE
    from dew.recipes.export import export_format, export_run, replaced_by_export

    format = export_format(out, format)
    if format == "gguf":
        with _finished_once_replaced([Path(out)]):
            written = export_run(run, out, ema=not live, step=step, force=force, format="gguf", outtype=outtype)
            print(f"wrote {written} ({outtype}): `llama-cli -m {written}` and Ollama (a Modelfile's FROM {written}) "
                  f"load it; so do `dew generate {written}` and `dew serve {written}`")
        return
    replaced = replaced_by_export(out) if force and out else []
    with _finished_once_replaced([Path(out) / SINGLE, Path(out) / INDEX]):
        directory = export_run(run, out, ema=not live, step=step, force=force, format="safetensors")
        family = json.loads((Path(directory) / "config.json").read_text())["model_type"]
        print(f"wrote {directory} ({family}): transformers.AutoModelForCausalLM.from_pretrained({str(directory)!r}) "
              f"loads it; so do `vllm serve {directory}` and `dew serve {directory}`"
              + (f"; it replaces the {', '.join(replaced)} that {out} held" if replaced else ""))


def _identity(path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced (device, inode, modification time), or None where there is none."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime_ns


@contextlib.contextmanager
def _finished_once_replaced(paths: Sequence) -> Iterator[None]:
    """Within, Ctrl-C interrupts as it would until one of `paths` is replaced (an export's weights renamed into
    place, its last step that can fail), and is ignored from then on, the process's teardown included: the export
    is whole, so the command reports it and exits 0 rather than stop with 130 and a complete export it never named
    (`main` gives an in-process caller its handler back). The rename is atomic, so the handler sees either the old
    file or the new one."""
    previous = signal.getsignal(signal.SIGINT)
    # Only the main thread handles signals; a handler set outside Python (None) is left as it is.
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    before = [_identity(path) for path in paths]

    def interrupt(number, frame) -> None:
        if [_identity(path) for path in paths] != before or previous is signal.SIG_IGN:
            return
        if callable(previous):
            return previous(number, frame)
        raise KeyboardInterrupt  # SIG_DFL

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        # Ignored, not a Python handler: Python resets those to the default (death by SIGINT) as it tears down.
        replaced = [_identity(path) for path in paths] != before
        signal.signal(signal.SIGINT, signal.SIG_IGN if replaced else previous)


def _number(value, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def runs(directory: Positional[Annotated[str, tyro.conf.arg(metavar="DIR")]] = "runs") -> None:
    """List the runs in a directory (or one run): status, step, latest checkpoint, last losses, and why
    a run stopped when it did not finish.

    Args:
        directory: A run directory, or a directory holding run directories.
    """
    from rich.console import Console
    from rich.table import Table

    from dew.runs.run_dir import find_runs

    found = find_runs(directory)
    if not found:
        print(f"{directory} holds no run (no run.json below it)")
        return
    summaries = [run.summary() for run in found]
    why = any(summary["why"] for summary in summaries)
    columns = ["run", "status", "step", "checkpoint", "train loss", "val loss", "val perplexity", "updated"]
    table = Table(*columns, *(["why"] if why else []))
    for summary in summaries:
        table.add_row(summary["run"], summary["status"], f"{summary['step']}/{summary['steps'] or '?'}",
                      str(summary["checkpoint"] or ""), _number(summary["train/loss"]),
                      _number(summary["val/loss"]), _number(summary["val/perplexity"]),
                      (summary["updated"] or "")[:16].replace("T", " "), *([summary["why"] or ""] if why else []))
    console = Console()
    # Into a file or a pipe, the table keeps its columns whole rather than fitting 80 characters.
    Console(width=console.width if console.is_terminal else 400).print(table)


def _train(argv: Sequence[str]) -> int:
    from dew.recipes.lm import main as train_main

    return train_main(argv, prog="dew train")


def _launch(argv: Sequence[str]) -> int:
    """`dew launch [--allocator NAME] [--huge-pages] -- COMMAND [ARGS...]`: replace this process with COMMAND
    under a preloaded allocator and glibc's huge-page tunable (`dew.kernels.process`)."""
    import argparse
    import os

    from dew.kernels.process import ALLOCATORS, launch_environment

    parser = argparse.ArgumentParser(prog="dew launch", description=(
        "Run COMMAND (dew train ..., python examples/quickstart.py, ...) with a well-kept allocator preloaded "
        "and/or glibc's transparent-huge-page tunable: XLA's CPU runtime maps each step's temporaries afresh "
        "under glibc's malloc. docs/performance.md measures each choice."))
    parser.add_argument("--allocator", choices=tuple(ALLOCATORS), default="glibc",
                        help="the allocator to preload (glibc: none; jemalloc: Debian's libjemalloc2; tcmalloc: "
                             "libtcmalloc-minimal4)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="glibc's glibc.malloc.hugetlb=1 tunable (glibc 2.35+, kernel huge pages in madvise mode)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = parser.parse_args(list(argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("dew launch runs a command: give it after --, e.g. dew launch --allocator jemalloc -- dew "
                         "train ...")
    environment = launch_environment(dict(os.environ), args.allocator, args.huge_pages)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, environment)
    except FileNotFoundError:
        raise FileNotFoundError(f"dew launch: {command[0]!r} is not a command here (not on PATH, nor a file)") from None


def _function(function: Callable[..., None]) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        tyro.cli(function, args=list(argv), prog=f"dew {function.__name__}")
        return 0

    return run


# name -> (summary, entry point taking the remaining arguments and returning the exit status).
COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "train": ("train a language model from flags: --objective lm, masked_diffusion, block_diffusion, dpo, grpo",
              _train),
    "tokenize": ("tokenize text, JSON Lines, Parquet or datasets into train.bin, val.bin and meta.json",
                 _function(tokenize)),
    "generate": ("continue a prompt from a run, a checkpoint or a GGUF file, streaming the text",
                 _function(generate)),
    "export": ("write a trained run as a transformers checkpoint or a GGUF file (vLLM, llama.cpp, Ollama)",
               _function(export)),
    "serve": ("serve a model over OpenAI's HTTP API with continuous batching", _function(serve)),
    "plot": ("plot runs' loss and perplexity against steps and tokens into a PNG", _function(plot)),
    "runs": ("list runs: status, step, checkpoint, last losses", _function(runs)),
    "launch": ("run a command with a preloaded allocator or glibc's huge-page tunable (-- COMMAND ...)", _launch),
}

COMPILING = ("train", "generate", "export", "serve")


def version() -> str:
    """The installed dew-ml's version (the source tree's pyproject.toml is what `pip install -e` reads)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dew-ml")
    except PackageNotFoundError:
        return "unknown (dew-ml is not installed: pip install -e .)"


def _usage() -> str:
    lines = ["usage: dew COMMAND [ARGS]  (dew COMMAND --help for its flags; dew --version)", "", "commands:"]
    lines += [f"  {name:<10}{summary}" for name, (summary, _) in COMMANDS.items()]
    lines += ["", "exit status: 0 done, 1 the environment failed (permissions, disk, a held run directory, a",
              "diverged run), 2 the command was refused, 128 + N stopped by signal N after saving a checkpoint"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `dew ARGV`; a refusal or a fault prints `error: ...` as one line (see `dew.errors`). Called with
    `argv` (a program running a command in its own process), it leaves the SIGINT handler as it found it."""
    in_process = argv is not None
    handler = signal.getsignal(signal.SIGINT)
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    finally:
        if in_process and handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)


def _main(argv: list[str]) -> int:
    from dew import compilation_cache
    from dew.errors import one_line_warnings, report

    one_line_warnings()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"dew {version()}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: dew has no command {argv[0]!r}: the commands are {', '.join(COMMANDS)} (dew --help)",
              file=sys.stderr)
        return 2
    # The commands that compile keep their programs for the next process (a library import changes no
    # setting); the others (tokenize, runs, plot, launch's exec) never import jax for it.
    if argv[0] in COMPILING:
        compilation_cache.configure()
    try:
        return COMMANDS[argv[0]][1](argv[1:])
    except Exception as error:  # noqa: BLE001 - `report` re-raises what is not a refusal or a fault
        return report(error)
    except KeyboardInterrupt:  # Ctrl-C outside training (which saves and reports it itself)
        print("error: interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
