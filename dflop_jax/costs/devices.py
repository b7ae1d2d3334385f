"""Accelerator presets for the analytic cost model: peak FLOP/s, memory, bandwidths, efficiency.

Numbers are vendor datasheet figures (dense bf16, no sparsity) per device:
- h100 (SXM5 80GB): 989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink4 900 GB/s bidirectional (450 GB/s each
  way), 8 GPUs/host, one 400 Gb/s InfiniBand NIC per GPU (50 GB/s).
- a100 (SXM4 80GB): 312 TFLOP/s, 80 GB HBM2e at 2.04 TB/s, NVLink3 600 GB/s bidirectional (300 GB/s each
  way), 8 GPUs/host, 200 Gb/s per GPU (25 GB/s).
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
program dispatch).
"""

from __future__ import annotations

import dataclasses


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
        DeviceSpec("a100", 312e12, 80 * _GB, 2.04e12, 300 * _GB, 25 * _GB, 8, 0.6, 25e-6, 20e-6),
        DeviceSpec("cpu", 25e9, 2 * 2**30, 10 * _GB, 10 * _GB, 10 * _GB, 8, 0.5, 100e-6, 100e-6),
    )
}


def get_device(name: str) -> DeviceSpec:
    """A device preset by name ("h100", "a100", "cpu").

    Raises:
      ValueError: unknown name, listing the presets.
    """
    if name not in DEVICE_PRESETS:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICE_PRESETS)}")
    return DEVICE_PRESETS[name]


def list_devices() -> list[str]:
    return list(DEVICE_PRESETS)
