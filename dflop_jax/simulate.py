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

from dflop_jax.planner import Plan, load_plan
from dflop_jax.planner.replay import read_samples_jsonl, replay
from dflop_jax.planner.scoring import sample_batches
from dflop_jax.scheduler import SampleShape


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
        report = replay(plan, batches, scheduler, args.schedule, args.png)
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
