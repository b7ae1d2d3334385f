"""Simulate a plan on samples: schedule each global batch, then run the pipeline simulator.

    python -m dflop_jax.simulate --plan plan.yaml --samples batch.jsonl [--png timeline.png] [--json]
    python -m dflop_jax.simulate --plan plan.yaml --mix llava-ov --batches 4 [--schedule gpipe]

`--samples` is one global batch, one JSON object per line: {"id": ..., "tiles": int, "tokens": int}.
`--mix` (llava-ov, omnibal) or `--shapes` (a shape-distribution file) draw `--batches` global batches of
the plan's size. The scheduler is the plan's (online DFLOP scheduler; data-blind for a uniform plan)
unless `--scheduler` says otherwise. Prints step time and idle fraction per batch and their mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dflop_jax.planner import LayoutCosts, Plan, load_plan, problem_for, simulate_schedule
from dflop_jax.planner.baseline import data_blind_scheduler
from dflop_jax.planner.scoring import online_scheduler, sample_batches
from dflop_jax.scheduler import SampleShape


def read_samples_jsonl(path: str | Path) -> list[SampleShape]:
    """One global batch from JSON lines {"id", "tiles", "tokens"[, "modality"]}."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(
                SampleShape(
                    d["id"], int(d["tiles"]), int(d["tokens"]), str(d.get("modality", "text"))
                )
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: expected {{'id', 'tiles', 'tokens'}}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no samples")
    return out


def provider_for(plan: Plan):
    from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device

    remat = plan.cost_provider.endswith("+remat")
    return AnalyticCostProvider(get_arch(plan.model), get_device(plan.device), remat=remat)


def run(
    plan: Plan,
    batches: list[list[SampleShape]],
    scheduler: str,
    schedule: str,
    png: str | None = None,
) -> dict:
    """Schedules and simulates each batch on the plan's layout; returns a JSON-able report."""
    costs = LayoutCosts.build(provider_for(plan), plan.layout)
    problem = problem_for(costs, plan.microbatch_range, plan.buckets)
    fn = (
        data_blind_scheduler() if scheduler == "data-blind" else online_scheduler(scheduler, seed=0)
    )
    rows, first = [], None
    for batch in batches:
        sched = fn(batch, problem)
        res = simulate_schedule(sched, costs, schedule)
        first = first if first is not None else res
        rows.append({"samples": len(batch), "microbatches": len(sched.microbatches), "step_time_s": res.step_time,
                     "idle_fraction": res.idle_fraction, "solver": sched.solver})  # fmt: skip
    if png:
        from dflop_jax.sim import plot_timeline

        names = [
            f"{s.module} {s.first_layer}-{s.first_layer + s.num_layers - 1} tp{s.tp}dp{s.dp}"
            for s in plan.layout.stages
        ]
        plot_timeline(first, png, f"{plan.model} on {plan.num_devices}x{plan.device}", names)
    return {
        "plan_mode": plan.mode,
        "scheduler": scheduler,
        "schedule": schedule,
        "step_time_mean_s": float(np.mean([r["step_time_s"] for r in rows])),
        "idle_fraction_mean": float(np.mean([r["idle_fraction"] for r in rows])),
        "batches": rows,
        "png": png,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dflop_jax.simulate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--plan", required=True, help="plan.yaml from python -m dflop_jax.plan")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--samples", help="one global batch as JSON lines {id, tiles, tokens}")
    src.add_argument(
        "--mix", choices=["llava-ov", "omnibal"], help="draw batches from a built-in distribution"
    )
    src.add_argument("--shapes", help="draw batches from a shape-distribution JSON file")
    ap.add_argument(
        "--batches", type=int, default=4, help="global batches to draw (--mix/--shapes)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--scheduler", choices=["plan", "greedy", "auto", "cpsat", "data-blind"], default="plan"
    )
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--png", help="write the first batch's timeline here")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        plan = load_plan(args.plan)
        batches = _batches(args, plan)
        scheduler = (
            args.scheduler
            if args.scheduler != "plan"
            else ("data-blind" if plan.mode == "uniform" else "greedy")
        )
        report = run(plan, batches, scheduler, args.schedule, args.png)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for i, r in enumerate(report["batches"]):
        print(f"batch {i}: {r['samples']} samples, {r['microbatches']} microbatches, "
              f"step {r['step_time_s'] * 1e3:.1f} ms, idle {r['idle_fraction']:.1%} ({r['solver']})")  # fmt: skip
    print(f"mean: step {report['step_time_mean_s'] * 1e3:.1f} ms, idle {report['idle_fraction_mean']:.1%}"
          + (f"; timeline -> {args.png}" if args.png else ""))  # fmt: skip
    return 0


def _batches(args, plan: Plan) -> list[list[SampleShape]]:
    if args.samples:
        return [read_samples_jsonl(args.samples)]
    from dflop_jax.scheduler import llava_ov_mix, load_shape_distribution, omnibal_shapes

    if args.mix == "llava-ov":
        shapes = llava_ov_mix(4000, args.seed)
    elif args.mix == "omnibal":
        shapes = omnibal_shapes()
    else:
        shapes = load_shape_distribution(args.shapes)
    if args.batches < 1:
        raise ValueError(f"--batches={args.batches}: need >= 1")
    return sample_batches(shapes, plan.global_batch, args.batches, args.seed)


if __name__ == "__main__":
    sys.exit(main())
