"""The Python half of `scripts/gpu_check.sh`: the preflight step, and the files it brings back.

    python scripts/gpu_check.py preflight --out WORK/preflight.json [--matmul 8192]
    python scripts/gpu_check.py summary --work WORK --out OUT [--dry 0|1]

preflight: versions, the devices JAX sees, `nvidia-smi`, that every entry point imports (`--help` of
each, in parallel subprocesses), and one bf16 matmul's time and TFLOP/s. Exit 1 when any of them failed.
summary: `OUT/summary.json` (the steps' statuses, the preflight, each measuring step's headline
figures), `OUT/bench.json` (each `bench gpu` step's report, `bench colocated`'s, the demo's per-step
metrics, plan and profile timings) and `OUT/vision_ops.md` (the vision tower's per-op table), from what
the steps left in WORK; a step cut short keeps what it wrote (the model steps' figures then come from
their runs' metrics.jsonl, marked partial). Standard library only, so it runs whatever state the steps
left.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata as md
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax",
            "optax", "orbax-checkpoint", "numpy", "grain", "ortools", "protobuf", "pytest")  # fmt: skip
# Every `python -m` entry point of the project (the modules with a `__main__` guard) and the two
# benchmarks the check runs.
ENTRY_POINTS = (("dflop_jax.train",), ("dflop_jax.plan",), ("dflop_jax.profile",),
                ("dflop_jax.schedule",), ("dflop_jax.simulate",), ("dflop_jax.export",),
                ("dflop_jax.costs",), ("dflop_jax.bench",), ("dflop_jax.bench", "gpu"),
                ("dflop_jax.bench", "colocated"))  # fmt: skip
OUT_FILES = {"summary": "summary.json", "bench": "bench.json", "ops": "vision_ops.md"}
# `scripts/gpu_check.sh` steps that run one `bench gpu` part (WORK/bench_gpu_<step>.json) -> the part.
BENCH_STEPS = {"llm_attention": "stage", "vision_ops": "ops", "model": "model",
               "model_blind": "model_blind", "host": "host", "stage": "stage",
               "attention": "attention", "profiler": "profiler"}  # fmt: skip
# The run folder each model step trains in (under WORK/bench_runs: `bench gpu`'s out).
MODEL_RUNS = {"model": "model_run", "model_blind": "model_blind_run"}


# ------------------------------------------------------------------------------------------ preflight


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not found"}
    query = "name,memory.total,driver_version,clocks.max.sm,power.limit"
    try:
        r = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"query": query, "rc": r.returncode, "gpus": r.stdout.strip().splitlines()}


def _entry_point(mod: tuple[str, ...]) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", *mod, "--help"], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        rc, err = r.returncode, (r.stderr.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        rc, err = 124, "timed out after 120 s"
    return {"module": " ".join(mod), "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            **({"error": err[:300]} if rc else {})}  # fmt: skip


def entry_points() -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2) // 2))) as ex:
        return list(ex.map(_entry_point, ENTRY_POINTS))


def devices_and_matmul(n: int, runs: int = 10) -> dict:
    """The devices JAX sees and one n x n bf16 matmul's median time (fp32 accumulation)."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    out = {"backend": jax.default_backend(), "platform": dev.platform,
           "device_kind": dev.device_kind, "num_devices": len(jax.devices())}  # fmt: skip
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats:
        out["memory_limit_bytes"] = stats.get("bytes_limit")
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    for _ in range(2):
        jax.block_until_ready(f(a, a))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    out["matmul_bf16"] = {"n": n, "median_s": t, "tflops": 2 * n**3 / t / 1e12, "runs": runs}
    return out


def preflight(out_path: Path, n: int) -> int:
    report: dict = {"versions": versions(), "nvidia_smi": nvidia_smi(),
                    "jax_platforms": os.environ.get("JAX_PLATFORMS")}  # fmt: skip
    report["entry_points"] = entry_points()
    try:
        report["jax"] = devices_and_matmul(n)
        # The peak MFU is measured against (the demo is given it): the GPU's `costs.device_specs` preset.
        from dflop_jax.bench.gpu import device_info

        info = device_info()
        report["peak"] = {k: info[k] for k in ("gpu_name", "peak_flops", "peak_source")}
    except Exception as e:  # a JAX that cannot start is what the preflight is there to report
        report["jax"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    failed = [e["module"] for e in report["entry_points"] if e["rc"]]
    report["ok"] = not failed and "error" not in report["jax"]
    out_path.write_text(json.dumps(report, indent=1))
    print(json.dumps({"ok": report["ok"], "entry_points_failed": failed, "jax": report["jax"],
                      "versions": report["versions"]}, indent=1))  # fmt: skip
    return 0 if report["ok"] else 1


# -------------------------------------------------------------------------------------------- summary


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


STEP_KEYS = ("step", "loss", "step_time_s", "tokens_per_s", "mfu", "data_wait_s", "dispatch_s",
             "recompiles", "microbatches", "llm_padding_ratio", "tile_padding_ratio",
             "predicted_step_time_s", "stage_times_measured", "pred_raw_mape",
             "pred_corrected_mape", "correction_observations")  # fmt: skip


def demo_figures(run_dir: Path) -> dict | None:
    """The demo's figures from its run directory: steady-step medians (steps after the first),
    compilations after step 1, predicted vs measured step time, the stage-time MAPEs the trainer
    reports (raw and corrected), the plan and the profile's timings."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    if not rows:
        return None
    steady = rows[1:] or rows
    last = rows[-1]
    step_s, disp_s = _median(steady, "step_time_s"), _median(steady, "dispatch_s")
    pred_s = _median(steady, "predicted_step_time_s")
    plan = run_dir / "auto_plan" / "plan.yaml"
    config = run_dir / "config.yaml"
    peak = None
    if config.exists():
        # the resolved config's `device:` section (`peak_flops:` under it; 0.0 = the preset's)
        peak = next((ln.split(":", 1)[1].strip() for ln in config.read_text().splitlines()
                     if ln.strip().startswith("peak_flops:")), None)  # fmt: skip
    return {
        "steps": len(rows),
        "first_loss": rows[0].get("loss"),
        "final_loss": last.get("loss"),
        "first_step_s": rows[0].get("step_time_s"),
        "step_time_s": step_s,
        "tokens_per_s": _median(steady, "tokens_per_s"),
        "mfu": _median(steady, "mfu"),
        "peak_flops": peak,
        "data_wait_s": _median(steady, "data_wait_s"),
        "dispatch_s": disp_s,
        "dispatch_fraction": disp_s / step_s if disp_s is not None and step_s else None,
        "compiles_after_step_1": sum(r.get("recompiles", 0) for r in rows[1:]),
        "predicted_step_time_s": pred_s,
        "predicted_over_measured": pred_s / step_s if pred_s is not None and step_s else None,
        "stage_time_mape_raw": last.get("pred_raw_mape"),
        "stage_time_mape_corrected": last.get("pred_corrected_mape"),
        "correction_observations": last.get("correction_observations"),
        "profile_timings_s": _read_json(run_dir / "auto_plan" / "timings.json"),
        "plan_yaml": plan.read_text()[:4000] if plan.exists() else None,
        "per_step": [{k: r.get(k) for k in STEP_KEYS} for r in rows],
    }


def _part(bench: dict, step: str):
    """The part report of a `bench gpu` step's JSON (None when absent)."""
    return (bench.get(step) or {}).get(BENCH_STEPS[step])


def llm_attention_figures(part: dict | None) -> dict | None:
    """Per LLM stage row: kernel, step ms and MFU (or its error), and what `auto` picks."""
    if not part or "stages" not in part:
        return part
    rows = [{"attention": r["attention"], "step_ms": r.get("step_s", 0) * 1e3 or None,
             "mfu": r.get("mfu"), **({"error": r["error"][:300]} if "error" in r else {})}
            for r in part["stages"] if r.get("module") == "llm"]  # fmt: skip
    return {"rows": rows, "auto": part.get("auto"), "partial": bool(part.get("partial"))}


def vision_ops_figures(part: dict | None) -> dict | None:
    """The tower's step times, op time per step and its 5 most expensive ops."""
    if not part or "top" not in part:
        return part
    keys = (
        "tiles",
        "tokens_per_tile",
        "attention",
        "fwd_s",
        "bwd_s",
        "op_ms_per_step",
        "source",
        "ops",
    )
    top = [
        {k: r[k] for k in ("op", "program", "hlo", "ms_per_step", "share")} for r in part["top"][:5]
    ]
    return {**{k: part.get(k) for k in keys}, "top5": top}


def model_figures(step: str, part: dict | None, work: Path) -> dict | None:
    """The model step's report; where the step left none, its run's metrics.jsonl figures and the
    device memory its last logged step saw (device_memory.json), marked partial."""
    if part and "error" not in part:
        return part
    figures = demo_figures(work / "bench_runs" / MODEL_RUNS[step])
    if figures is None:
        return part
    figures = {k: v for k, v in figures.items() if k not in ("per_step", "plan_yaml")}
    memory = _read_json(work / "bench_runs" / MODEL_RUNS[step] / "device_memory.json")
    return {"partial": "the step did not finish: figures from its metrics.jsonl (steps after the "
                       "first)", **({"error": part["error"]} if part else {}), **figures,
            **({"memory": memory} if memory else {})}  # fmt: skip


def summary(work: Path, out: Path, dry: bool) -> int:
    steps = []
    results = work / "steps.jsonl"
    if results.exists():
        steps = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    demo = demo_figures(work / "demo")
    bench = {step: _read_json(work / f"bench_gpu_{step}.json") for step in BENCH_STEPS}
    bench = {k: v for k, v in bench.items() if v is not None}
    bench["colocated"] = _read_json(work / "bench_colocated.json")
    preflight = _read_json(work / "preflight.json")
    headline = None
    if demo is not None:
        headline = {k: v for k, v in demo.items() if k not in ("per_step", "plan_yaml")}
        headline["peak_source"] = ((preflight or {}).get("peak") or {}).get("peak_source")
    host = _part(bench, "host") if "host" in bench else None
    ops = _part(bench, "vision_ops") if "vision_ops" in bench else None
    report = {
        "dry": dry,
        "note": "CPU dry run: figures are not GPU figures" if dry else None,
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": steps,
        "preflight": preflight,
        "llm_attention": llm_attention_figures(_part(bench, "llm_attention"))
        if "llm_attention" in bench
        else None,
        "vision_ops": vision_ops_figures(ops),
        "model": model_figures("model", _part(bench, "model"), work),
        "model_blind": model_figures("model_blind", _part(bench, "model_blind"), work),
        "host": {k: v for k, v in host.items() if k != "steps"} if host else None,
        "demo": headline,
        "bench_parts": {k: sorted(v) if isinstance(v, dict) else None for k, v in bench.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / OUT_FILES["summary"]).write_text(json.dumps(report, indent=1))
    if demo is not None:
        bench["demo"] = demo
    if any(v is not None for v in bench.values()):
        (out / OUT_FILES["bench"]).write_text(json.dumps(bench, indent=1))
    if ops and ops.get("table_md"):
        (out / OUT_FILES["ops"]).write_text(ops["table_md"])
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("preflight")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--matmul", type=int, default=8192, help="matmul size n (n x n bf16)")
    s = sub.add_parser("summary")
    s.add_argument("--work", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--dry", default="0")
    args = ap.parse_args(argv)
    if args.cmd == "preflight":
        return preflight(args.out, args.matmul)
    return summary(args.work, args.out, args.dry == "1")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
