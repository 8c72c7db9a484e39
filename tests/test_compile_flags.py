"""The suite's XLA flags: added to what XLA_FLAGS names, never over it."""

from __future__ import annotations

import os

from tests.compile_flags import SUITE_FLAGS, devices_environment, suite_flags


def test_a_flag_already_named_is_kept_and_the_others_are_added():
    given = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=3"
    assert suite_flags(given).split() == [*given.split(), "--xla_cpu_use_fusion_emitters=false"]
    assert suite_flags("").split() == list(SUITE_FLAGS)


def test_this_process_and_a_device_subprocess_compile_under_the_suite_flags():
    for flag in SUITE_FLAGS:  # conftest set them before JAX started (unless XLA_FLAGS named them)
        assert flag.split("=")[0] in os.environ["XLA_FLAGS"]
    env = devices_environment(8, HF_HUB_OFFLINE="1")
    assert env["XLA_FLAGS"].split()[0] == "--xla_force_host_platform_device_count=8"
    assert all(flag.split("=")[0] in env["XLA_FLAGS"] for flag in SUITE_FLAGS)
    assert env["JAX_PLATFORMS"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"
