"""Simulated CPU devices: the settings that must be made before JAX starts its backend. No jax."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

COUNT_FLAG = "--xla_force_host_platform_device_count"
# Threads of XLA:CPU's client pool per simulated device (`size_cpu_client_pool` says why).
POOL_THREADS_PER_DEVICE = 3


def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for `n` simulated host devices unless XLA_FLAGS already sets a count, and sizes the
    CPU client's thread pool for the count in effect (`size_cpu_client_pool`).

    Call before jax starts its backend (the first device query); on GPU hosts it is harmless (it only
    affects the CPU platform, and no thread pool gets smaller).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if COUNT_FLAG not in flags:
        flags = f"{flags} {COUNT_FLAG}={n}".strip()
        os.environ["XLA_FLAGS"] = flags
    count = int(re.findall(rf"{COUNT_FLAG}=(\d+)", flags)[-1])
    if count != n:
        logging.getLogger(__name__).warning(
            "XLA_FLAGS sets %s=%d: %d simulated CPU devices, not the %d asked for (unset it to "
            "choose the count in the config)", COUNT_FLAG, count, count, n,
        )  # fmt: skip
    size_cpu_client_pool(count)


def own_devices_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a jax process that picks its own simulated device count (`simulate_cpu_devices`
    from its config): every XLA flag kept but the device count (it would win over the config), and
    no PJRT_NPROC (the pool is sized for that process's count)."""
    out = dict(environ)
    flags = [f for f in out.pop("XLA_FLAGS", "").split() if not f.startswith(COUNT_FLAG)]
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    out.pop("PJRT_NPROC", None)
    return out


def size_cpu_client_pool(devices: int) -> None:
    """Gives XLA:CPU's client thread pool room beside one collective (PJRT_NPROC, unless set).

    Why: the pool has max(cores, devices) threads and runs both every device's launch of a program
    and every execution. An execution in a collective holds its thread until all participants
    arrive, and a launch waits on its thread while its device has too many programs in flight (the
    client's in-flight limit). With fewer cores than devices one blocked launch beside a 7-device
    arrival took the thread the 8th participant needed: the 8-device single-process pipeline hung
    (DESIGN 11). 3 x devices holds one collective's participants, one program's blocked launches and
    an overlapping collective. PJRT_NPROC sizes the intra-op pool too; neither drops below the cores.
    """
    if "PJRT_NPROC" not in os.environ:
        threads = max(os.cpu_count() or 1, POOL_THREADS_PER_DEVICE * devices)
        os.environ["PJRT_NPROC"] = str(threads)
