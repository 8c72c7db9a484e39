"""`dew serve` refusals: one error line and its documented exit status, before anything compiles (the
address, then the chat template); and a server whose engine fails exits non-zero."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import logging
import re
import socket
import subprocess
import sys
import time

import pytest

from dew import cli
from dew.cli import main
from tests.serve.conftest import command, get, post_raw, running


def _refusal(capsys, argv: list[str], status: int) -> str:
    assert main(argv) == status
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_missing_source_is_refused_in_one_line(tmp_path, capsys):
    assert "no-such-run" in _refusal(capsys, ["serve", str(tmp_path / "no-such-run"), "--port", "0"], 2)


def test_without_the_serve_extra_the_error_names_it(monkeypatch, capsys):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else found(name, *a))
    assert main(["serve", "anything"]) == 1
    assert capsys.readouterr().err == "error: dew serve needs uvicorn: pip install 'dew-ml[serve]'\n"


@pytest.mark.parametrize("flags, status, words", [
    (["--port", "99999"], 2, "--port 99999 is not a TCP port: use one from 1 to 65535"),
    (["--port", "-1"], 2, "--port -1 is not a TCP port"),
    (["--host", "999.1.1.1"], 2, "--host 999.1.1.1 is not an IPv4 address"),
    (["--host", "192.0.2.1"], 2, "--host 192.0.2.1 is not an address of this machine"),  # TEST-NET-1: no one's
    (["--read-timeout", "0"], 2, "--read-timeout is 0.0; it is a number of seconds above 0"),
    (["--max-body-bytes", "0"], 2, "--max-body-bytes is 0; it must be at least 1"),
    (["--prefill-chunk", "8"], 2, "--prefill-chunk is 8; it must be at least 16, the narrowest prompt width"),
])
def test_a_bad_address_or_limit_is_refused_before_the_source_is_read(tmp_path, capsys, flags, status, words):
    assert words in _refusal(capsys, ["serve", str(tmp_path / "not-read"), "--port", "0", *flags], status)


def test_a_port_in_use_is_refused_with_status_1(tmp_path, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = _refusal(capsys, ["serve", str(tmp_path / "not-read"), "--port", str(port)], 1)
    assert f"127.0.0.1:{port} is in use by another process: stop it, or choose another --port" in err


@pytest.mark.slow  # a process of its own (imports and all)
def test_a_port_in_use_stops_the_process_before_it_says_listening(tmp_path):
    """The real process: it once logged "listening" and exited with status 3, which dew --help does not list."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(command("serve", str(tmp_path / "not-read"), "--port", str(port)), capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 1 and "listening" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"error: 127.0.0.1:{port} is in use by another process: stop it, "
                                                    "or choose another --port")


@pytest.mark.slow  # the tiny checkpoint, made and loaded
@pytest.mark.parametrize("template, words", [
    (b"{{ messages[0]['content'] }\n", "line 1: the chat template is not valid Jinja (unexpected '}')"),
    (b"hello\n\n{% include 'other.jinja' %}\n", "line 3: the chat template reads another template (include)"),
    (b"{% for m in messages %}\n{{ m['content'] | no_such_filter }}{% endfor %}", "line 2: the chat template is "
                                                                                   "not valid Jinja (No filter"),
    (b"{% for m in messages %}{{ m['content'] }}\n{{ m['content'] + 1 }}{% endfor %}",
     "line 2: the chat template fails on a conversation of one user message (TypeError"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "is not UTF-8 text (byte 0x89 at offset 0)"),
    (b"{{ messages }}\x00", "holds a NUL byte at offset 14"),
])
def test_a_broken_chat_template_is_refused_naming_the_file_and_line(tiny_chat, tmp_path, capsys, template, words):
    directory, _ = tiny_chat
    path = tmp_path / "template.jinja"
    path.write_bytes(template)
    err = _refusal(capsys, ["serve", str(directory), "--port", "0", "--chat-template", str(path)], 2)
    assert f"error: {path}" in err and words in err


@pytest.mark.slow  # the tiny checkpoint, made and loaded
def test_a_template_that_refuses_a_conversation_itself_is_taken(tiny_chat, tmp_path, capsys, monkeypatch):
    """raise_exception is the template's own refusal of some conversations (Llama 2's of a lone system
    message), not a broken template: the check lets it through, and loading goes on to the engine."""
    from dew.serve import service

    directory, _ = tiny_chat
    path = tmp_path / "template.jinja"
    path.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
                    "{% endif %}{{ messages[0]['content'] }}")
    reached = []
    monkeypatch.setattr(service, "Engine", lambda *args, **kwargs: reached.append(True) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["serve", str(directory), "--port", "0", "--chat-template", str(path)])
    assert reached


def test_a_compilation_cache_that_cannot_be_a_directory_is_refused_before_loading(tmp_path, capsys):
    """It once served /health, then failed in the engine's thread at the first program (NotADirectoryError)."""
    file = tmp_path / "cache"
    file.write_text("a file")
    for named, words in ((file, "is a file, not a directory"), (file / "inner", f"lies under the file {file}")):
        argv = ["serve", str(tmp_path / "not-read"), "--port", "0", "--compilation-cache", str(named)]
        err = _refusal(capsys, argv, 2)
        assert err.startswith(f"error: the compilation cache {named} {words}: give a directory"), err


@pytest.mark.slow  # a process of its own
@pytest.mark.parametrize("case", ["default cache a file", "dew-programs and dew-kept files"])
def test_a_file_in_the_caches_way_is_said_once_and_the_server_serves(tiny_chat, tmp_path, case):
    """The cache Dew picks (`$XDG_CACHE_HOME/dew/jax`), or its own directories inside a cache, a file: one
    warning each, naming it, and the server answers (it once exited 1 with two tracebacks)."""
    directory, _ = tiny_chat
    flags, env = [], {"JAX_COMPILATION_CACHE_DIR": None, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    if case == "default cache a file":
        (tmp_path / "xdg" / "dew").mkdir(parents=True)
        in_the_way = [tmp_path / "xdg" / "dew" / "jax"]
    else:
        flags = ["--compilation-cache", str(tmp_path / "cache")]
        in_the_way = [tmp_path / "cache" / "dew-kept", tmp_path / "cache" / "dew-programs"]
        (tmp_path / "cache").mkdir()
    for path in in_the_way:
        path.write_text("a file")
    with running(directory, "--slots", "1", "--capacity", "32", "--prefill-rows", "1", *flags, env=env,
                 log=tmp_path / "serve.log") as served:
        body = json.dumps({"prompt": "the quick", "max_tokens": 3, "temperature": 0}).encode()
        status, answer = post_raw(f"{served.url}/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1, answer
    log = served.text()
    assert "Traceback" not in log, log[-3000:]
    for path in in_the_way:
        assert log.count(f"warning: the compilation cache {path} is a file, not a directory") == 1, log[-3000:]


@pytest.mark.parametrize("function", [cli.serve, cli.generate, cli.export, cli.tokenize, cli.plot, cli.runs],
                         ids=lambda function: function.__name__)
def test_each_flag_is_described_in_its_commands_help(function):
    """`dew serve --help` once said nothing of --compilation-cache or --max-logprobs: their descriptions sat in
    generate's docstring (with four more of serve's flags), which tyro reads for generate's flags alone."""
    described = re.findall(r"^        (\w+):", function.__doc__, re.M)
    assert sorted(described) == sorted(inspect.signature(function).parameters)


def test_generate_refuses_a_seed_past_64_bits_before_loading(tmp_path, capsys):
    err = _refusal(capsys, ["generate", str(tmp_path / "not-read"), "--prompt", "a", "--seed", str(10**23)], 2)
    assert f"--seed is {10**23}; a seed is an integer from -2**63 to 2**63 - 1" in err


@pytest.mark.slow
def test_a_server_whose_engine_fails_exits_with_status_1(tiny_chat, tmp_path):
    """The engine's thread fails at its first token (a fault put into this process): the request in
    flight gets a 500, and the process stops with status 1, for a supervisor to start it again."""
    directory, _ = tiny_chat
    prelude = ("from dew.serve.engine import Engine\n"
               "def fail(self, *args):\n    raise RuntimeError('a fault put in by the test')\n"
               "Engine._hand_out = fail")
    with running(directory, "--slots", "1", "--capacity", "16", "--prefill-rows", "1", log=tmp_path / "serve.log",
                 prelude=prelude) as served:
        status, answer = post_raw(f"{served.url}/v1/completions", b'{"prompt": "a", "max_tokens": 2}')
        assert status == 500 and answer["error"]["code"] == "engine_stopped"
        assert served.process.wait(timeout=60) == 1
    log = served.text()
    assert "RuntimeError: a fault put in by the test" in log and "EngineFailed: the serving engine's thread failed" \
        in log


# Each program compiles a second slower, so that /health is seen saying "compiling"; every compile is
# kept in the persistent cache, however short (the tiny model's take well under dew's 0.5 s floor).
SLOW_COMPILES = """
import time, jax
import dew.compilation_cache as cache
from dew.serve.engine import Engine
compile = Engine._compile
Engine._compile = lambda self, key: (time.sleep(1.0), compile(self, key))[1]
configure = cache.configure
cache.configure = lambda directory=None: (configure(directory),
                                          jax.config.update("jax_persistent_cache_min_compile_time_secs", 0))
"""


@pytest.mark.slow  # a process of its own
def test_the_port_opens_before_compiling_and_health_says_when_it_is_ready(tiny_chat, tmp_path):
    """/health answers 503 "compiling" while the first programs compile; a request sent then waits and
    is answered once ready; the rest compile in the background, into the --compilation-cache directory."""
    directory, _ = tiny_chat
    cache = tmp_path / "cache"
    with running(directory, "--slots", "2", "--capacity", "32", "--compilation-cache", str(cache),
                 log=tmp_path / "serve.log", prelude=SLOW_COMPILES, ready=False) as served:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, served.text()[-3000:]
            with contextlib.suppress(OSError):
                status, health = get(f"{served.url}/health")
                break
            time.sleep(0.05)
        assert (status, health["status"], health["ready"]) == (503, "compiling", False), health
        body = json.dumps({"prompt": "the quick", "max_tokens": 3, "temperature": 0}).encode()
        status, answer = post_raw(f"{served.url}/v1/completions", body)  # sent while compiling
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1
        status, health = get(f"{served.url}/health")
        assert (status, health["status"]) == (200, "ok")
        while health["compiled"] < health["programs"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
            health = get(f"{served.url}/health")[1]
    assert "ready: compiled the first 3 programs" in served.text()
    assert len(list(cache.iterdir())) >= health["programs"]  # kept for the next start


def test_prefill_chunk_reaches_the_loader(monkeypatch, tmp_path):
    from dew.serve import service

    seen = {}

    class Stop(Exception):
        pass

    def load(source, **options):
        seen.update(options)
        raise Stop

    monkeypatch.setattr(service.Served, "load", load)
    with pytest.raises(Stop):
        main(["serve", str(tmp_path / "not-read"), "--port", "0", "--prefill-chunk", "64"])
    assert seen["prefill_chunk"] == 64


def test_the_servers_lines_go_to_stderr_as_it_is_when_each_is_logged(monkeypatch, tmp_path):
    """`dew serve` run in a process's own thread logs through a handler that looks up sys.stderr at each
    line: a stderr replaced after the command started gets the engine's later lines (the one it started
    with may be closed by then, as a test's capture is)."""
    from dew.serve import service

    class Stop(Exception):
        pass

    def load(source, **options):
        raise Stop

    monkeypatch.setattr(service.Served, "load", load)
    with pytest.raises(Stop):
        main(["serve", str(tmp_path / "not-read"), "--port", "0"])
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("dew.serve.engine").info("ready: a line logged after the start")
    assert later.getvalue() == "INFO:     ready: a line logged after the start\n"
