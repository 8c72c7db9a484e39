"""The XLA flags the suite compiles under, and the environment of a subprocess that emulates CPU devices.

Most of the suite's time is XLA compiling, not running: tiny models, each test tracing its own
functions, and eager ops compiling one program each. Two flags cut the compile without touching what
the tests check:

- `--xla_backend_optimization_level=0`: LLVM's optimization level for the generated loops. XLA's CPU
  backend keeps IEEE float semantics at every level (no fast-math reassociation unless asked), so
  the arithmetic is the same; only the machine code is slower, which tiny models never notice.
- `--xla_cpu_use_fusion_emitters=false`: XLA's older elemental emitter for fused loops, which
  compiles a small program faster. Its exp, log and tanh may differ from the newer emitters' by an ulp or
  so; every oracle tolerance in the suite is reasoned from float32 rounding over a computation, not
  from one implementation's last bit, and every exact-equality test compares two Dew runs compiled
  under the same flags.

docs/performance.md has the suite's time with and without them. Users' programs compile with XLA's
defaults; to run the suite that way, name the flags in `XLA_FLAGS` yourself (a flag
already named there is left as given), e.g.
`XLA_FLAGS="--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true" make test`.
"""

from __future__ import annotations

import os

SUITE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def suite_flags(given: str = "") -> str:
    """`given` XLA_FLAGS with each of `SUITE_FLAGS` whose name it does not already set."""
    named = {flag.split("=", 1)[0] for flag in given.split()}
    return " ".join([*given.split(), *(flag for flag in SUITE_FLAGS if flag.split("=", 1)[0] not in named)])


def devices_environment(devices: int, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess that sees `devices` CPU devices, with `extra`
    variables set: this process's XLA_FLAGS (so a flag the user named holds there too) under the
    suite's flags, its device count replaced."""
    count = "--xla_force_host_platform_device_count"
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.split("=", 1)[0] != count]
    flags = suite_flags(" ".join([f"{count}={devices}", *kept]))
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}
