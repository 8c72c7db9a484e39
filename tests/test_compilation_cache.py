"""Where the compilation cache goes (`dew.compilation_cache.configure`), and what happens where a file stands
in its way: a directory the caller names is refused, one Dew picks or makes is left out with one warning."""

from __future__ import annotations

import logging
import os
import threading
import warnings

import jax
import pytest

from dew import compilation_cache


@pytest.fixture
def settings(monkeypatch):
    """The JAX settings `configure` makes, recorded instead of made (so the session's cache stays as it is)."""
    made = {}

    class Settings:  # no cache configured yet, as in a fresh process
        jax_compilation_cache_dir = None
        update = staticmethod(made.__setitem__)

    monkeypatch.setattr(jax, "config", Settings)
    monkeypatch.delenv("DEW_COMPILATION_CACHE", raising=False)
    return made


def test_a_named_directory_that_cannot_be_one_is_refused(tmp_path, settings):
    file = tmp_path / "cache"
    file.write_text("a file")
    with pytest.raises(NotADirectoryError, match=f"the compilation cache {file} is a file, not a directory: give a "
                                                 "directory"):
        compilation_cache.configure(file)
    with pytest.raises(NotADirectoryError, match=f"{file / 'inner'} lies under the file {file}"):
        compilation_cache.configure(file / "inner")
    assert settings == {}
    compilation_cache.configure(tmp_path / "new" / "cache")  # a missing directory is made where JAX first writes
    assert settings["jax_compilation_cache_dir"] == str(tmp_path / "new" / "cache")


def test_a_default_directory_that_cannot_be_one_is_left_out_with_a_warning(tmp_path, settings, monkeypatch):
    (tmp_path / "dew").mkdir()
    (tmp_path / "dew" / "jax").write_text("a file")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(UserWarning) as caught:
        compilation_cache.configure()
    assert settings == {}  # JAX's cache stays off: no warning at each compile
    [message] = [str(warning.message) for warning in caught]
    assert message.startswith(f"the compilation cache {tmp_path / 'dew' / 'jax'} is a file, not a directory: Dew "
                              "keeps no compiled programs there and goes on without them")


def test_a_file_where_dews_own_directories_go_is_warned_about_once(tmp_path, settings):
    (tmp_path / "dew-kept").write_text("a file")
    (tmp_path / "dew-programs").write_text("a file")
    with pytest.warns(UserWarning) as caught:
        compilation_cache.configure(tmp_path)
    assert settings["jax_compilation_cache_dir"] == str(tmp_path)  # JAX's own cache is there still
    messages = sorted(str(warning.message) for warning in caught)
    assert len(messages) == 2 and "dew-kept is a file, not a directory: Dew keeps no traces there" in messages[0]
    assert "dew-programs is a file, not a directory: Dew keeps no serving programs there" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once a process
        compilation_cache.configure(tmp_path)


def test_a_trace_is_traced_each_time_where_its_directory_is_a_file(tmp_path, monkeypatch, recwarn):
    """It once warned twice for each trace (a read, then a write, each failing)."""
    monkeypatch.setattr(compilation_cache, "_root", lambda: str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "dew-kept").write_text("a file")
    traced = []

    def trace():
        traced.append(1)
        return {"shape": [2, 3]}

    for _ in range(2):
        assert compilation_cache.kept_trace("shapes", "a model", trace, lambda v: v, lambda v: v) == {"shape": [2, 3]}
    assert len(traced) == 2
    assert [str(w.message).split(":")[0] for w in recwarn] == [f"the compilation cache {tmp_path}/cache/dew-kept is "
                                                                "a file, not a directory"]


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Kept traces go to `tmp_path / "dew-kept"`, as if JAX's cache were set to `tmp_path`."""
    monkeypatch.setattr(compilation_cache, "_root", lambda: str(tmp_path))
    return tmp_path / "dew-kept"


def _keep(description: str, value, traced: list):
    """`kept_trace` of `value` under `description`, each trace it makes added to `traced`."""
    return compilation_cache.kept_trace("shapes", description, lambda: traced.append(description) or value,
                                        lambda v: v, lambda v: v)


def test_kept_traces_swapped_in_pairs_are_traced_again_not_used(kept, caplog):
    """Two models' shapes swapped (each under the other's name) were once read as they were: a server of one of
    them stopped at each start, its checkpoint "from different models" than its config."""
    small, large = {"embed": [300, 32]}, {"embed": [256, 64]}
    traced = []
    assert (_keep("small", small, traced), _keep("large", large, traced)) == (small, large)
    first, second = sorted(kept.iterdir())
    staged = first.with_name(".swapping")
    first.rename(staged)
    second.rename(first)
    staged.rename(second)
    with caplog.at_level(logging.WARNING, logger="dew.compilation_cache"):
        assert (_keep("small", small, traced), _keep("large", large, traced)) == (small, large)
    assert traced == ["small", "large"] * 2
    assert caplog.text.count("it holds the trace of another key (an entry renamed or copied over this one's "
                             "name)); tracing again") == 2
    assert (_keep("small", small, traced), _keep("large", large, traced)) == (small, large)  # rewritten whole
    assert traced == ["small", "large"] * 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX's")
def test_a_pipe_under_a_kept_traces_name_is_not_waited_on(kept, caplog):
    """Opening a named pipe waits for a writer: one under an entry's name would stop every command that loads a
    model. It is traced again instead."""
    traced = []
    _keep("a model", {"embed": [4]}, traced)
    [entry] = kept.iterdir()
    entry.unlink()
    os.mkfifo(entry, 0o600)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(_keep("a model", {"embed": [4]}, traced)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="dew.compilation_cache"):
        reader.start()
        reader.join(30)
    if reader.is_alive():  # release the reader: a writer opens the pipe and closes it at once
        os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))
    assert answers == [{"embed": [4]}], "the read waited on the pipe"
    assert f"could not read the kept trace {entry} (ValueError: it is not a regular file); tracing again" in caplog.text
