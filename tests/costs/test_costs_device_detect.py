"""The run's device: presets keyed by JAX's `device_kind`, runtime memory, overrides, unknown kinds."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflop_jax.config import ConfigError, load_config
from dflop_jax.costs import DEVICE_PRESETS, DeviceConfig, preset_for_kind
from dflop_jax.costs.device_specs import MANUAL_KEYS

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kind, preset, tflops, gb",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 989, 80),
        ("NVIDIA H100 PCIe", "h100_pcie", 756, 80),
        ("NVIDIA H200", "h200", 989, 141),
        ("NVIDIA A100-SXM4-80GB", "a100", 312, 80),
        ("NVIDIA A100-SXM4-40GB", "a100_40gb", 312, 40),
        ("NVIDIA A100-PCIE-40GB", "a100_40gb", 312, 40),
        ("cpu", "cpu", 0.025, 2 * 2**30 / 1e9),
    ],
)
def test_each_reported_kind_has_its_datasheet_preset(kind, preset, tflops, gb):
    assert preset_for_kind(kind) == preset == preset_for_kind(f"  {kind.upper()} ")
    spec = DeviceConfig().resolve(kind)
    assert spec.name == preset
    assert spec.peak_flops == pytest.approx(tflops * 1e12)
    assert spec.memory_bytes == pytest.approx(gb * 1e9)


def test_auto_takes_the_runtime_memory_and_a_named_preset_does_not():
    limit = 60.5e9  # what XLA's allocator allows (a fraction of the 80 GB)
    assert DeviceConfig().resolve("NVIDIA H100 80GB HBM3", limit).memory_bytes == limit
    named = DeviceConfig(preset="h100").resolve("cpu", limit)  # planning for another cluster
    assert named == DEVICE_PRESETS["h100"]
    given = DeviceConfig(memory_gib=40, peak_flops=5e14).resolve("NVIDIA H100 80GB HBM3", limit)
    assert (given.memory_bytes, given.peak_flops) == (40 * 2**30, 5e14)
    assert given.memory_bandwidth == DEVICE_PRESETS["h100"].memory_bandwidth


def test_an_unknown_kind_names_every_key_to_set_and_runs_once_they_are():
    with pytest.raises(ConfigError) as e:
        DeviceConfig(peak_flops=1e15).resolve("TPU v5 lite")
    message = str(e.value)
    assert "'TPU v5 lite' has no preset" in message and "\n" not in message
    missing = [k for k in MANUAL_KEYS if k != "peak_flops"]
    assert all(f"device.{k}" in message for k in missing) and "device.peak_flops" not in message
    full = dict.fromkeys(MANUAL_KEYS, 1e11) | {"devices_per_host": 4, "memory_gib": 16}
    spec = DeviceConfig(**full).resolve("TPU v5 lite", 15e9)
    assert (spec.name, spec.memory_bytes, spec.devices_per_host) == ("TPU v5 lite", 16 * 2**30, 4)


def test_the_section_takes_a_preset_name_as_shorthand():
    from dflop_jax.runtime.config import TrainConfig

    demo = REPO / "configs" / "demo.yaml"
    assert load_config(TrainConfig, demo).device == DeviceConfig()  # auto by default
    cfg = load_config(TrainConfig, demo, ["device=h200", "device.memory_gib=100"])
    assert cfg.device == DeviceConfig(preset="h200", memory_gib=100)
    with pytest.raises(ConfigError, match=r"^device.preset='v100': use one of \['auto', 'h100'"):
        load_config(TrainConfig, demo, ["device=v100"])


def test_on_this_host_auto_is_the_cpu_preset():
    from dflop_jax.programs.devices import run_device

    assert run_device(DeviceConfig()) == DEVICE_PRESETS["cpu"]
    assert run_device(DeviceConfig(preset="a100_40gb")).memory_bytes == 40e9


def test_a_bad_device_is_one_config_error_line_before_jax():
    out = subprocess.run(
        [sys.executable, "-m", "dflop_jax.train", "device.memory_gib=-1"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "config error: device.memory_gib=-1.0: 0 (preset's) or > 0"
    ]


def test_the_xla_attention_path_on_a_gpu_gets_one_hint(monkeypatch):
    """A run on a GPU with the portable XLA attention path is told which kernels exist there; on
    CPU, or with a GPU kernel chosen, nothing is said."""
    import types

    import jax

    from dflop_jax.programs.devices import attention_hint

    assert attention_hint("xla") is None  # this host: CPU
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    monkeypatch.setattr(jax, "local_devices", lambda: [gpu])
    hint = attention_hint("xla")
    assert hint and "model.attention_impl=pallas" in hint and "cudnn" in hint
    assert attention_hint("pallas") is None and attention_hint("cudnn") is None
