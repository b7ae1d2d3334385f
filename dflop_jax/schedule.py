"""Schedule one global batch from a JSON-lines sample file.

    python -m dflop_jax.schedule --samples S.jsonl --out OUT.json --llm-dp 4 --encoder-dp 4 \
        --microbatches 8 --solver auto --time-limit 1

Input lines: {"id": ..., "tiles": int, "tokens": int}. Stage costs: the analytic cost model of `--model`
on `--device` over `--stages E,L` encoder/LLM stages. `--baseline` schedules with a DESIGN section 8
baseline instead (same objective measure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflop_jax.contracts import BucketSet
from dflop_jax.costs import DEFAULT_ARCH
from dflop_jax.scheduler import BASELINES, SchedulerConfig, default_buckets, schedule_batch
from dflop_jax.scheduler.model_problem import model_problem
from dflop_jax.scheduler.report import read_samples_jsonl, schedule_to_json


def _ints(text: str, name: str, n: int | None = None) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{name}={text!r}: expected comma-separated integers") from None
    if n is not None and len(vals) != n:
        raise ValueError(f"--{name}={text!r}: expected {n} integers")
    return vals


def _count_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        out = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"--microbatches={text!r}: expected N or MIN-MAX") from None
    if not 1 <= out[0] <= out[1]:
        raise ValueError(f"--microbatches={text!r}: need 1 <= MIN <= MAX")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflop_jax.schedule", description=__doc__.split("\n")[0]
    )
    p.add_argument("--samples", required=True, help="JSON lines {id, tiles, tokens}")
    p.add_argument("--out", help="write the JSON schedule here")
    p.add_argument("--llm-dp", type=int, default=1)
    p.add_argument("--encoder-dp", type=int, default=None, help="default: --llm-dp")
    p.add_argument("--microbatches", default="4", help="N or MIN-MAX (default 4)")
    p.add_argument("--tile-buckets", help="comma list; default: geometric, from the samples")
    p.add_argument("--length-buckets", help="comma list; default: geometric, from the samples")
    p.add_argument(
        "--model", default=DEFAULT_ARCH, help=f"architecture name (default {DEFAULT_ARCH})"
    )
    p.add_argument("--device", default="h100", help="device preset (default h100)")
    p.add_argument("--stages", default="1,1", help="encoder,LLM pipeline stages (default 1,1)")
    p.add_argument("--tp", default="1,1", help="encoder,LLM tensor parallelism (default 1,1)")
    p.add_argument(
        "--time-limit", type=float, default=1.0, help="wall-clock backstop, s (default 1)"
    )
    p.add_argument("--solver", choices=["greedy", "cpsat", "auto"], default="auto")
    p.add_argument("--baseline", choices=list(BASELINES), help="use a baseline instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the JSON report")
    return p


def run(args: argparse.Namespace) -> dict:
    shapes = read_samples_jsonl(args.samples)
    counts = _count_range(args.microbatches)
    edp = args.encoder_dp if args.encoder_dp is not None else args.llm_dp
    guess = default_buckets(shapes, counts[0], edp, args.llm_dp)
    buckets = BucketSet(
        _ints(args.tile_buckets, "tile-buckets") if args.tile_buckets else guess.tiles,
        _ints(args.length_buckets, "length-buckets") if args.length_buckets else guess.lengths,
    )
    problem = model_problem(
        args.model,
        args.device,
        buckets,
        counts,
        edp,
        args.llm_dp,
        _ints(args.stages, "stages", 2),
        _ints(args.tp, "tp", 2),
    )
    if args.baseline:
        sched = BASELINES[args.baseline](shapes, problem, counts[1])
    else:
        config = SchedulerConfig(solver=args.solver, time_limit_s=args.time_limit, seed=args.seed)
        sched = schedule_batch(shapes, problem, config)
    out = schedule_to_json(sched, shapes)
    out.update(
        model=args.model,
        device=args.device,
        tile_buckets=list(buckets.tiles),
        length_buckets=list(buckets.lengths),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        out = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(
        f"{len(out['microbatches'])} microbatches, objective {out['objective']:.4f}s, lower bound "
        f"{out['lower_bound']:.4f}s (gap {out['gap']:.2%}), solver {out['solver']}, {out['time_s']:.3f}s",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
