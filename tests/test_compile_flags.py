"""The suite's XLA flags: added to what XLA_FLAGS names, never over it, here and in subprocesses."""

from __future__ import annotations

import os

from tests.compile_flags import SUITE_FLAGS, devices_environment, suite_flags


def _names(flags: str) -> dict[str, str]:
    return dict(flag.split("=", 1) for flag in flags.split())


def test_a_flag_already_named_is_kept_and_the_others_are_added():
    given = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=3"
    assert suite_flags(given).split() == [*given.split(), "--xla_cpu_use_fusion_emitters=false"]
    assert suite_flags("").split() == list(SUITE_FLAGS)


def test_this_process_compiles_under_the_suite_flags():
    # conftest set them before JAX started; each is there with its value unless the user's XLA_FLAGS named it.
    named = _names(os.environ["XLA_FLAGS"])
    assert all(flag.split("=", 1)[0] in named for flag in SUITE_FLAGS), os.environ["XLA_FLAGS"]


def test_a_device_subprocess_keeps_this_process_flags_with_its_own_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=3")
    env = devices_environment(8, HF_HUB_OFFLINE="1")
    assert _names(env["XLA_FLAGS"]) == {"--xla_force_host_platform_device_count": "8",
                                        "--xla_backend_optimization_level": "3",
                                        "--xla_cpu_use_fusion_emitters": "false"}
    assert env["JAX_PLATFORMS"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"
