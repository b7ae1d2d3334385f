"""Test setup: 8 simulated CPU devices (before any JAX call), float32 matmuls for parity tests."""

import os

from dflop_jax.host_devices import simulate_cpu_devices  # no jax

simulate_cpu_devices(8)  # and the CPU client's thread pool for them (DESIGN 11)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import jax

        has_gpu = any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
