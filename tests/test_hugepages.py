"""dew.hugepages: when a process starts again under glibc's huge-page tunable, and with what."""

from __future__ import annotations

import sys

import pytest

from dew import hugepages

GLIBC = ("glibc", "2.36")


def test_environment_adds_the_tunable_and_marks_the_second_start():
    wanted = hugepages.environment({"PATH": "/bin"}, "madvise", GLIBC)
    assert wanted == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "DEW_HUGEPAGES_STARTED_AGAIN": "1"}
    # Other tunables are kept, the new one appended.
    kept = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC)
    assert kept["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_tunable_reads_its_own_entry_among_others():
    assert hugepages.tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"}) == "0"
    assert hugepages.tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None
    assert hugepages.tunable({}) is None


@pytest.mark.parametrize("environ, mode, libc", [
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC),  # the user chose a value
    ({"DEW_HUGEPAGES": "0"}, "madvise", GLIBC),  # asked off
    ({"DEW_HUGEPAGES_STARTED_AGAIN": "1"}, "madvise", GLIBC),  # started again already (tunable stripped)
    ({}, "always", GLIBC),  # huge pages without asking
    ({}, "never", GLIBC),  # none to be had
    ({}, None, GLIBC),  # no such kernel setting
    ({}, "madvise", ("glibc", "2.34")),  # before the tunable
    ({}, "madvise", ("", "")),  # musl and others
])
def test_environment_is_none_where_starting_again_changes_nothing(environ, mode, libc):
    assert hugepages.environment(environ, mode, libc) is None


def test_reexec_replaces_the_process_with_the_same_command(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages.platform, "libc_ver", lambda: GLIBC)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    monkeypatch.setattr(hugepages.sys, "orig_argv", [sys.executable, "-m", "dew.cli", "train", "--steps", "3"])
    monkeypatch.setattr(hugepages.sys, "argv", ["/somewhere/dew/cli.py", "train", "--steps", "3"])
    monkeypatch.setattr(hugepages.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    for name in ("GLIBC_TUNABLES", "DEW_HUGEPAGES", "DEW_HUGEPAGES_STARTED_AGAIN"):
        monkeypatch.delenv(name, raising=False)
    hugepages.reexec()
    (path, args, env), = calls
    assert path == sys.executable and args == [sys.executable, "-m", "dew.cli", "train", "--steps", "3"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    # A program run inside another process (runpy under a test, its own sys.argv) leaves it alone.
    monkeypatch.setattr(hugepages.sys, "argv", ["quickstart.py", "--steps", "3"])
    hugepages.reexec()
    monkeypatch.setattr(hugepages.sys, "argv", ["/somewhere/dew/cli.py", "train", "--steps", "3"])
    monkeypatch.setenv("DEW_HUGEPAGES", "0")
    hugepages.reexec()  # returns: the process goes on as it is
    assert len(calls) == 1


def test_thp_mode_reads_the_bracketed_word(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "_THP", setting)
    assert hugepages.thp_mode() == "madvise"
    monkeypatch.setattr(hugepages, "_THP", tmp_path / "absent")
    assert hugepages.thp_mode() is None
