"""Faults around published checkpoints: killed saves, mistyped paths, an unreachable Hub, cut GGUF files."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants as constants
import jax
import numpy as np
import pytest
from rich.console import Console

import dew
import dew.interop.hub as hub
from dew.interop import load_pretrained, progress
from dew.interop.hub import HubSource, locate
from tests.interop.test_save import _KILLED_SAVE

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid-shards", "before-index"])
def test_next_save_removes_what_a_killed_save_left(point, llama_checkpoint, tmp_path):
    bundle = load_pretrained(llama_checkpoint[0])
    out = bundle.save(tmp_path / "export", max_shard_size="20KB")
    unrelated = {"model.fp16.safetensors": b"the user's own copy", "notes.txt": b"mine",
                 ".model.safetensors.notes.tmp": b"not a Dew staging name", ".config.json.tmp": b"nor this"}
    for name, content in unrelated.items():
        (out / name).write_bytes(content)
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(llama_checkpoint[0]), str(out),
                             point], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    exported = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    orphans = {path.name for path in out.iterdir()} - exported - set(unrelated) - {
        "model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json"}
    assert orphans  # the killed save's shards

    held = os.open(out, os.O_RDONLY)  # the lock a save running in another process holds: its files stay
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        bundle.save(out)
    finally:
        os.close(held)
    assert orphans <= {path.name for path in out.iterdir()}

    bundle.save(out)
    assert {path.name for path in out.iterdir()} == {
        "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        *unrelated}
    assert all((out / name).read_bytes() == content for name, content in unrelated.items())


def test_killed_staging_copies_are_removed(llama_checkpoint, tmp_path):
    """A save killed while writing model.safetensors or a config leaves hidden staging copies."""
    bundle = load_pretrained(llama_checkpoint[0])
    out = bundle.save(tmp_path / "export")
    staged = [".model.safetensors.0123abcd.tmp", ".config.json.89abcdef.tmp",
              ".model-0123abcd-00002-of-00003.safetensors.0123abcd.tmp", "model-0123abcd-00001-of-00003.safetensors"]
    for name in staged:
        (out / name).write_bytes(b"\0" * 1000)
    bundle.save(out)
    assert not any((out / name).exists() for name in staged)
    assert os.listdir(out) and load_pretrained(out).config == {**bundle.config, "dtype": "float32"}


# ---- where a source is: a mistyped path fails at once, an unreachable Hub after one short attempt ----------


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding runs/sig (a run) and runs/other."""
    (tmp_path / "runs" / "sig").mkdir(parents=True)
    (tmp_path / "runs" / "sig" / "run.json").write_text("{}")
    (tmp_path / "runs" / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def closed_hub(monkeypatch):
    """The Hub endpoint is a local port nobody listens on, and the Hub is not marked offline."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    return endpoint


@pytest.mark.parametrize("source, where", [
    ("runs/sig", Path("runs/sig")),
    ("owner/name", HubSource("owner/name", None)),
    ("owner/name@refs/pr/1", HubSource("owner/name", "refs/pr/1")),
    ("gpt2", HubSource("gpt2", None)),
    ("hf://runs/sigg", HubSource("runs/sigg", None)),  # the explicit Hub form wins over a local runs/
    ("hf://runs/my run", ValueError),
    ("runs/sigg", "runs/ holds no 'sigg', the nearest is runs/sig; it reads as a path because runs/ is a local"),
    ("./runz/sigg", "the current directory holds no 'runz', the nearest is runs/sig; .* starts with '.'"),
    ("runs/sig/checkpoints/3", "runs/sig/ holds no 'checkpoints' .* 4 parts where a Hub id has at most two"),
    ("runs/zzz", r"runs/ holds no 'zzz' \(it holds other, sig\)"),
    ("my model/v1", "the current directory holds no 'my model' .* because it is not a valid Hub id"),
    (Path("gpt2"), "the current directory holds no 'gpt2' .* because it was given as a Path"),
])
def test_locate_tells_paths_from_hub_ids(source, where, workdir):
    if where is ValueError:
        with pytest.raises(ValueError, match="hf://runs/my run names no Hub repository"):
            locate(source)
    elif isinstance(where, str):
        with pytest.raises(FileNotFoundError, match=f"is neither a local directory nor a Hub repository id: {where}"):
            locate(source)
    else:
        assert locate(source) == where


def test_mistyped_path_fails_at_once_without_the_network(workdir, closed_hub, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the Hub was asked about a local path")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    for load in (load_pretrained, dew.pipeline):
        with pytest.raises(FileNotFoundError, match="runs/sigg is neither .* the nearest is runs/sig"):
            load("runs/sigg")
    with pytest.raises(FileNotFoundError, match=r"runs/sig is a Dew run directory .* dew.pipeline\('runs/sig'\)"):
        load_pretrained("runs/sig")


def test_unreachable_hub_fails_fast_saying_how_to_work_offline(closed_hub):
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"the Hugging Face Hub \\({closed_hub}\\) could not be reached .* "
                                              "and dew-tests/absent's config.json is not in the local cache .*"
                                              r"\(HF_HUB_OFFLINE=1 reads only the cache\)"):
        load_pretrained("dew-tests/absent")
    assert time.monotonic() - start < 5.0  # huggingface_hub's own retries took about 50 s


@pytest.fixture
def cached_repo(llama_checkpoint):
    """`dew-tests/cached` in the local Hub cache, as a download would have left it."""
    bundle = load_pretrained(llama_checkpoint[0])
    repo = Path(constants.HF_HUB_CACHE) / "models--dew-tests--cached"
    bundle.save(repo / "snapshots" / ("c" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    yield bundle
    shutil.rmtree(repo)


def test_unreachable_hub_reads_the_cache(cached_repo, closed_hub, caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dew.interop"):
        snapshot = hub.resolve("dew-tests/cached")
    assert time.monotonic() - start < 5.0
    assert snapshot.revision == "c" * 40 and snapshot.weights[0].name == "model.safetensors"
    assert "could not be reached" in caplog.text and "reading dew-tests/cached from the local cache" in caplog.text


def test_offline_mode_reads_only_the_cache(cached_repo, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *args, **kwargs: pytest.fail("asked the Hub offline"))
    assert hub.resolve("dew-tests/cached").revision == "c" * 40
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set and dew-tests/cached@v2's config.json is not "
                                                r"in the local cache .* \(unset HF_HUB_OFFLINE\)"):
        hub.resolve("dew-tests/cached@v2")


@pytest.mark.slow
def test_cli_generate_with_a_mistyped_run_prints_one_line(workdir, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": ROOT}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dew.cli", "generate", "runs/sigg", "--prompt", "w1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: runs/sigg is neither")
    assert "the nearest is runs/sig" in done.stderr
    assert time.monotonic() - start < 60  # the import of jax and dew, then no Hub look-up


# ---- a GGUF file cut short -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["metadata", "tensor data"])
def test_truncated_gguf_is_refused_in_one_line(where, tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list([f"t{i}" for i in range(50)])
    writer.add_tensor("token_embd.weight", np.ones((50, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    cut = data.index(b"t25") if where == "metadata" else len(data) - 100  # inside the token list, or the tensor
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError) as refused:
        load_pretrained(tmp_path, gguf_file="model.gguf")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{path} ({cut:,} bytes) is not a readable GGUF file, it is truncated or corrupt (")
    assert message.endswith("download it again and check its size or checksum against the source's")


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf_header(entries: list[bytes], tensors: list[bytes] = (), entry_count: int | None = None,
                 size: int = 0) -> bytes:
    """A GGUF v3 header of `entries` (key, type, value) and tensor descriptions, padded to `size` bytes."""
    count = len(entries) if entry_count is None else entry_count
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), count) + b"".join(entries) + b"".join(tensors)
    return header + bytes(max(size - len(header), 0))


_ARRAY, _STRING = struct.pack("<I", 9), struct.pack("<I", 8)
# (id, the file, what the refusal says). The first is the issue's: 153 bytes claiming 2^40 elements.
FORGED_HEADERS = [
    ("uint8-array", _gguf_header([_string(b"tokenizer.ggml.token_type") + _ARRAY + struct.pack("<IQ", 0, 2**40)],
                                 size=153),
     "metadata key 'tokenizer.ggml.token_type', an array of 1,099,511,627,776 uint8, claims 1,099,511,627,776 bytes "
     "from byte 73 and the file holds 80 more"),
    ("string-array", _gguf_header([_string(b"tokenizer.ggml.tokens") + _ARRAY + struct.pack("<IQ", 8, 2**40)]),
     "metadata key 'tokenizer.ggml.tokens', an array of 1,099,511,627,776 strings, claims at least "
     "8,796,093,022,208 bytes"),
    ("string-in-an-array", _gguf_header([_string(b"tokenizer.ggml.tokens") + _ARRAY + struct.pack("<IQ", 8, 2)
                                         + _string(b"a") + struct.pack("<Q", 2**60)]),
     "metadata key 'tokenizer.ggml.tokens''s string 1, a string, claims 1,152,921,504,606,846,976 bytes"),
    ("string", _gguf_header([_string(b"general.name") + _STRING + struct.pack("<Q", 2**60) + b"tiny"]),
     "metadata key 'general.name', a string, claims 1,152,921,504,606,846,976 bytes from byte 56 and the file "
     "holds 4 more"),
    ("entry-count", _gguf_header([], entry_count=2**40),
     "the header's 1,099,511,627,776 metadata entries claims at least 14,293,651,161,088 bytes"),
    ("tensor-data", _gguf_header([], [_string(b"token_embd.weight") + struct.pack("<IQQIQ", 2, 8, 2**40, 0, 0)]),
     "tensor 'token_embd.weight', 8 x 1099511627776 F32, claims 35,184,372,088,832 bytes from byte 96"),
]


@pytest.mark.parametrize("data, says", [case[1:] for case in FORGED_HEADERS], ids=[case[0] for case in FORGED_HEADERS])
def test_a_gguf_header_claiming_more_than_the_file_holds_is_refused_before_anything_is_built(data, says, tmp_path):
    pytest.importorskip("gguf")
    from dew.interop.gguf_files import check_header

    path = tmp_path / "forged.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            check_header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert message.startswith(f"{path} ({len(data):,} bytes) is not a readable GGUF file, it is truncated or corrupt (")
    assert says in message and "\n" not in message
    assert peak < 64 * 1024  # nothing built per claimed element (gguf's reader grew past 1 GB on the first)


def test_the_forged_gguf_is_refused_by_load_pretrained_at_once(tmp_path):
    pytest.importorskip("gguf")
    (tmp_path / "forged.gguf").write_bytes(FORGED_HEADERS[0][1])

    def stop(signum, frame):
        raise TimeoutError("no refusal within 60 s: gguf's reader is building the claimed array")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)  # without the check this grows memory without bound: stop it rather than the machine
    try:
        with pytest.raises(ValueError, match=re.escape(FORGED_HEADERS[0][2])):
            load_pretrained(tmp_path, gguf_file="forged.gguf")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("heads, found", [(None, "lacks it"), ("4", "holds '4'")], ids=["missing", "string"])
def test_a_gguf_without_the_sizes_its_config_needs_is_refused_naming_the_key(heads, found, tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    if heads is not None:
        writer.add_string("llama.attention.head_count", heads)
    writer.add_tensor("token_embd.weight", np.ones((50, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=re.escape(
            f"{tmp_path / 'model.gguf'} gives the model's num_attention_heads as metadata key "
            f"llama.attention.head_count, a positive integer, and {found}: the file is damaged")):
        load_pretrained(tmp_path, gguf_file="model.gguf")


# ---- progress on a terminal, silence elsewhere --------------------------------------------------------------


def test_load_and_save_show_bytes_on_a_terminal_only(llama_checkpoint, tmp_path, monkeypatch, capfd):
    load_pretrained(llama_checkpoint[0]).save(tmp_path / "quiet")
    assert capfd.readouterr().err == ""  # stderr is not a terminal here
    screen = io.StringIO()
    monkeypatch.setattr(progress, "_console", lambda: Console(file=screen, force_terminal=True, width=120))
    bundle = load_pretrained(llama_checkpoint[0])
    bundle.save(tmp_path / "shown", max_shard_size="20KB")
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(bundle.variables))
    shown = screen.getvalue()
    assert f"loading {llama_checkpoint[0]}" in shown and f"saving {tmp_path / 'shown'}" in shown
    assert f"{total / 1000:.1f}/{total / 1000:.1f} kB" in shown  # the bar reached the model's bytes
