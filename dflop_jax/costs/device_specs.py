"""Accelerator presets for the analytic cost model and MFU: peak FLOP/s, memory, bandwidths, efficiency.

A run names its device with `DeviceConfig` (`device:` in every run config): "auto" (the default) takes
the preset of the accelerator JAX reports (`KIND_PRESETS`, keyed by `jax.Device.device_kind`) and the
memory its runtime reports; a preset name plans for a cluster one is not on (`device=h100
num_devices=64`); `device.*` keys override single figures or describe an accelerator with no preset.

Numbers are vendor datasheet figures (dense bf16, no sparsity) per device:
- h100 (SXM5 80GB): 989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink4 900 GB/s bidirectional (450 GB/s each
  way), 8 GPUs/host, one 400 Gb/s InfiniBand NIC per GPU (50 GB/s).
- h100_pcie (80GB): 756 TFLOP/s, 80 GB HBM2e at 2.0 TB/s, PCIe Gen5 x16 between GPUs (64 GB/s each
  way; NVLink bridges join pairs only), 8 GPUs/host, 400 Gb/s per GPU.
- h200 (SXM 141GB): H100 SXM compute (989 TFLOP/s) with 141 GB HBM3e at 4.8 TB/s; NVLink4, 8/host,
  400 Gb/s per GPU.
- a100 (SXM4 80GB): 312 TFLOP/s, 80 GB HBM2e at 2.04 TB/s, NVLink3 600 GB/s bidirectional (300 GB/s each
  way), 8 GPUs/host, 200 Gb/s per GPU (25 GB/s).
- a100_40gb (SXM4 40GB): 312 TFLOP/s, 40 GB HBM2 at 1.56 TB/s, otherwise as a100.
- cpu: one XLA CPU device of this project's 2-core test machines. Measured 2026-11-21: a jitted
  1024^3 matmul reaches ~25 GFLOP/s (f32 and bf16 alike) with 8 simulated devices sharing the 2 cores
  under load (`a @ b` timed after warm-up, median of 10). Per DESIGN section 9 that measured matmul rate
  is the CPU "peak"; whole models reach about half of it (small matmuls, unfused elementwise work).
  2 GiB per simulated device, ~10 GB/s memory and transfer bandwidth, 100 us per layer. A measured cost
  table from the profiler should replace it for real CPU numbers.
`matmul_efficiency` is the fraction of peak large matmuls reach in practice (Megatron-LM reports
50-60% MFU on H100/A100 at scale); `layer_overhead_s` is the fixed per-layer cost (kernel launches,
small ops) that makes tiny buckets not free; `collective_latency_s` the fixed cost of one step of a
collective or one stage-to-stage hop of a scalar (NCCL's per-step latency is ~10-30 us; on CPU a
program dispatch). `compile_block_s` / `small_compile_s` are nominal compile times (the one H200 run
compiled the tiny demo's stage programs at about 5 s each, 4 blocks; this CPU about 1 s per block):
a measured cost table's compile seconds replace them.
"""

from __future__ import annotations

import dataclasses

from dflop_jax.config import ConfigError, require


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind.

    Attributes:
      name: preset name.
      peak_flops: dense bf16 FLOP/s per device.
      memory_bytes: device memory.
      memory_bandwidth: bytes/s device memory bandwidth.
      intra_host_bandwidth: bytes/s one way between two devices of a host (NVLink).
      inter_host_bandwidth: bytes/s one way per device between hosts (network).
      devices_per_host: devices per host (tensor parallelism stays within one host).
      matmul_efficiency: achieved fraction of peak for large matmuls.
      layer_overhead_s: fixed seconds per transformer layer per forward (launch / small-op cost).
      collective_latency_s: fixed seconds per ring step of a collective or per hop of a scalar.
      compile_block_s: nominal seconds to lower and compile one block (a transformer layer, an
        embedding, a head) of a stage's programs for one shape (forward and backward together):
        what `costs/compile.py` prices a plan's programs at when no measured table gives it.
      small_compile_s: nominal seconds per small program (a transfer, an optimizer step's glue).
      dot_bytes: bytes per weight element its matmuls read of bf16 weights: None, the compute
        dtype's (GPUs run bf16 dots natively); 4 on XLA:CPU, which upcasts them to f32 (what a
        frozen layer loop holds: `costs.memory.frozen_weight_bytes`).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    devices_per_host: int
    matmul_efficiency: float
    layer_overhead_s: float = 0.0
    collective_latency_s: float = 0.0
    compile_block_s: float = 1.5
    small_compile_s: float = 0.2
    dot_bytes: int | None = None

    def __post_init__(self):
        for key in ("peak_flops", "memory_bytes", "memory_bandwidth", "intra_host_bandwidth",
                    "inter_host_bandwidth"):  # fmt: skip
            if getattr(self, key) <= 0:
                raise ValueError(f"device {self.name}: {key}={getattr(self, key)} must be > 0")
        if self.collective_latency_s < 0:
            raise ValueError(
                f"device {self.name}: collective_latency_s={self.collective_latency_s} must be >= 0"
            )
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(
                f"device {self.name}: matmul_efficiency={self.matmul_efficiency} not in (0, 1]"
            )
        if self.devices_per_host < 1:
            raise ValueError(
                f"device {self.name}: devices_per_host={self.devices_per_host} must be >= 1"
            )

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency


_GB = 1e9
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100", 989e12, 80 * _GB, 3.35e12, 450 * _GB, 50 * _GB, 8, 0.55, 20e-6, 20e-6),
        DeviceSpec(
            "h100_pcie", 756e12, 80 * _GB, 2.0e12, 64 * _GB, 50 * _GB, 8, 0.55, 20e-6, 20e-6
        ),
        DeviceSpec("h200", 989e12, 141 * _GB, 4.8e12, 450 * _GB, 50 * _GB, 8, 0.55, 20e-6, 20e-6),
        DeviceSpec("a100", 312e12, 80 * _GB, 2.04e12, 300 * _GB, 25 * _GB, 8, 0.6, 25e-6, 20e-6),
        DeviceSpec(
            "a100_40gb", 312e12, 40 * _GB, 1.56e12, 300 * _GB, 25 * _GB, 8, 0.6, 25e-6, 20e-6
        ),
        DeviceSpec(
            "cpu",
            25e9,
            2 * 2**30,
            10 * _GB,
            10 * _GB,
            10 * _GB,
            8,
            0.5,
            100e-6,
            100e-6,
            compile_block_s=1.0,
            small_compile_s=0.1,
            dot_bytes=4,
        ),  # fmt: skip
    )
}


# `jax.Device.device_kind` (the CUDA device name on GPUs) -> preset.
KIND_PRESETS: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 SXM5 80GB": "h100",
    "NVIDIA H100 PCIe": "h100_pcie",
    "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100 80GB PCIe": "a100",
    "NVIDIA A100-SXM4-40GB": "a100_40gb",
    "NVIDIA A100-PCIE-40GB": "a100_40gb",
    "cpu": "cpu",
}


def preset_for_kind(device_kind: str) -> str | None:
    """The preset of a `device_kind` string (case and spacing ignored); None when there is none."""
    norm = " ".join(device_kind.split()).lower()
    return next((p for k, p in KIND_PRESETS.items() if k.lower() == norm), None)


# DeviceConfig keys that describe an accelerator by hand (all needed when it has no preset).
MANUAL_KEYS = ("peak_flops", "memory_gib", "memory_bandwidth", "intra_host_bandwidth",
               "inter_host_bandwidth", "devices_per_host")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """The `device:` section of a run config (`device: h100` is short for `device: {preset: h100}`).

    Attributes:
      preset: "auto" = the preset of the accelerator JAX reports (`KIND_PRESETS`), its memory the
        runtime's (`bytes_limit`) where reported; else a preset name (`list_devices()`), to plan for
        another cluster (with `num_devices`).
      peak_flops, memory_gib, memory_bandwidth, intra_host_bandwidth, inter_host_bandwidth,
        devices_per_host: override the preset's figure (0 = the preset's; FLOP/s, GiB, and bytes/s
        one way for the bandwidths). An accelerator with no preset needs all of them.
      matmul_efficiency: achieved fraction of peak for large matmuls (0 = the preset's, else 0.5).
    """

    SHORTHAND = "preset"  # a bare string given for the section sets this key

    preset: str = "auto"
    peak_flops: float = 0.0
    memory_gib: float = 0.0
    memory_bandwidth: float = 0.0
    intra_host_bandwidth: float = 0.0
    inter_host_bandwidth: float = 0.0
    devices_per_host: int = 0
    matmul_efficiency: float = 0.0

    def __post_init__(self):
        names = ["auto", *DEVICE_PRESETS]
        require(self.preset in names, "device.preset", self.preset, f"use one of {names}")
        for key in MANUAL_KEYS:
            require(
                getattr(self, key) >= 0, f"device.{key}", getattr(self, key), "0 (preset's) or > 0"
            )
        fix = "0 (the preset's) or a fraction in (0, 1]"
        require(
            0 <= self.matmul_efficiency <= 1,
            "device.matmul_efficiency",
            self.matmul_efficiency,
            fix,
        )

    def resolve(self, device_kind: str = "cpu", memory_bytes: float | None = None) -> DeviceSpec:
        """The `DeviceSpec` of this config on an accelerator of `device_kind` whose runtime reports
        `memory_bytes` (None: not reported); both are read only when `preset` is "auto".

        Raises:
          ConfigError: "auto" on a kind with no preset while some `device.*` figure is missing.
        """
        name = self.preset if self.preset != "auto" else preset_for_kind(device_kind)
        given = {k: getattr(self, k) for k in MANUAL_KEYS if getattr(self, k)}
        if "memory_gib" in given:
            given["memory_bytes"] = given.pop("memory_gib") * 2**30
        elif self.preset == "auto" and memory_bytes:
            given["memory_bytes"] = float(memory_bytes)
        if self.matmul_efficiency:
            given["matmul_efficiency"] = self.matmul_efficiency
        if name is not None:
            return dataclasses.replace(DEVICE_PRESETS[name], **given)
        missing = [f"device.{k}" for k in MANUAL_KEYS if not getattr(self, k)]
        if missing:
            raise ConfigError(
                f"device {device_kind!r} has no preset: set {', '.join(missing)} (or "
                f"device.preset=one of {', '.join(DEVICE_PRESETS)})"
            )
        given.setdefault("matmul_efficiency", 0.5)
        return DeviceSpec(name=device_kind, **given)


def get_device(name: str) -> DeviceSpec:
    """A device preset by name ("h100", "h100_pcie", "h200", "a100", "a100_40gb", "cpu").

    Raises:
      ValueError: unknown name, listing the presets.
    """
    if name not in DEVICE_PRESETS:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICE_PRESETS)}")
    return DEVICE_PRESETS[name]


def list_devices() -> list[str]:
    return list(DEVICE_PRESETS)
