"""The accelerator a run is on, as the cost model and MFU see it: `DeviceConfig` resolved against the
first local JAX device (its `device_kind` picks the preset, its runtime's `bytes_limit` the memory)."""

from __future__ import annotations

from dflop_jax.costs.devices import DeviceConfig, DeviceSpec


def local_device_kind() -> tuple[str, float | None]:
    """(device_kind, memory bytes the runtime lets a program use, or None where not reported)."""
    import jax

    dev = jax.local_devices()[0]
    try:
        stats = dev.memory_stats()
    except (NotImplementedError, RuntimeError):  # platforms without allocator statistics
        stats = None
    return dev.device_kind, (stats or {}).get("bytes_limit")


def run_device(cfg: DeviceConfig) -> DeviceSpec:
    """`cfg` resolved: a named preset as given (JAX is not asked), "auto" the local accelerator's."""
    if cfg.preset != "auto":
        return cfg.resolve()
    return cfg.resolve(*local_device_kind())
