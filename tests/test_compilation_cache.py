"""Where the compilation cache goes (`dew.compilation_cache.configure`), and what happens where a file stands
in its way: a directory the caller names is refused, one Dew picks or makes is left out with one warning."""

from __future__ import annotations

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
