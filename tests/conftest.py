"""Test setup: 8 simulated CPU devices (before any JAX call), float32 matmuls for parity tests."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


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
