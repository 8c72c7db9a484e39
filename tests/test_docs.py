"""Every code block of README.md and docs/*.md that is marked runnable runs, as a reader would run it.

A block is marked by an HTML comment on the line just before its opening fence (the rendered page
does not show it):
- `<!-- runnable -->`: an `sh` block runs with bash (`set -e`: every command must succeed), a `python`
  block with this interpreter.
- `<!-- runnable: server -->`: an `sh` block of one `dew serve SOURCE [FLAGS]` command. The test starts it
  on a free 127.0.0.1 port with tests/serve's `running`, waits until /health answers, runs the
  document's later blocks with `127.0.0.1:8000` replaced by that port, and ends the server when they
  are done.

A document's blocks run in order, in a temporary working directory of their own, prepared with what
they expect: token files of a slice of the shipped corpus in `data/kjv-bpe` (written with a `kjv-bpe`
tokenizer of 512 ids, made by `tools/train_tokenizer.py` and found through `$DEW_TOKENIZERS`) and in
`data/kjv-byte` (byte-level). The `dew` on the blocks' PATH is this checkout's, with flags appended that
shrink a run (`SHRINK`): a `dew train` becomes a few steps of small batches of short rows, a `dew serve`
two slots of 64 positions. A later flag wins, so each block runs as written. A guide under docs/ finds
`runs/kjv` in its directory, the run the README's first example trains (made once, by that block), as a
reader who began with the README would. Blocks that need a network, a GPU, another runtime (vLLM, Ollama,
llama.cpp) or minutes of training, or that repeat a marked block, stay unmarked: documented, not run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dew.data.tokenize import tokenize_text
from tests.serve.conftest import running

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- runnable(?:: (?P<kind>server))? -->\n```(?P<language>\w*)\n(?P<code>.*?)^```$",
                  re.MULTILINE | re.DOTALL)
# Appended to the blocks' `dew` commands: a later flag overrides the block's own. The model stays the
# block's, so its checks (a preview that must fit max_seq_len, say) run as a reader's would.
SHRINK = {
    "train": ["--trainer.steps", "4", "--trainer.batch", "4", "--trainer.accumulation", "1", "--data.seq-len", "32",
              "--optim.warmup-steps", "0", "--trainer.eval-every", "None"],
    "serve": ["--slots", "2", "--prefill-rows", "1", "--capacity", "64"],
}
BLOCK_TIMEOUT = 240  # seconds


def marked_blocks(document: Path) -> list[tuple[str | None, str, str]]:
    """(kind, language, code) of each marked block of `document`, in order; a mark that is not on the
    line before a fence is an error."""
    text = document.read_text(encoding="utf-8")
    blocks = [(m["kind"], m["language"], m["code"]) for m in MARK.finditer(text)]
    marks = len(re.findall(r"^[ \t]*<!-- runnable", text, re.MULTILINE))
    assert marks == len(blocks), f"{document.name}: a runnable mark is not on the line right above a fence"
    return blocks


def tool(name: str):
    """tools/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A directory holding the tokenizer store (`tokenizers/kjv-bpe`), the token files (`data/kjv-bpe`,
    `data/kjv-byte`) and the `dew` the blocks run (`bin/dew`)."""
    root = tmp_path_factory.mktemp("docs")
    with lzma.open(ROOT / "data" / "kjv.txt.xz", "rt", encoding="utf-8") as stream:
        head = stream.read(60_000)
    verses = tool("kjv_verses").verses(head[: head.rindex("\n")])
    (root / "verses.txt").write_text("".join(f"{verse}\n" for verse in verses), encoding="utf-8")
    tool("train_tokenizer").main(["--input", str(root / "verses.txt"), "--vocab-size", "512",
                                  "--out", str(root / "tokenizers" / "kjv-bpe")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEW_TOKENIZERS", str(root / "tokenizers"))
        for directory, tokenizer in (("kjv-bpe", "kjv-bpe"), ("kjv-byte", "byte")):
            tokenize_text(str(root / "verses.txt"), str(root / "data" / directory), tokenizer, val_fraction=0.05,
                          workers=1)

    (root / "bin").mkdir()
    python = shlex.quote(sys.executable)
    cases = [f'  {command}) exec {python} -m dew.cli "$@" {shlex.join(flags)} ;;' for command, flags in SHRINK.items()]
    dew = root / "bin" / "dew"
    otherwise = f'  *) exec {python} -m dew.cli "$@" ;;'
    dew.write_text("\n".join(["#!/bin/bash", 'case "$1" in', *cases, otherwise, "esac", ""]))
    dew.chmod(0o755)
    return root


def environment(prepared: Path) -> dict[str, str]:
    """This process's environment with the shrinking `dew` first on PATH, this checkout importable, the
    test's tokenizer store, and the Hugging Face libraries kept offline."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PATH": f"{prepared / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": path,
            "DEW_TOKENIZERS": str(prepared / "tokenizers"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "JAX_PLATFORMS": "cpu"}


def serve(block_command: str, work: Path, log: Path):
    """`running` (tests/serve's `dew serve` on a free loopback port, always ended) for a server block's
    `dew serve SOURCE FLAGS`, SOURCE taken from the document's working directory and still the model id."""
    arguments = shlex.split(block_command)
    assert arguments[:2] == ["dew", "serve"] and len(arguments) > 2 and not arguments[2].startswith("-"), (
        f"a server block holds one `dew serve SOURCE [FLAGS]` command, not {block_command!r}")
    name = [] if "--name" in arguments else ["--name", arguments[2]]
    return running(work / arguments[2], *arguments[3:], *name, *SHRINK["serve"], log=log)


def run_block(language: str, code: str, cwd: Path, env: dict[str, str]) -> None:
    """Run one block, failing with the block and what it printed unless it exits with 0."""
    if language == "sh":
        command, stdin = ["bash", "-e", "-c", code], None
    elif language == "python":
        command, stdin = [sys.executable, "-"], code
    else:
        raise AssertionError(f"a runnable block is sh or python, not {language!r}:\n{code}")
    done = subprocess.run(command, input=stdin, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)
    output = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"exit {done.returncode} from\n{code}\n--- output:\n{output}"


def workspace(prepared: Path, work: Path) -> Path:
    """`work`, a new directory holding what the documents' blocks expect: the token files under `data/`
    and the checkout's fixtures at `tests/fixtures`."""
    work.mkdir()
    (work / "data").mkdir()
    for files in (prepared / "data").iterdir():
        (work / "data" / files.name).symlink_to(files)
    (work / "tests").mkdir()
    (work / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures", target_is_directory=True)
    return work


@pytest.fixture(scope="module")
def readme_run(prepared, tmp_path_factory) -> Path:
    """`runs/kjv`, trained by the README's first marked block that runs `dew train`."""
    work = workspace(prepared, tmp_path_factory.mktemp("readme-run") / "work")
    _, language, code = next(block for block in marked_blocks(ROOT / "README.md") if "dew train" in block[2])
    run_block(language, code, work, environment(prepared))
    return work / "runs" / "kjv"


@pytest.mark.slow  # each block is a process that imports jax; a server compiles its shapes at start
@pytest.mark.parametrize("document", [d for d in DOCUMENTS if marked_blocks(d)], ids=lambda d: d.name)
def test_the_marked_blocks_run(document, prepared, tmp_path, request):
    work = workspace(prepared, tmp_path / "work")
    if document.name != "README.md":
        shutil.copytree(request.getfixturevalue("readme_run"), work / "runs" / "kjv", symlinks=True)
    env = environment(prepared)
    with contextlib.ExitStack() as servers:
        port = None
        for number, (kind, language, code) in enumerate(marked_blocks(document)):
            if kind == "server":
                lines = [line for line in code.splitlines() if line.strip() and not line.startswith("#")]
                assert language == "sh" and len(lines) == 1, f"a server block is one sh command:\n{code}"
                port = servers.enter_context(serve(lines[0], work, tmp_path / f"server-{number}.log")).port
                continue
            if port is not None:
                code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            run_block(language, code, work, env)


def test_the_readme_runs_a_train_generate_export_and_serve_path():
    blocks = marked_blocks(ROOT / "README.md")
    code = "\n".join(code for _, _, code in blocks)
    assert any(kind == "server" for kind, _, _ in blocks)
    for step in ("dew train", "dew.pipeline(", "dew export", "AutoModelForCausalLM.from_pretrained(",
                 "client.completions.create("):
        assert step in code, f"no runnable README block does {step}"
