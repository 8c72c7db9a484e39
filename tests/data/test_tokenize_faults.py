"""`tokenize_text` never destroys the token files already in `out`: it replaces them only when forced, and a forced
replacement that fails (bad input, a signal, a full disk) leaves them as they were."""

import gzip
import lzma
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dew.data.token_files import STAGING_PREFIX, open_split, read_meta, remove_abandoned_staging, staging_directory
from dew.data.tokenize import tokenize_text

from .conftest import make_corpus

FILES = ("meta.json", "train.bin", "val.bin")
# A killed or stopped child must be gone well within this; it normally takes a second or two.
DEADLINE_S = 120


@pytest.fixture
def previous(tmp_path):
    """`out` holding the token files of an earlier run, and their bytes."""
    (tmp_path / "old.txt").write_text(make_corpus(50), encoding="utf-8")
    out = tmp_path / "out"
    tokenize_text(tmp_path / "old.txt", out, "byte", 0.1, 1)
    return out, {name: (out / name).read_bytes() for name in FILES}


def assert_intact(out, before, staging_left=0):
    """The earlier files are byte-identical and load; `staging_left` staging directories remain."""
    assert {name: (out / name).read_bytes() for name in FILES} == before
    meta = read_meta(out)
    assert open_split(out, "train", meta).size == meta["train_tokens"] > 0
    left = sorted(path.name for path in out.iterdir() if path.name not in FILES)
    assert len(left) == staging_left and all(name.startswith(STAGING_PREFIX) for name in left), left


def test_text_that_is_not_utf8_names_the_file_and_offset(previous, tmp_path):
    out, before = previous
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("é".encode() * 10 + b"\xe9t\xe9\n")  # 20 bytes of UTF-8, then Latin-1
    # 3-byte reads cut the two-byte characters in half, so the offset must count the held byte.
    with pytest.raises(ValueError, match=rf"{bad} is not UTF-8 text: the byte at offset 20 \(0xe9\)"):
        tokenize_text(bad, out, "byte", 0.1, 1, chunk_bytes=3, force=True)
    assert_intact(out, before)
    with lzma.open(tmp_path / "latin1.txt.xz", "wb") as stream:
        stream.write(b"fine\n" + b"\xff\n")
    with pytest.raises(ValueError, match="offset 5 of its decompressed text"):
        tokenize_text(tmp_path / "latin1.txt.xz", out, "byte", 0.1, 1, force=True)
    assert_intact(out, before)


@pytest.mark.parametrize("suffix, opener", [(".xz", lzma.open), (".gz", gzip.open)])
def test_truncated_compressed_input_is_named(previous, tmp_path, suffix, opener):
    out, before = previous
    whole = tmp_path / f"whole.txt{suffix}"
    with opener(whole, "wt", encoding="utf-8") as stream:
        stream.write(make_corpus(300))
    cut = tmp_path / f"cut.txt{suffix}"
    cut.write_bytes(whole.read_bytes()[:len(whole.read_bytes()) // 2])
    with pytest.raises(ValueError, match=rf"{cut} is truncated or corrupt: decompressing it failed"):
        tokenize_text(cut, out, "byte", 0.1, 1, chunk_bytes=256, force=True)
    assert_intact(out, before)
    damaged = tmp_path / f"damaged.txt{suffix}"
    damaged.write_bytes(b"not compressed at all\n")
    with pytest.raises(ValueError, match=rf"{damaged} is truncated or corrupt"):
        tokenize_text(damaged, out, "byte", 0.1, 1, force=True)
    assert_intact(out, before)


def test_empty_input_is_refused(previous, tmp_path):
    out, before = previous
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with lzma.open(tmp_path / "empty" / "b.txt.xz", "wb"):
        pass
    for empty in (tmp_path / "empty" / "a.txt", tmp_path / "empty"):
        with pytest.raises(ValueError, match=rf"{empty} holds no text: tokenizing it gave 0 tokens"):
            tokenize_text(empty, out, "byte", 0.1, 1, force=True)
        assert_intact(out, before)


def test_token_files_already_there_are_replaced_only_when_forced(previous, tmp_path):
    out, before = previous
    (tmp_path / "new.txt").write_text("a different corpus\n" * 30, encoding="utf-8")
    meta = read_meta(out)
    with pytest.raises(FileExistsError, match=rf"{out} already holds token files of {meta['train_tokens']:,} train and "
                                              rf"{meta['val_tokens']:,} val tokens, tokenizer 'byte': pass --force"):
        tokenize_text(tmp_path / "new.txt", out, "byte", 0.0, 1)
    assert_intact(out, before)
    (out / "meta.json").unlink()  # what is left of a set of token files counts too
    with pytest.raises(FileExistsError, match=rf"{out} already holds train.bin, val.bin: pass --force"):
        tokenize_text(tmp_path / "new.txt", out, "byte", 0.0, 1)


def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "new.txt").write_text("text\n", encoding="utf-8")
    with pytest.raises(ValueError, match="out is an empty path, which would write the token files into the current"):
        tokenize_text("new.txt", "", "byte", 0.0, 1)
    with pytest.raises(ValueError, match="input is an empty path, which would read every text file under"):
        tokenize_text("", "out", "byte", 0.0, 1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["new.txt"]


def test_an_output_that_is_or_lies_inside_the_input_is_refused_naming_both(previous, tmp_path):
    out, before = previous
    (out / "notes.txt").write_text("a stray note\n", encoding="utf-8")  # beside the token files, in the input
    with pytest.raises(ValueError, match=rf"--out {out} is --input {out}: tokenizing would read every text and "
                                         rf"record file in {out} .* as the corpus; write the token files to a "
                                         "directory outside the input"):
        tokenize_text(out, out, "byte", 0.0, 1, force=True)
    inside = out / "tokens"
    with pytest.raises(ValueError, match=rf"--out {inside} is inside --input {out}:"):
        tokenize_text(out, inside, "byte", 0.0, 1, force=True)
    (out / "notes.txt").unlink()
    assert_intact(out, before)
    assert not inside.exists()
    (tmp_path / "link").symlink_to(out)  # the same directory by another name
    with pytest.raises(ValueError, match=rf"--out {tmp_path / 'link'} is --input {out}"):
        tokenize_text(out, tmp_path / "link", "byte", 0.0, 1, force=True)


def test_a_new_run_replaces_the_files_whole(previous, tmp_path):
    out, before = previous
    (tmp_path / "new.txt").write_text("a different corpus\n" * 30, encoding="utf-8")
    meta = tokenize_text(tmp_path / "new.txt", out, "byte", 0.0, 1, force=True)
    assert meta == read_meta(out) and meta["val_tokens"] == 0
    assert bytes(open_split(out, "train")) == (tmp_path / "new.txt").read_bytes()
    assert sorted(path.name for path in out.iterdir()) == list(FILES)


def test_only_abandoned_staging_directories_are_removed(tmp_path):
    with staging_directory(tmp_path) as live:
        (live / "tokens").write_bytes(b"y")
        dead = tmp_path / f"{STAGING_PREFIX}dead"  # as a killed writer leaves it: nobody holds its lock
        dead.mkdir()
        (dead / "tokens").write_bytes(b"x" * 10)
        assert remove_abandoned_staging(tmp_path) == [dead]
        assert (live / "tokens").read_bytes() == b"y"  # its writer still holds the lock
    assert list(tmp_path.iterdir()) == []  # leaving the block removed the live one too


# Tokenizes argv[1] into argv[2] in a child; with argv[3] = "fsize", files may grow to 64 KiB only.
_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from dew.data.tokenize import tokenize_text
    if sys.argv[3] == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    try:
        tokenize_text(sys.argv[1], sys.argv[2], "byte", 0.01, int(sys.argv[4]), force=True)
    except OSError as error:
        print(error)
        sys.exit(3)
""")


def _large_input(tmp_path):
    """About 24 MiB of text: seconds of byte tokenizing, of which the tests see only the start."""
    path = tmp_path / "large.txt"
    line = make_corpus(40).encode()
    path.write_bytes(line * ((24 << 20) // len(line)))
    return path


def _tokenizing(out, child):
    """Wait until `child` has written tokens into its staging directory."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert child.poll() is None, child.communicate()
        if any(path.stat().st_size for path in out.glob(f"{STAGING_PREFIX}*/tokens")):
            return
        time.sleep(0.005)
    raise AssertionError(f"no tokens written in {DEADLINE_S} s")


@pytest.mark.slow  # a child process imports Dew, a few seconds each
@pytest.mark.parametrize("number, workers", [(signal.SIGKILL, 1), (signal.SIGTERM, 1), (signal.SIGTERM, 2)])
def test_a_killed_run_leaves_the_previous_files(previous, tmp_path, number, workers):
    out, before = previous
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(_large_input(tmp_path)), str(out), "-", str(workers)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _tokenizing(out, child)
        child.send_signal(number)
        child.wait(DEADLINE_S)
    finally:
        child.kill()
    assert child.returncode == -number, child.communicate()
    if number == signal.SIGTERM:  # it removes its own staging directory on the way out
        assert_intact(out, before)
    else:
        assert_intact(out, before, staging_left=1)
        (tmp_path / "next.txt").write_text("the next run\n", encoding="utf-8")
        tokenize_text(tmp_path / "next.txt", out, "byte", 0.0, 1, force=True)  # removes what the killed one left
        assert sorted(path.name for path in out.iterdir()) == list(FILES)
        assert bytes(open_split(out, "train")) == b"the next run\n"


@pytest.mark.slow  # a child process imports Dew
def test_a_failed_write_leaves_the_previous_files(previous, tmp_path):
    out, before = previous
    (tmp_path / "big.txt").write_text(make_corpus(2000) * 5, encoding="utf-8")  # over 4 x 64 KiB
    assert os.path.getsize(tmp_path / "big.txt") > 4 << 16
    child = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "big.txt"), str(out), "fsize", "1"],
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert child.returncode == 3, child.stderr
    assert f"writing new token files in {out} failed (File too large)" in child.stdout
    assert "the token files already there are unchanged" in child.stdout
    assert_intact(out, before)
