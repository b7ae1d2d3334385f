"""Simulated CPU devices: the device count reaches XLA_FLAGS and the CPU client's thread pool gets room
beside one collective (PJRT_NPROC = 3 x devices, never below the cores, never over a user's setting)."""

import os

import pytest

from dflop_jax import host_devices


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    return monkeypatch


def test_count_and_pool_from_the_request(env):
    host_devices.simulate_cpu_devices(8)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert os.environ["PJRT_NPROC"] == "24"


def test_a_count_already_in_xla_flags_wins_sizes_the_pool_and_is_warned(env, caplog):
    env.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4")
    host_devices.simulate_cpu_devices(8)
    assert os.environ["XLA_FLAGS"].endswith("device_count=4")
    assert os.environ["PJRT_NPROC"] == "12"
    assert "4 simulated CPU devices, not the 8 asked for" in caplog.text
    caplog.clear()
    host_devices.simulate_cpu_devices(4)  # the same count: nothing to say
    assert caplog.text == ""


def test_the_pool_never_drops_below_the_cores_or_overrides_the_user(env):
    env.setattr(os, "cpu_count", lambda: 64)
    host_devices.simulate_cpu_devices(2)
    assert os.environ["PJRT_NPROC"] == "64"
    env.setenv("PJRT_NPROC", "5")
    host_devices.simulate_cpu_devices(8)
    assert os.environ["PJRT_NPROC"] == "5"


def test_a_child_process_env_keeps_every_xla_flag_but_the_count():
    parent = {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8 "
              "--xla_backend_optimization_level=0", "PJRT_NPROC": "24", "HOME": "/h"}  # fmt: skip
    child = host_devices.own_devices_env(parent)
    assert child == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_backend_optimization_level=0",
        "HOME": "/h",
    }
    assert (
        host_devices.own_devices_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
        == {}
    )
