"""`python -m dflop_jax.bench gpu` on CPU (the CI smoke test) and, on a GPU only, cuDNN vs XLA attention.

The smoke test runs every part in-process at the small size and checks the figures from the JSON
against independent recomputations: attention FLOPs from the segment lengths, the XLA path's parity
with a dense fp32 reference, MFU = model FLOPs / (step x peak), MAPE from the (predicted, measured) pairs.
"""

import json

import numpy as np
import pytest

from dflop_jax.bench import gpu


def _run(out, capsys, parts):
    path = out / f"{parts.replace(',', '_')}.json"
    argv = [f"parts={parts}", "size=smoke", f"out={out}", f"json_out={path}", "warmup=0", "runs=1"]
    rc = gpu.main(argv)
    report = json.loads(path.read_text())
    assert rc == 0, {p: report[p]["error"] for p in parts.split(",") if "error" in report[p]}
    return report, capsys.readouterr().out


def _labelled(text: str, header: str) -> None:
    lines = [x for x in text.splitlines() if x.startswith(header)]
    assert lines and all(gpu.CPU_BANNER in x for x in lines), lines


def test_attention_and_stage_parts(tmp_path, capsys):
    report, text = _run(tmp_path, capsys, "attention,stage")
    assert text.splitlines()[0] == gpu.CPU_BANNER and report["banner"] == gpu.CPU_BANNER
    _labelled(text, "## ")
    att = report["attention"]
    assert att["impls"] == ["xla"] and "only the XLA path ran" in att["note"]
    h, _, dh = att["heads"]
    assert {(c["length"], c["samples"]) for c in att["cases"]} == {
        (n, s) for n in gpu.SIZES["smoke"].attn_lengths for s in (1, 16)
    }
    for c in att["cases"]:
        seg = c["length"] // c["samples"]
        assert c["fwd_flops"] == 4 * dh * h * c["samples"] * seg * (seg + 1) / 2
        r = c["impls"]["xla"]
        assert r["fwd_tflops"] == pytest.approx(c["fwd_flops"] / r["fwd_s"] / 1e12)
        # bf16 XLA path vs the dense fp32 reference: close, but not bit-equal (it is bf16)
        assert 0 < r["vs_fp32"]["out"] <= gpu.ATTN_TOL["out"]
        assert 0 < r["vs_fp32"]["grad"] <= gpu.ATTN_TOL["grad"]
        assert "cudnn" not in c["impls"] and "cudnn_vs_xla" not in c
    stage = report["stage"]
    peak = report["device"]["peak_flops"]
    assert stage["peak_flops"] == peak and "'cpu'" in report["device"]["peak_source"]
    llm, vit = stage["stages"]
    # tiny LLM: D=64, H=4, K=2, Dh=16, I=128; 2 layers, one 128-token sample, 3x forward
    n, d, ff = 128, 64, 128
    linear = 2 * n * (d * 64 + 2 * d * 32 + 64 * d + 3 * d * ff)
    assert llm["bucket"] == n and llm["stage"] == "llm 2 layers"
    assert llm["model_flops"] == pytest.approx(3 * 2 * (linear + 4 * 16 * 4 * n * (n + 1) / 2))
    for r in (llm, vit):
        assert r["step_s"] == pytest.approx(r["fwd_s"] + r["bwd_s"])
        assert r["mfu"] == pytest.approx(r["model_flops"] / (r["step_s"] * peak))
        # timed as trained under "all" (CPU's default): a backward from residuals runs no forward
        assert r["residuals"] == "all" and r["hfu"] == pytest.approx(r["mfu"])
    assert ("misses goal: LLM stage MFU" in text) == (llm["mfu"] < gpu.GOAL_LLM_MFU)


@pytest.mark.slow  # over a minute in the fast tier (CI's second tier runs it)
def test_profiler_and_host_parts(tmp_path, capsys):
    report, text = _run(tmp_path, capsys, "profiler,host")
    _labelled(text, "## ")
    prof = report["profiler"]
    pairs = prof["pairs"]
    assert pairs and all(p["measured"] > 0 and p["raw"] > 0 for p in pairs)
    err = lambda key: np.mean([abs(p[key] - p["measured"]) / p["measured"] for p in pairs])  # noqa: E731
    assert prof["mape_raw"][0] == pytest.approx(err("raw"))
    assert prof["mape_corrected"][0] == pytest.approx(err("corrected"))
    # the trainer's own figure (the scheduler's window over its last 64 microbatches, weighted equally)
    assert len(pairs) <= 64 * 2 * len({p["stage"] for p in pairs})
    assert prof["scheduler_window_mape"][0] == pytest.approx(prof["mape_raw"][0])
    groups = {(p["stage"], p["bucket"]) for p in pairs}
    assert {(r["stage"], r["bucket"]) for r in prof["per_stage_bucket"]} == groups
    assert sum(r["n"] for r in prof["per_stage_bucket"]) == len(pairs)
    assert {p["module"] for p in pairs} == {"encoder", "llm"}
    grid = prof["profiled_buckets"]
    outside = {(p["module"], p["bucket"]) for p in pairs
               if not min(grid[p["module"]]) <= p["bucket"] <= max(grid[p["module"]])}  # fmt: skip
    assert {tuple(x) for x in prof["outside_profiled"]} == outside
    assert all(f"{m} {b}" in text for m, b in outside) or "misses goal: raw" not in text
    assert ("misses goal: raw MAPE" in text) == (prof["mape_raw"][0] > gpu.GOAL_RAW_MAPE)
    host = report["host"]
    assert host["pipeline_stages"] == 2 and len(host["steps"]) == gpu.SIZES["smoke"].steps
    for s in host["steps"]:
        assert 0 < s["dispatch_s"] < s["step_time_s"]
    assert host["dispatch_fraction"] == pytest.approx(host["dispatch_s"] / host["step_time_s"])


def test_the_llm_stage_alone_per_kernel_and_what_auto_picks(tmp_path, capsys):
    """`stages=llm` (the GPU check's first measuring step): the LLM stage's rows only; the report
    names the kernels `model.attention_impl: auto` picks here (on CPU: xla)."""
    path = tmp_path / "llm.json"
    argv = ["parts=stage", "stages=llm", "size=smoke", f"out={tmp_path}", f"json_out={path}",
            "warmup=0", "runs=1"]  # fmt: skip
    assert gpu.main(argv) == 0
    stage = json.loads(path.read_text())["stage"]
    assert [(r["module"], r["attention"]) for r in stage["stages"]] == [("llm", "xla")]
    assert stage["auto"] == {"llm": "xla", "vision": "xla"}
    assert "model.attention_impl=auto runs xla in the LLM stage" in capsys.readouterr().out


@pytest.mark.slow  # two training runs of the tiny arch with plan: auto (about a minute on 2 cores)
def test_model_parts_train_the_1gpu_config_both_ways(tmp_path, capsys):
    """The real-model parts at the smoke size: the 1-GPU config (tiny arch, cut to 2 of its 4 decoder
    layers) trained with plan: auto, then the data-blind arm on the same device, data and steps."""
    import yaml

    from dflop_jax.bench.gpu.real_model import arm_figures

    report, text = _run(tmp_path, capsys, "model,model_blind")
    model, blind = report["model"], report["model_blind"]
    size = gpu.SIZES["smoke"]
    assert model["plan"] == "auto" and model["llm_layers"] == 2
    assert model["layout"] == blind["layout"] == "enc@llm0 | llm tp1 pp1 dp1"  # one device
    assert model["steps"] == blind["steps"] == size.model_steps
    assert model["programs_after_precompile"] == 0 and model["compiles_after_step_1"] == 0
    assert model["stage_time_mape_raw"] is not None and model["correction_observations"] >= 1
    mem = model["memory"]
    # the largest program (the weights' bf16 copies among its arguments), the moments, the masters
    assert mem["compiled_gib"] == pytest.approx(
        mem["compiled_program_gib"] + mem["optimizer_state_gib"] + mem["master_params_gib"]
    )
    assert 0 < mem["optimizer_state_gib"] < mem["compiled_gib"] and mem["predicted_gib"] > 0
    assert mem["master_params_gib"] > 0
    assert mem["measured_peak_gib"] is None  # CPU keeps no allocator statistics
    # the figures are those of the runs' metrics; the ratio is the two arms' steady tokens/s
    rows = lambda d: [
        json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
    ]  # noqa: E731
    assert model["tokens_per_s"] == pytest.approx(arm_figures(rows("model_run"))["tokens_per_s"])
    assert blind["dflop_over_blind"] == pytest.approx(model["tokens_per_s"] / blind["tokens_per_s"])
    # the data-blind arm trains the remat its plan priced: the config's (the profiled model's)
    plan = yaml.safe_load((tmp_path / "model_blind_plan.yaml").read_text())
    assert (
        plan["remat"] == {"vision": "full", "llm": "full"} and plan["search"]["mode"] == "uniform"
    )
    assert "DFLOP over data-blind tokens/s" in text


def test_unknown_part_is_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["parts=attention,warp"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("config error: parts=") and "\n" not in err


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_on_gpu():
    """On a GPU: the fused cuDNN path agrees with the XLA path and the fp32 reference on packed rows."""
    for samples in (1, 16):
        row = gpu.attention_case(2048, samples, (8, 2, 64), ("xla", "cudnn"), warmup=0, runs=1)
        assert row["cudnn_vs_xla"]["ok"], row["cudnn_vs_xla"]
        assert row["impls"]["cudnn"]["vs_fp32"]["ok"] and row["impls"]["xla"]["vs_fp32"]["ok"]


@pytest.mark.gpu
def test_pallas_attention_matches_xla_on_gpu():
    """On a GPU: the compiled Pallas kernels agree with the XLA path and the fp32 reference (bf16)."""
    for samples in (1, 16):
        row = gpu.attention_case(2048, samples, (8, 2, 128), ("xla", "pallas"), warmup=0, runs=1)
        assert row["pallas_vs_xla"]["ok"], row["pallas_vs_xla"]
        assert row["impls"]["pallas"]["vs_fp32"]["ok"]
