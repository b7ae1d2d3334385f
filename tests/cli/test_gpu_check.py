"""`scripts/gpu_check.sh`, the project's one GPU run, kept from rotting: its dry mode on CPU.

The full dry run (tiny sizes, JAX on CPU) must run every step and bring back every file, each small;
a deadline too short for any step must skip each one and say so; the demo's figures are recomputed
from a hand-written metrics file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = ["preflight", "pytest_gpu", "demo", "bench_stage", "bench_attention", "bench_host",
         "bench_profiler", "bench_colocated"]  # fmt: skip
MAX_FILES, MAX_BYTES = 8, 200_000  # env.log (written by the GPU machine's device_env.sh) is the 8th


def _load_helper():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_check


def _run(tmp_path, deadline: int, timeout: int):
    out = tmp_path / "out"
    env = {**os.environ, "PY": sys.executable, "OUT": str(out), "GPU_CHECK_DRY": "1",
           "GPU_CHECK_DEADLINE": str(deadline), "GPU_CHECK_WORK": str(tmp_path / "work")}  # fmt: skip
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) < MAX_FILES, files
    for p in out.iterdir():
        assert 0 < p.stat().st_size <= MAX_BYTES, (p.name, p.stat().st_size)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry"] is True and "not GPU figures" in summary["note"]
    assert [s["step"] for s in summary["steps"]] == STEPS
    return out, files, summary


def test_a_deadline_too_short_skips_every_step_and_says_so(tmp_path):
    out, files, summary = _run(tmp_path, deadline=3, timeout=120)
    assert files == ["check.log", "summary.json"]
    log = (out / "check.log").read_text()
    for s in summary["steps"]:
        assert s["status"] == "skipped" and s["reason"].startswith("deadline"), s
        assert f"== {s['step']}: skipped: needs >= " in log


# Eight jax processes, a demo profiled, planned and trained: 8-10 min on 2 idle cores, 20 when the
# other xdist worker and other jobs load them (bench colocated, the last step, then met the deadline).
@pytest.mark.slow
@pytest.mark.long
def test_dry_run_runs_every_step_and_writes_every_file(tmp_path):
    _check_full_run(*_run(tmp_path, deadline=1800, timeout=2100))


def _check_full_run(out, files, summary):
    failed = {s["step"]: s for s in summary["steps"] if s["status"] != "ok"}
    assert not failed, (failed, (out / "check.log").read_text()[-4000:])
    assert files == ["bench.json", "bench.log", "check.log", "demo.json", "demo.log",
                     "pytest_gpu.log", "summary.json"]  # fmt: skip
    pre = summary["preflight"]
    assert pre["ok"] and pre["jax"]["platform"] == "cpu" and pre["jax"]["matmul_bf16"]["tflops"] > 0
    assert pre["jax"]["num_devices"] == 1  # as on the one-GPU machine
    assert {" ".join(e["module"].split()[:2]) for e in pre["entry_points"]} >= {
        "dflop_jax.train",
        "dflop_jax.plan",
        "dflop_jax.bench gpu",
        "dflop_jax.bench colocated",
    }
    assert all(e["rc"] == 0 for e in pre["entry_points"]), pre["entry_points"]
    demo = json.loads((out / "demo.json").read_text())
    assert demo["steps"] == 3 and demo["step_time_s"] > 0 and demo["tokens_per_s"] > 0
    # the demo's MFU is against the preflight's peak (on CPU: the measured one, named as such)
    assert pre["peak"]["peak_flops"] > 0
    assert float(demo["peak_flops"]) == pytest.approx(pre["peak"]["peak_flops"])
    assert summary["demo"]["peak_source"] == pre["peak"]["peak_source"]
    assert demo["profile_timings_s"]["model profile"] > 0 and demo["plan_yaml"]
    bench = json.loads((out / "bench.json").read_text())
    for part in ("attention", "stage", "host", "profiler"):
        assert part in bench[part] and "error" not in bench[part][part], (part, bench[part][part])
    assert bench["attention"]["attention"]["impls"] == ["xla"]
    # one device: one pipeline stage, the encoder colocated in it (the GPU machine's paths)
    assert bench["host"]["host"]["pipeline_stages"] == 1
    assert bench["profiler"]["profiler"]["stage_dp"] == [1]
    assert bench["colocated"] and all(r["colocated_s"] > 0 for r in bench["colocated"])
    assert "passed" in (out / "pytest_gpu.log").read_text() or "skipped" in (
        out / "pytest_gpu.log").read_text()  # fmt: skip


def test_demo_figures_from_a_metrics_file(tmp_path):
    helper = _load_helper()
    rows = [
        {"step": 1, "loss": 5.0, "step_time_s": 60.0, "tokens_per_s": 1.0, "mfu": 0.0001,
         "data_wait_s": 0.5, "dispatch_s": 59.0, "recompiles": 4, "predicted_step_time_s": 1.0},
        {"step": 2, "loss": 4.0, "step_time_s": 1.0, "tokens_per_s": 100.0, "mfu": 0.1,
         "data_wait_s": 0.0, "dispatch_s": 0.1, "recompiles": 1, "predicted_step_time_s": 1.5},
        {"step": 3, "loss": 3.0, "step_time_s": 3.0, "tokens_per_s": 300.0, "mfu": 0.3,
         "data_wait_s": 0.2, "dispatch_s": 0.3, "recompiles": 0, "predicted_step_time_s": 2.5,
         "pred_raw_mape": 0.4, "pred_corrected_mape": 0.2, "correction_observations": 6},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "config.yaml").write_text("steps: 3\ndevice:\n  peak_flops: 9.89e+14\n")
    d = helper.demo_figures(tmp_path)
    # steady steps: 2 and 3 (the first compiles)
    assert d["steps"] == 3 and d["first_step_s"] == 60.0
    assert d["step_time_s"] == 2.0 and d["tokens_per_s"] == 200.0 and d["mfu"] == pytest.approx(0.2)
    assert d["dispatch_fraction"] == pytest.approx(0.2 / 2.0)
    assert d["compiles_after_step_1"] == 1
    assert d["predicted_over_measured"] == pytest.approx(2.0 / 2.0)
    assert (d["stage_time_mape_raw"], d["stage_time_mape_corrected"]) == (0.4, 0.2)
    assert d["peak_flops"] == "9.89e+14" and d["profile_timings_s"] is None
    assert helper.demo_figures(tmp_path / "missing") is None


def test_bench_gpu_stage_variants_and_options():
    from dflop_jax.bench import gpu

    assert gpu._stage_variants(("xla",), ("none",), ("all",)) == [
        ("llm", "xla", "none", "all"),
        ("encoder", "xla", "none", "all"),
    ]
    # with a fused kernel: the LLM per implementation under the first residual policy, then on the
    # kernel its other residual policies, the encoder per implementation, the LLM's remat policies
    assert gpu._stage_variants(("xla", "cudnn"), ("none", "full", "dots"), ("all", "recompute")) == [
        ("llm", "xla", "none", "all"), ("llm", "cudnn", "none", "all"),
        ("llm", "cudnn", "none", "recompute"), ("encoder", "xla", "none", "all"),
        ("encoder", "cudnn", "none", "all"), ("llm", "cudnn", "full", "all"),
        ("llm", "cudnn", "dots", "all")]  # fmt: skip
    # executed over model FLOPs: 3 forwards' worth, plus each forward the backward runs again
    assert gpu.hardware_factor("all", "none") == 1.0
    assert gpu.hardware_factor("all", "full") == 1.0
    assert gpu.hardware_factor("layers", "none") == pytest.approx(4 / 3)
    assert gpu.hardware_factor("recompute", "dots") == pytest.approx(4 / 3)
    assert gpu.hardware_factor("recompute", "full") == pytest.approx(5 / 3)
    from dflop_jax.config import ConfigError, load_config

    cfg = load_config(gpu.GpuBenchConfig, None, ["remat=none,dots", "residuals=all,layers",
                                                 "attention=pallas"])  # fmt: skip
    assert (cfg.remat, cfg.residuals, cfg.attention) == (("none", "dots"), ("all", "layers"),
                                                         ("pallas",))  # fmt: skip
    for bad in ("remat=none,sometimes", "residuals=some", "attention=flash"):
        with pytest.raises(ConfigError, match=bad.split("=")[0] + "="):
            load_config(gpu.GpuBenchConfig, None, [bad])
    # on CPU only XLA runs; the others say why
    impls, missing = gpu.attention_impls({"gpu": False})
    assert impls == ("xla",) and set(missing) == {"cudnn", "pallas"}
    assert gpu.attention_impls({"gpu": False}, ("pallas",)) == ((), {"pallas": "needs a GPU"})


def test_bench_gpu_probe_keeps_an_implementation_that_runs():
    """The GPU path's probe, on CPU: the Pallas kernels run here (interpret mode), so the probe keeps
    them; cuDNN cannot start without a GPU and is reported with the reason. The probe measures one
    implementation alone (no XLA result to compare with)."""
    from dflop_jax.bench import gpu

    impls, missing = gpu.attention_impls({"gpu": True}, ("pallas", "cudnn"))
    assert impls == ("pallas",) and list(missing) == ["cudnn"]
    assert missing["cudnn"].startswith("fails here: ") and "cuDNN" in missing["cudnn"]
