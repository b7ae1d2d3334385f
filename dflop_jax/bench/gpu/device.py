"""The device `bench gpu` measures on: platform, GPU name and the peak FLOP/s MFU is measured against."""

from __future__ import annotations

import shutil
import subprocess


def nvidia_smi_name() -> str | None:
    """The first GPU's name as `nvidia-smi` reports it (None without nvidia-smi)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"(nvidia-smi failed: {e})"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def device_info() -> dict:
    """Platform, device count, GPU name, and the peak FLOP/s MFU is measured against (with its source:
    the preset of the device JAX reports; `device.*` figures are needed for a kind with none)."""
    import jax

    from dflop_jax.resolve import RunContext
    from dflop_jax.runtime.config import TrainConfig

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    name = nvidia_smi_name() if gpu else None
    # the device a run resolves to here (`device: auto`: the preset of the accelerator JAX reports),
    # resolved as every command resolves it
    spec = RunContext.build(TrainConfig()).device
    peak, source = spec.peak_flops, f"costs.device_specs preset {spec.name!r} (dense bf16)"
    return {"platform": dev.platform, "gpu": gpu, "gpu_name": name, "device_kind": dev.device_kind,
            "num_devices": len(jax.devices()), "peak_flops": peak, "peak_source": source}  # fmt: skip
