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


# On one H200 (docs/benchmarks.md, GPU figures) the LLM stage of 4 Qwen2.5-7B layers at 8192 tokens
# ran at 16% MFU with the XLA attention path, 40% with the Pallas kernels and 48% with cuDNN.
_GPU_ATTENTION_HINT = (
    "model.attention_impl=xla on a GPU: the portable path, 2.5-3x slower per LLM stage step than "
    "the GPU kernels on an H200; model.attention_impl=pallas runs the flash kernels for packed rows "
    "(vision tower included), cudnn the fused kernel (docs/benchmarks.md, GPU figures)"
)


def attention_hint(attention_impl: str) -> str | None:
    """A line for a run on a GPU with the XLA attention path (`model.attention_impl`), else None."""
    import jax

    on_gpu = jax.local_devices()[0].platform == "gpu"
    return _GPU_ATTENTION_HINT if on_gpu and attention_impl == "xla" else None
