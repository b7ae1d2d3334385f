"""End-to-end A/B on the real runtime: DFLOP's schedule vs the data-blind schedule, same layout.

    python -m dflop_jax.bench train [--config configs/demo.yaml] [--out runs/bench_train] [key=value ...]

Trains the config twice in this process, on the same devices, data, global batches, seed and plan:
  dflop       the config as given (its `plan`: e.g. the demo's profile -> plan; its scheduler),
  data-blind  the first arm's plan file, `scheduler.solver=data_blind` (loader-order microbatches, each
              at the largest buckets, the smallest allowed count: what a data-blind trainer does).
Checkpoints and in-loop stage timing are off in both arms, so every step is an ordinary step.
Reported per arm, from each run's metrics.jsonl: steady-state throughput (real tokens / s over the
steps that compiled nothing new), the same over all steps (compiles included), mean LLM padding,
microbatches per step, compiles; then the ratios, and the largest per-step loss difference: the loss is
normalized over the global batch, so a different packing of the same samples must give the same loss
(up to bf16 round-off) — a check that scheduling changes speed, not the math.

On CPU the simulated devices share the host's cores, so stages do not overlap: the ratio measures the
work the schedule saves (padding, bucket sizes), not pipeline-bubble savings, which need real devices
(`bench cluster` simulates those).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from dflop_jax.host_devices import simulate_cpu_devices

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
# Both arms: no checkpoint writes, no serialized timing steps (they would add the same noise to both).
COMMON = ["checkpoint.every=0", "measure_stage_times_every=0"]


def arm_summary(metrics_path: Path) -> dict:
    """Throughput and schedule figures of one run from its metrics.jsonl rows."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{metrics_path}: no steps recorded")
    tokens = np.array([r["tokens_per_s"] * r["step_time_s"] for r in rows])
    times = np.array([r["step_time_s"] for r in rows])
    steady = np.array([i > 0 and r["recompiles"] == 0 for i, r in enumerate(rows)])
    return {
        "steps": len(rows),
        "steady_steps": int(steady.sum()),
        "tokens_per_s_steady": float(tokens[steady].sum() / times[steady].sum())
        if steady.any()
        else None,
        "tokens_per_s_all": float(tokens.sum() / times.sum()),
        "step_time_s_median_steady": float(np.median(times[steady])) if steady.any() else None,
        "llm_padding_ratio_mean": float(np.mean([r["llm_padding_ratio"] for r in rows])),
        "encoder_padding_ratio_mean": float(np.mean([r["encoder_padding_ratio"] for r in rows])),
        "microbatches_mean": float(np.mean([r["microbatches"] for r in rows])),
        "compiles": int(rows[-1]["compiles"]),
        "losses": [float(r["loss"]) for r in rows],
    }


def _fresh(run_dir: Path) -> None:
    """Removes a previous run (the trainer would resume it) but keeps a reusable auto-plan cache."""
    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name != "auto_plan":
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def _train(config: Path, overrides: list[str]):
    from dflop_jax.config import load_config
    from dflop_jax.runtime.config import TrainConfig
    from dflop_jax.train import run

    cfg = load_config(TrainConfig, config, overrides)
    _fresh(Path(cfg.run_dir))
    return cfg, run(cfg)


def _plan_file(cfg, run_dir: Path) -> str:
    """The plan the first arm trained with, as a file the second arm can load."""
    if cfg.plan == "auto":
        return str(run_dir / "auto_plan" / "plan.yaml")
    if cfg.plan == "analytic":
        return str(run_dir / "plan.yaml")
    return cfg.plan  # "explicit" (layout keys in the config) or a path: reused as is


def run_ab(config: Path, out: Path, overrides: list[str]) -> dict:
    dflop_dir, blind_dir = out / "dflop", out / "data_blind"
    cfg, _ = _train(config, [*overrides, *COMMON, f"run_dir={dflop_dir}"])
    plan = _plan_file(cfg, dflop_dir)
    blind_overrides = [*overrides, *COMMON, f"run_dir={blind_dir}", "scheduler.solver=data_blind"]
    _train(config, blind_overrides + ([f"plan={plan}"] if plan != "explicit" else []))
    a, b = arm_summary(dflop_dir / "metrics.jsonl"), arm_summary(blind_dir / "metrics.jsonl")
    n = min(len(a["losses"]), len(b["losses"]))
    report = {
        "config": str(config),
        "plan": plan,
        "dflop": a,
        "data_blind": b,
        "speedup_steady": a["tokens_per_s_steady"] / b["tokens_per_s_steady"]
        if a["tokens_per_s_steady"] and b["tokens_per_s_steady"]
        else None,
        "speedup_all_steps": a["tokens_per_s_all"] / b["tokens_per_s_all"],
        "max_loss_diff": float(np.max(np.abs(np.subtract(a["losses"][:n], b["losses"][:n])))),
    }
    (out / "bench_train.json").write_text(json.dumps(report, indent=1))
    return report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _print(report: dict) -> None:
    print(f"\nplan: {report['plan']}")
    print("| arm | tokens/s steady | tokens/s all steps | step s (median, steady) | LLM padding | "
          "encoder padding | microbatches | compiles |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in ("dflop", "data_blind"):
        r = report[name]
        cells = [name, _fmt(r["tokens_per_s_steady"], ".0f"), _fmt(r["tokens_per_s_all"], ".0f"),
                 _fmt(r["step_time_s_median_steady"], ".2f"), _fmt(r["llm_padding_ratio_mean"], ".1%"),
                 _fmt(r["encoder_padding_ratio_mean"], ".1%"), _fmt(r["microbatches_mean"], ".1f"),
                 str(r["compiles"])]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(f"speedup dflop / data-blind: {_fmt(report['speedup_steady'], '.2f')}x steady, "
          f"{report['speedup_all_steps']:.2f}x over all steps (compiles included)")  # fmt: skip
    print(f"largest per-step loss difference between the arms: {report['max_loss_diff']:.2e}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflop_jax.bench train", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--config", type=Path, default=DEMO_CONFIG, help="training YAML (the demo)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_train"), help="run folders")
    ap.add_argument("overrides", nargs="*", help="key=value for both arms, e.g. steps=30")
    args = ap.parse_args(argv)
    from dflop_jax.config import ConfigError, load_config
    from dflop_jax.runtime.config import TrainConfig

    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    simulate_cpu_devices(cfg.num_cpu_devices)
    args.out.mkdir(parents=True, exist_ok=True)
    _print(run_ab(args.config, args.out, args.overrides))
    return 0
