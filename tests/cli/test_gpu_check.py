"""`scripts/gpu_check.sh`, the project's one GPU run, kept from rotting: its dry mode on CPU.

The full dry run (tiny sizes, JAX on CPU) must run every step and bring back every file, each small;
a deadline too short for any step must skip each one and say so; the summary's figures are recomputed
from hand-written metrics and part reports (a step cut short keeps what it wrote).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# In the order they run: the figures no GPU run has measured yet first (`scripts/gpu_check.sh`).
STEPS = ["preflight", "llm_attention", "vision_ops", "model", "model_blind", "host", "pytest_gpu",
         "demo", "bench_stage", "bench_attention", "bench_profiler", "bench_colocated"]  # fmt: skip
FILES = [
    "bench.json",
    "check.log",
    "console.log",
    "pytest_gpu.log",
    "summary.json",
    "vision_ops.md",
]
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


# Twelve steps, most of them jax processes; two training runs of the real-model config (the tiny arch)
# and the demo profiled, planned and trained: about 10 min on 2 cores beside other work.
@pytest.mark.slow
@pytest.mark.long
def test_dry_run_runs_every_step_and_writes_every_file(tmp_path):
    _check_full_run(*_run(tmp_path, deadline=1800, timeout=2100))


def _check_full_run(out, files, summary):
    failed = {s["step"]: s for s in summary["steps"] if s["status"] != "ok"}
    assert not failed, (failed, (out / "check.log").read_text()[-4000:])
    assert files == FILES
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
    bench = json.loads((out / "bench.json").read_text())
    demo = bench["demo"]
    assert demo["steps"] == 3 and demo["step_time_s"] > 0 and demo["tokens_per_s"] > 0
    # the demo's MFU is against the preflight's peak (on CPU: the measured one, named as such)
    assert pre["peak"]["peak_flops"] > 0
    assert float(demo["peak_flops"]) == pytest.approx(pre["peak"]["peak_flops"])
    assert summary["demo"]["peak_source"] == pre["peak"]["peak_source"]
    assert demo["profile_timings_s"]["model profile"] > 0 and demo["plan_yaml"]
    for step, part in [("llm_attention", "stage"), ("vision_ops", "ops"), ("model", "model"),
                       ("model_blind", "model_blind"), ("host", "host"), ("stage", "stage"),
                       ("attention", "attention"), ("profiler", "profiler")]:  # fmt: skip
        assert "error" not in bench[step][part], (step, bench[step][part])
    assert bench["attention"]["attention"]["impls"] == ["xla"]
    # (a) the LLM stage per kernel: on CPU XLA only, and auto's pick named
    llm = summary["llm_attention"]
    assert [r["attention"] for r in llm["rows"]] == ["xla"] and llm["rows"][0]["mfu"] > 0
    assert llm["auto"] == {"llm": "xla", "vision": "xla"}
    # (b) the tower's ops, the table brought back as a file
    ops = summary["vision_ops"]
    assert ops["source"] == "cpu threads" and len(ops["top5"]) == 5
    table = (out / "vision_ops.md").read_text()
    assert all(r["op"] in table for r in ops["top5"]) and "not GPU figures" in table
    # (c) the real model's step, then the data-blind arm's over it
    model, blind = summary["model"], summary["model_blind"]
    assert model["llm_layers"] == 2 and model["tokens_per_s"] > 0 and "partial" not in model
    assert model["programs_after_precompile"] == 0 and model["stage_time_mape_raw"] is not None
    assert model["memory"]["compiled_gib"] > 0 and model["memory"]["predicted_gib"] > 0
    assert blind["dflop_over_blind"] == pytest.approx(model["tokens_per_s"] / blind["tokens_per_s"])
    # (d) the host's share of a pipelined decoder's step
    assert 0 < summary["host"]["dispatch_fraction"] < 1
    # one device: one pipeline stage, the encoder colocated in it (the GPU machine's paths)
    assert bench["host"]["host"]["pipeline_stages"] == 1
    assert bench["profiler"]["profiler"]["stage_dp"] == [1]
    assert bench["colocated"] and all(r["colocated_s"] > 0 for r in bench["colocated"])
    assert "passed" in (out / "pytest_gpu.log").read_text() or "skipped" in (
        out / "pytest_gpu.log").read_text()  # fmt: skip
    console = (out / "console.log").read_text()
    assert "==== model\n" in console and "skipping sample" not in console


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
    from dflop_jax.bench.gpu import stage_programs as stage

    assert stage._stage_variants(("xla",), ("none",), ("all",)) == [
        ("llm", "xla", "none", "all"),
        ("encoder", "xla", "none", "all"),
    ]
    # with a fused kernel: the LLM per implementation under the first residual policy, then on the
    # kernel its other residual policies, the encoder per implementation, the LLM's remat policies
    assert stage._stage_variants(("xla", "cudnn"), ("none", "full", "dots"), ("all", "recompute")) == [
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


def test_the_summary_keeps_what_a_step_cut_short_left(tmp_path):
    """The model step timed out mid-training (no part report): its figures come from its run's
    metrics.jsonl, marked partial; the LLM stage part was cut after one kernel's row (its JSON says
    partial) and one kernel failed; the tower's table comes back as its own file."""
    helper = _load_helper()
    work, out = tmp_path / "work", tmp_path / "out"
    run = work / "bench_runs" / "model_run"
    run.mkdir(parents=True)
    rows = [{"step": 1, "loss": 9.0, "step_time_s": 80.0, "tokens_per_s": 50.0, "mfu": 0.01,
             "dispatch_s": 1.0, "recompiles": 12, "data_wait_s": 0.0},
            {"step": 2, "loss": 8.0, "step_time_s": 2.0, "tokens_per_s": 4000.0, "mfu": 0.4,
             "dispatch_s": 0.1, "recompiles": 0, "data_wait_s": 0.002}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "device_memory.json").write_text('{"step": 2, "measured_peak_gib": 61.5}')
    (work / "steps.jsonl").write_text(json.dumps({"step": "model", "status": "timeout"}) + "\n")
    stage = {"partial": True, "auto": {"llm": "cudnn", "vision": "cudnn"}, "stages": [
        {"module": "llm", "attention": "xla", "step_s": 0.3, "mfu": 0.16},
        {"module": "llm", "attention": "cudnn", "error": "XlaRuntimeError: out of memory"}]}  # fmt: skip
    (work / "bench_gpu_llm_attention.json").write_text(json.dumps({"stage": stage}))
    top = [{"op": f"fusion.{i}", "program": "bwd", "hlo": "fusion kLoop", "ms_per_step": 1.0,
            "share": 0.1, "kernel": "k"} for i in range(6)]  # fmt: skip
    ops = {"top": top, "table_md": "| # | op |\n| 1 | fusion.0 |\n", "source": "gpu streams"}
    (work / "bench_gpu_vision_ops.json").write_text(json.dumps({"ops": ops}))
    assert helper.summary(work, out, dry=False) == 0
    summary = json.loads((out / "summary.json").read_text())
    model = summary["model"]
    assert model["partial"].startswith("the step did not finish") and model["steps"] == 2
    assert model["tokens_per_s"] == 4000.0 and model["compiles_after_step_1"] == 0
    assert model["memory"] == {"step": 2, "measured_peak_gib": 61.5}
    assert summary["model_blind"] is None
    llm = summary["llm_attention"]
    assert llm["partial"] and llm["auto"]["llm"] == "cudnn"
    assert llm["rows"][0] == {"attention": "xla", "step_ms": 300.0, "mfu": 0.16}
    assert llm["rows"][1]["error"].startswith("XlaRuntimeError")
    assert [r["op"] for r in summary["vision_ops"]["top5"]] == [f"fusion.{i}" for i in range(5)]
    assert (out / "vision_ops.md").read_text() == ops["table_md"]
    bench = json.loads((out / "bench.json").read_text())
    assert set(bench) == {"llm_attention", "vision_ops", "colocated"}
