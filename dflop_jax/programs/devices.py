"""The accelerator a run is on, as the cost model and MFU see it: `DeviceConfig` resolved against the
first local JAX device (its `device_kind` picks the preset, its runtime's `bytes_limit` the memory),
the attention kernels `model.attention_impl: auto` picks for it (`attention_kernels`), and JAX's
persistent compilation cache (`enable_compilation_cache`)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from dflop_jax.costs.device_specs import DeviceConfig, DeviceSpec

HOPPER = (9, 0)  # compute capability from which cuDNN's fast paths apply (packed layout included)


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


@dataclasses.dataclass(frozen=True)
class AttentionKernels:
    """The concrete `models.attention` implementation of each part: the vision tower's and the
    decoder's ("xla", "pallas" or "cudnn")."""

    vision: str
    llm: str


def attention_kernels(
    platform: str, compute_capability: str | None, jax_version: str
) -> AttentionKernels:
    """What `auto` runs on a backend, from its facts (`jax.devices()[0]`: platform, CUDA compute
    capability such as "9.0"; `jax.__version__`).

    Off GPU: "xla" (the only path that compiles there). On a GPU of compute capability >= 9.0
    (Hopper and newer): "cudnn" for the vision tower (jax's public cuDNN call, one valid length per
    tile) and for the decoder where cuDNN's packed layout is usable (`models.cudnn_packed`: a jax
    whose private signature was verified), else "pallas" for the decoder. Older GPUs (A100) and GPUs
    without a compute capability (ROCm): "pallas", our kernels. Never "xla" on a GPU.
    """
    from models.cudnn_packed import capability_tuple, unavailable_reason

    if platform != "gpu":
        return AttentionKernels("xla", "xla")
    cc = capability_tuple(compute_capability)
    if cc is None or cc < HOPPER:
        return AttentionKernels("pallas", "pallas")
    packed = unavailable_reason(platform, compute_capability, jax_version) is None
    return AttentionKernels("cudnn", "cudnn" if packed else "pallas")


@functools.cache
def local_attention_kernels() -> AttentionKernels:
    """`attention_kernels` of this process's first device and jax (resolved once per process)."""
    import jax

    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    return attention_kernels(dev.platform, cc, jax.__version__)


# On one H200 (docs/benchmarks.md, GPU figures) the LLM stage of 4 Qwen2.5-7B layers at 8192 tokens
# ran at 16% MFU with the XLA attention path, 40% with the Pallas kernels and 48% with cuDNN.
_GPU_ATTENTION_HINT = (
    "model.attention_impl=xla on a GPU: the portable path, 2.5-3x slower per LLM stage step than "
    "the GPU kernels on an H200; model.attention_impl=auto (the default) picks a GPU kernel: "
    "model.attention_impl=pallas, our flash kernels for packed rows, or cudnn, the fused kernels "
    "(docs/benchmarks.md, GPU figures)"
)


def attention_hint(attention_impl: str) -> str | None:
    """A line for a run on a GPU whose decoder runs the XLA attention path (the resolved
    `model.attention_impl`: set by hand, since "auto" never picks it on a GPU), else None."""
    import jax

    on_gpu = jax.local_devices()[0].platform == "gpu"
    return _GPU_ATTENTION_HINT if on_gpu and attention_impl == "xla" else None


def enable_compilation_cache(cache_dir: str | Path) -> None:
    """Turns on JAX's persistent compilation cache (every program, however fast it compiles)."""
    import jax

    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
