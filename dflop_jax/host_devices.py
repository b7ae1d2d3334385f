"""Simulated CPU devices: the one setting that must be made before JAX starts its backend. No jax."""

from __future__ import annotations

import os


def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for `n` simulated host devices unless XLA_FLAGS already sets a count.

    Call before jax starts its backend (the first device query); on GPU hosts it is harmless (it only
    affects the CPU platform).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
