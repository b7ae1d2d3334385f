"""The Python half of `scripts/gpu_check.sh`: the preflight step, and the files it brings back.

    python scripts/gpu_check.py preflight --out WORK/preflight.json [--matmul 8192]
    python scripts/gpu_check.py summary --work WORK --out OUT [--dry 0|1]

preflight: versions, the devices JAX sees, `nvidia-smi`, that every entry point imports (`--help` of
each, in parallel subprocesses), and one bf16 matmul's time and TFLOP/s. Exit 1 when any of them failed.
summary: `OUT/summary.json` (the steps' statuses, the preflight, the demo's headline figures),
`OUT/demo.json` (the demo's per-step metrics, plan and profile timings) and `OUT/bench.json` (the
`bench gpu` parts and `bench colocated`), from what the steps left in WORK. Standard library only, so it
runs whatever state the steps left.
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
STEP_FILES = {"demo": "demo.json", "bench": "bench.json", "summary": "summary.json"}


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
        # The peak MFU is measured against (the demo is given it): the GPU's `costs.devices` preset.
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


def summary(work: Path, out: Path, dry: bool) -> int:
    steps = []
    results = work / "steps.jsonl"
    if results.exists():
        steps = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    demo = demo_figures(work / "demo")
    bench = {p.stem.removeprefix("bench_gpu_"): _read_json(p)
             for p in sorted(work.glob("bench_gpu_*.json"))}  # fmt: skip
    bench["colocated"] = _read_json(work / "bench_colocated.json")
    preflight = _read_json(work / "preflight.json")
    headline = None
    if demo is not None:
        headline = {k: v for k, v in demo.items() if k not in ("per_step", "plan_yaml")}
        headline["peak_source"] = ((preflight or {}).get("peak") or {}).get("peak_source")
    report = {
        "dry": dry,
        "note": "CPU dry run: figures are not GPU figures" if dry else None,
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "steps": steps,
        "preflight": preflight,
        "demo": headline,
        "bench_parts": {k: sorted(v) if isinstance(v, dict) else None for k, v in bench.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / STEP_FILES["summary"]).write_text(json.dumps(report, indent=1))
    if demo is not None:
        (out / STEP_FILES["demo"]).write_text(json.dumps(demo, indent=1))
    if any(v is not None for v in bench.values()):
        (out / STEP_FILES["bench"]).write_text(json.dumps(bench, indent=1))
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
