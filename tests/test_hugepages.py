"""dew.hugepages: when a process starts again under glibc's huge-page tunable and with
dew._native_buffers preloaded, and with what; and what the preloaded library does with big buffers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dew import hugepages

GLIBC = ("glibc", "2.36")
LIBRARY = "/somewhere/dew/_native_buffers.so"
BUILT = hugepages.buffers_library()
needs_library = pytest.mark.skipif(BUILT is None, reason="dew._native_buffers did not build (no C compiler)")


def test_environment_adds_the_tunable_and_marks_the_second_start():
    wanted = hugepages.environment({"PATH": "/bin"}, "madvise", GLIBC)
    assert wanted == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "DEW_HUGEPAGES_STARTED_AGAIN": "1"}
    # Other tunables are kept, the new one appended.
    kept = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", GLIBC)
    assert kept["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_environment_preloads_the_buffers_library_before_the_users_own():
    wanted = hugepages.environment({"LD_PRELOAD": "/lib/theirs.so"}, "always", GLIBC, LIBRARY)
    assert wanted == {"LD_PRELOAD": f"{LIBRARY} /lib/theirs.so", "DEW_HUGEPAGES_PRELOADED": LIBRARY,
                      "DEW_HUGEPAGES_STARTED_AGAIN": "1"}  # `always`: huge pages come without the tunable
    both = hugepages.environment({}, "madvise", GLIBC, LIBRARY)
    assert both["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and both["LD_PRELOAD"] == LIBRARY
    # Asked off, or there already (in either of the loader's separators): only the tunable, if any.
    assert "LD_PRELOAD" not in hugepages.environment({"DEW_REUSE_BUFFERS": "0"}, "madvise", GLIBC, LIBRARY)
    assert hugepages.environment({"DEW_REUSE_BUFFERS": "0"}, "always", GLIBC, LIBRARY) is None
    assert hugepages.environment({"LD_PRELOAD": f"/lib/theirs.so:{LIBRARY}"}, "always", GLIBC, LIBRARY) is None
    assert hugepages.environment({}, "madvise", ("", ""), LIBRARY) is None  # the library calls glibc's malloc


def test_the_started_again_process_takes_the_library_out_for_what_it_starts(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", f"{LIBRARY} /lib/theirs.so")
    monkeypatch.setenv("DEW_HUGEPAGES_PRELOADED", LIBRARY)
    monkeypatch.setenv("DEW_HUGEPAGES_STARTED_AGAIN", "1")
    monkeypatch.setattr(hugepages.os, "execve", lambda *args: pytest.fail("started a third time"))
    hugepages.reexec()
    assert os.environ["LD_PRELOAD"] == "/lib/theirs.so"
    assert "DEW_HUGEPAGES_PRELOADED" not in os.environ and "DEW_HUGEPAGES_STARTED_AGAIN" not in os.environ
    environ = {"LD_PRELOAD": LIBRARY, "DEW_HUGEPAGES_PRELOADED": LIBRARY}
    hugepages.forget_preload(environ)
    assert environ == {}


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
    assert hugepages.environment(environ, mode, libc) is None  # and without the library (did not build)


def test_reexec_replaces_the_process_with_the_same_command(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages.platform, "libc_ver", lambda: GLIBC)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    monkeypatch.setattr(hugepages.sys, "orig_argv", [sys.executable, "-m", "dew.cli", "train", "--steps", "3"])
    monkeypatch.setattr(hugepages.sys, "argv", ["/somewhere/dew/cli.py", "train", "--steps", "3"])
    monkeypatch.setattr(hugepages, "buffers_library", lambda: LIBRARY)
    monkeypatch.setattr(hugepages.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    for name in ("GLIBC_TUNABLES", "DEW_HUGEPAGES", "DEW_HUGEPAGES_STARTED_AGAIN", "LD_PRELOAD", "DEW_REUSE_BUFFERS"):
        monkeypatch.delenv(name, raising=False)
    hugepages.reexec()
    (path, args, env), = calls
    assert path == sys.executable and args == [sys.executable, "-m", "dew.cli", "train", "--steps", "3"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["LD_PRELOAD"] == LIBRARY
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


def _run_preloaded(code: str, preload: bool = True) -> dict:
    """What `code` (which sets `out`) leaves in `out`, run in a Python started with the library preloaded."""
    environ = {**os.environ, "LD_PRELOAD": BUILT} if preload else dict(os.environ)
    program = f"import json\n{textwrap.dedent(code)}\nprint(json.dumps(out))"
    done = subprocess.run([sys.executable, "-c", program], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_library
def test_a_freed_big_buffer_is_handed_back_for_the_next_request_of_about_its_size():
    out = _run_preloaded("""
        import ctypes
        libc = ctypes.CDLL(None)
        libc.malloc_usable_size.restype = ctypes.c_size_t
        libc.realloc.restype = ctypes.c_void_p
        MiB = 1 << 20

        def take(size, alignment=64):
            pointer = ctypes.c_void_p()
            assert libc.posix_memalign(ctypes.byref(pointer), ctypes.c_size_t(alignment), ctypes.c_size_t(size)) == 0
            return pointer.value

        first = take(40 * MiB)
        ctypes.memset(first, 7, 40 * MiB)
        out = {"aligned": first % (2 * MiB), "usable": libc.malloc_usable_size(ctypes.c_void_p(first))}
        libc.free(ctypes.c_void_p(first))
        again = take(39 * MiB, alignment=4096)  # rounds up to the same 40 MiB of whole huge pages
        other = take(39 * MiB)  # the first is taken: a new one
        out["again"], out["other"] = again == first, other not in (first, None)
        out["kept"] = ctypes.string_at(again, 4) == bytes([7] * 4)  # reused as it was left, not cleared
        libc.free(ctypes.c_void_p(other))
        smaller = take(32 * MiB)  # 40 MiB is more than an eighth above 32: a block of its own
        out["smaller"] = smaller != other and libc.malloc_usable_size(ctypes.c_void_p(smaller)) == 32 * MiB
        small = take(MiB)  # below 32 MiB: the C library's own
        out["small"] = libc.malloc_usable_size(ctypes.c_void_p(small)) < 2 * MiB
        libc.free(ctypes.c_void_p(small))
        grown = libc.realloc(ctypes.c_void_p(again), ctypes.c_size_t(80 * MiB))  # moves out, contents kept
        out["grown"] = grown not in (again, None) and ctypes.string_at(grown + 40 * MiB - 4, 4) == bytes([7] * 4)
        out["back"] = take(40 * MiB) == again  # the realloc gave the block back
        libc.free(ctypes.c_void_p(grown))
        with open("/proc/self/maps") as maps:
            out["loaded"] = "_native_buffers" in maps.read()
        """)
    assert out == {"aligned": 0, "usable": 40 << 20, "again": True, "other": True, "kept": True, "smaller": True,
                   "small": True, "grown": True, "back": True, "loaded": True}


@needs_library
def test_a_full_table_gives_up_an_idle_block_that_fits_nothing_asked():
    out = _run_preloaded("""
        import ctypes
        libc = ctypes.CDLL(None)
        libc.malloc_usable_size.restype = ctypes.c_size_t
        MiB = 1 << 20

        def take(size):
            pointer = ctypes.c_void_p()
            assert libc.posix_memalign(ctypes.byref(pointer), ctypes.c_size_t(64), ctypes.c_size_t(size)) == 0
            return pointer.value

        held = [take(32 * MiB) for _ in range(32)]  # every slot (mapped, never touched: no memory used)
        for pointer in held:
            libc.free(ctypes.c_void_p(pointer))
        bigger = take(64 * MiB)  # fits none of the idle blocks, and no slot is empty
        out = {"ours": libc.malloc_usable_size(ctypes.c_void_p(bigger)) == 64 * MiB,  # glibc's is not whole MiB
               "kept": take(32 * MiB) in held}
        """)
    assert out == {"ours": True, "kept": True}


@needs_library
def test_xla_steps_reuse_their_temporaries_instead_of_faulting_them_in_again():
    # A step whose 128 MiB temporary XLA allocates per execution, in 4 KiB pages (transparent huge
    # pages off for the process, whatever the machine's setting): glibc maps it afresh every time, so
    # each execution faults in its 32,768 pages again (measured 32,782 faults); reused, it faults in
    # once, and what is left is the same few allocations of Python's and XLA's in both (0-20 measured).
    # XLA may let go of one execution's temporary just after the next has asked for its own (the
    # result is ready first): then a second block is mapped, once, and the two take turns from then on
    # (seen under load, at the first to the sixth execution), so one execution may fault it all in.
    code = """
        import ctypes
        ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, one fault each
        import resource
        import jax
        import jax.numpy as jnp

        def step(x):
            return (x * 2 + 1) @ jnp.ones(x.shape[1], x.dtype)  # the product's operand is the temporary

        x = jnp.ones((4096, 8192), jnp.float32)
        compiled = jax.jit(step).lower(x).compile()
        out = {"temp": compiled.memory_analysis().temp_size_in_bytes, "faults": []}
        compiled(x).block_until_ready()
        for _ in range(8):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            compiled(x).block_until_ready()
            out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        """
    reused, mapped = _run_preloaded(code), _run_preloaded(code, preload=False)
    pages = reused["temp"] // 4096
    assert pages >= 32768
    assert min(mapped["faults"]) >= 0.9 * pages, mapped  # every execution maps and faults it afresh
    assert sorted(reused["faults"])[-2] < pages / 100, reused  # all but at most one reuse a block
