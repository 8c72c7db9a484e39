"""Process tuning only on request (dew.kernels.process, `dew launch`): the environment a launched command
gets, `dew train` running as the process it was started as, and `import dew` leaving JAX's settings alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dew.kernels import process
from dew.kernels.process import launch_environment
from tests.recipes.conftest import recipe_args, token_dir  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
DEW = str(Path(sys.executable).parent / "dew")
GLIBC = ("glibc", "2.36")
JEMALLOC = Path("/usr/lib/libjemalloc.so.2")


def test_glibc_with_huge_pages_adds_the_tunable_and_keeps_the_users():
    assert launch_environment({"PATH": "/bin"}) == {"PATH": "/bin"}  # nothing asked, nothing changed
    wanted = launch_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "glibc", True, GLIBC, "madvise")
    assert wanted["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    given = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own value stays
    assert launch_environment(given, "glibc", True, GLIBC, "madvise") == given
    with pytest.raises(ValueError, match=r"needs glibc 2.35 or later, and this is glibc 2.31"):
        launch_environment({}, "glibc", True, ("glibc", "2.31"), "madvise")
    with pytest.raises(ValueError, match=r"its mode is 'never' .*'never' refuses them; leave it out"):
        launch_environment({}, "glibc", True, GLIBC, "never")


def test_jemalloc_goes_in_front_and_keeps_big_blocks_unless_the_user_says_otherwise():
    wanted = launch_environment({"LD_PRELOAD": "/lib/theirs.so"}, "jemalloc", library=JEMALLOC)
    assert wanted["LD_PRELOAD"] == f"{JEMALLOC} /lib/theirs.so"
    assert wanted["MALLOC_CONF"] == "oversize_threshold:0"
    huge = launch_environment({"MALLOC_CONF": "oversize_threshold:1048576,narenas:2"}, "jemalloc", True,
                              library=JEMALLOC)
    assert huge["MALLOC_CONF"] == "oversize_threshold:1048576,thp:always,metadata_thp:auto,narenas:2"
    again = launch_environment({"LD_PRELOAD": str(JEMALLOC)}, "jemalloc", library=JEMALLOC)
    assert again["LD_PRELOAD"] == str(JEMALLOC)  # preloaded once


def test_what_cannot_apply_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"allocator 'mimalloc' is not one Dew launches: use one of glibc, "
                                         r"jemalloc, tcmalloc"):
        launch_environment({}, "mimalloc")
    with pytest.raises(ValueError, match=r"--huge-pages has no setting in tcmalloc"):
        launch_environment({}, "tcmalloc", True, library=tmp_path / "lib.so")
    with pytest.raises(FileNotFoundError, match=r"jemalloc is not installed here \(libjemalloc.so.2 is in none of "
                                                r".*apt install libjemalloc2\), or launch with --allocator glibc"):
        process.find_allocator("jemalloc", directories=[str(tmp_path)])


def _installed(name: str) -> bool:
    try:
        process.find_allocator(name)
        return True
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("allocator", ["jemalloc", "tcmalloc"])
def test_dew_launch_runs_the_command_with_the_allocator_loaded(allocator):
    if not _installed(allocator):
        pytest.skip(f"{allocator} is not installed here ({process.ALLOCATORS[allocator][1]}); the environment it "
                    "would get is tested above")
    library = process.ALLOCATORS[allocator][0]
    done = subprocess.run([DEW, "launch", "--allocator", allocator, "--", sys.executable, "-c",
                           "print(open('/proc/self/maps').read())"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert library in done.stdout


def test_dew_launch_refuses_a_missing_command_in_one_line():
    done = subprocess.run([DEW, "launch", "--allocator", "glibc"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: dew launch runs a command: give it after --")
    done = subprocess.run([DEW, "launch", "--", "no-such-command-here"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "'no-such-command-here' is not a command here" in done.stderr


def test_dew_train_runs_as_the_process_it_was_started_as(token_dir, tmp_path):  # noqa: F811
    """Nothing starts itself again: while `dew train` runs, its process (the same pid) keeps the
    environment it was given, with no tunable and nothing preloaded."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_CONF")}
    command = [DEW, "train", *recipe_args(token_dir, tmp_path / "run", steps=2)]
    running = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        while running.poll() is None:
            try:
                seen.append((Path(f"/proc/{running.pid}/environ").read_bytes(),
                             Path(f"/proc/{running.pid}/maps").read_text()))
            except (OSError, UnicodeDecodeError):
                pass
            time.sleep(0.2)
        out, err = running.communicate(timeout=600)
    finally:
        running.kill()
    assert running.returncode == 0, err
    assert len(seen) >= 3  # it ran long enough to be looked at several times
    for environ, maps in seen:
        assert b"GLIBC_TUNABLES" not in environ and b"LD_PRELOAD" not in environ
        assert "jemalloc" not in maps and "tcmalloc" not in maps


IMPORTS = textwrap.dedent("""
    import json, jax
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_enable_x64",
             "jax_default_matmul_precision", "jax_platforms")
    before = {name: getattr(jax.config, name) for name in names}
    import dew, dew.cli, dew.interop, dew.serve, dew.recipes.lm, dew.kernels.matmul
    after = {name: getattr(jax.config, name) for name in names}
    print(json.dumps([before, after], default=str))
""")


def test_importing_dew_changes_no_jax_setting():
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "DEW_"))}
    done = subprocess.run([sys.executable, "-c", IMPORTS], env={**environment, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    assert after == before and before["jax_compilation_cache_dir"] in (None, "None", "")
