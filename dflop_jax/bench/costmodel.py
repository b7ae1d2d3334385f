"""Cost-model accuracy: measured-table predictions vs measured whole-stage programs, and the overhead.

    python -m dflop_jax.bench costmodel [out=runs/bench_costmodel] [runs=7] [statistic=min] [--json]

On 8 simulated CPU devices for the tiny model (`get_arch("tiny")`): (1) a fresh model profile (parts,
tp 1 and 2, a bucket ladder), timed; (2) a plan from it (`configs/plan_tiny_cpu.yaml` settings), timed;
(3) whole stages (embedding + layers + head combinations, several layer counts and tps) compiled as one
program each and timed twice at buckets mostly BETWEEN the profiled ones, compared with
`MeasuredCostProvider.stage_time` with its least-squares fit (the default) and with piecewise-linear
interpolation of the same table (and, for reference, the analytic CPU preset). Error = |pred - meas| /
meas of fwd and of bwd per case; MAPE and worst case over all. "Corrected" applies the scheduler's
adaptive correction (`scheduler.correction.CostCorrection`, one stage per layout): factors learned from
the first timing of the OTHER buckets of the same stage (what a run learns before meeting a new
bucket), then compared with the second timing (out of sample).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Literal

import numpy as np

from dflop_jax.bench._accuracy import mape as _mape
from dflop_jax.bench._cli import command, load
from dflop_jax.config import require
from dflop_jax.host_devices import simulate_cpu_devices

# (module, layers, has_embedding, has_head, tp, buckets): whole stages the planner may place.
CASES = (
    ("encoder", 2, True, True, 1, (3, 6, 12)),
    ("encoder", 1, False, False, 2, (3, 6, 12)),
    ("encoder", 2, False, True, 2, (3, 12)),
    ("llm", 2, True, False, 1, (96, 384, 768)),
    ("llm", 2, False, True, 2, (96, 384, 768)),
    ("llm", 1, False, False, 1, (192, 256, 640)),
    ("llm", 4, True, True, 1, (192, 640)),
)
TPS = (1, 2)
ENCODER_BUCKETS = (1, 2, 4, 8, 16)
LLM_BUCKETS = (64, 128, 256, 512, 1024)

COMMAND = command(
    "costmodel",
    __doc__.split("\n\n")[0],
    "python -m dflop_jax.bench costmodel runs=1 warmup=1 out=runs/bench_costmodel",
    json="print the report as JSON",
)


@dataclasses.dataclass(frozen=True)
class CostModelBenchConfig:
    """Where the cost table goes and how each program is timed.

    Attributes:
      out: folder for the cost table and results.
      runs: timed runs per program.
      warmup: untimed runs per program.
      statistic: timing statistic of profile and measurement: "median", or "min" (robust on a shared
        machine).
    """

    out: str = "runs/bench_costmodel"
    runs: int = 7
    warmup: int = 2
    statistic: Literal["median", "min"] = "median"

    def __post_init__(self):
        require(self.runs >= 1, "runs", self.runs, "must be >= 1")
        require(self.warmup >= 0, "warmup", self.warmup, "must be >= 0")


def _measure_cases(model_cfg, devices, settings):
    import jax.numpy as jnp

    from dflop_jax.profiling.model_profiler import measure_program
    from dflop_jax.profiling.programs import StageShape, build_program

    rows = []
    for module, layers, emb, head, tp, buckets in CASES:
        st = StageShape(module, layers, emb, head)
        for b in buckets:
            prog = build_program(model_cfg, st, tp, b, devices, jnp.dtype(settings.compute_dtype))
            m = measure_program(prog, settings, repeats=2)
            rows.append(dict(module=module, layers=layers, emb=emb, head=head, tp=tp, bucket=b,
                             fwd=m["fwd_reps"], bwd=m["bwd_reps"]))  # fmt: skip
    return rows


def _corrected(rows, pred_of) -> np.ndarray:
    """[n, 2] corrected predictions of rep 2: factors from the other buckets' rep 1 (same stage)."""
    from dflop_jax.contracts import BucketSet, ScheduleProblem
    from dflop_jax.scheduler.correction import CostCorrection

    out = np.zeros((len(rows), 2))
    for i, r in enumerate(rows):
        same = [j for j, q in enumerate(rows) if j != i and _stage_key(q) == _stage_key(r)]
        enc = r["module"] == "encoder"
        buckets = sorted({rows[j]["bucket"] for j in same} | {r["bucket"]})
        bset = BucketSet(tuple(buckets), (1,)) if enc else BucketSet((1,), tuple(buckets))
        problem = ScheduleProblem(1, 1, 1, (1, 1), bset, lambda t, s: np.zeros((1, 2)))
        corr = CostCorrection(problem, rate=0.3)
        idx = {b: k for k, b in enumerate(buckets)}
        for j in same:
            q = rows[j]
            ti, si = (idx[q["bucket"]], 0) if enc else (0, idx[q["bucket"]])
            corr.update(ti, si, np.array([[q["fwd"][0], q["bwd"][0]]]), pred_of(q)[None])
        ti, si = (idx[r["bucket"]], 0) if enc else (0, idx[r["bucket"]])
        out[i] = pred_of(r) * corr.factor(ti, si)[0]
    return out


def _stage_key(r) -> tuple:
    return (r["module"], r["layers"], r["emb"], r["head"], r["tp"])


def run(out_dir: Path, runs: int, warmup: int, statistic: str = "median") -> dict:
    import jax

    from dflop_jax.costs import AnalyticCostProvider, StageSpec, get_arch, get_device
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.profiling.model_profiler import ProfileSettings, profile_model
    from dflop_jax.programs.model_section import model_config_for_arch

    arch, device = get_arch("tiny"), get_device("cpu")
    model_cfg = model_config_for_arch(arch)
    devices = jax.devices()
    settings = ProfileSettings(tps=TPS, encoder_buckets=ENCODER_BUCKETS, llm_buckets=LLM_BUCKETS,
                               warmup=warmup, runs=runs, statistic=statistic)  # fmt: skip
    table_path = out_dir / "cost_table.json"
    table_path.unlink(missing_ok=True)  # a fresh profile: its time is part of the report
    t0 = time.perf_counter()
    table = profile_model(model_cfg, devices, settings, table_path, model_name="tiny")
    profile_s = time.perf_counter() - t0
    provider = MeasuredCostProvider(
        table, arch, device, fallback=AnalyticCostProvider(arch, device)
    )
    plan_s, plan_desc = _plan(arch, device, provider)
    rows = _measure_cases(model_cfg, devices, settings)

    def spec(r):
        return StageSpec(r["module"], 0, r["layers"], tp=r["tp"], has_embedding=r["emb"],
                         has_head=r["head"])  # fmt: skip

    def pred_measured(r):
        return np.array(provider.stage_time(spec(r), r["bucket"]))

    interpolating = MeasuredCostProvider(
        table, arch, device, fallback=AnalyticCostProvider(arch, device), fit="interpolate"
    )
    pred_interp = np.array([interpolating.stage_time(spec(r), r["bucket"]) for r in rows])

    analytic = AnalyticCostProvider(arch, device, compute_bytes=2)
    meas2 = np.array([[r["fwd"][1], r["bwd"][1]] for r in rows])
    pred = np.array([pred_measured(r) for r in rows])
    pred_an = np.array([analytic.stage_time(spec(r), r["bucket"]) for r in rows])
    corrected = _corrected(rows, pred_measured)
    rep_noise = _mape(np.array([[r["fwd"][0], r["bwd"][0]] for r in rows]), meas2)
    report = {
        "profile_s": profile_s, "plan_s": plan_s, "plan": plan_desc,
        "entries": len(table.entries), "skipped": len(table.skipped()),
        "mape": _mape(pred, meas2), "mape_corrected": _mape(corrected, meas2),
        "mape_interpolate": _mape(pred_interp, meas2),
        "mape_analytic": _mape(pred_an, meas2), "rep_to_rep": rep_noise,
        "sources": provider.sources(),
        "cases": [dict(r, pred=pred[i].tolist(), corrected=corrected[i].tolist(),
                       interpolated=pred_interp[i].tolist())
                  for i, r in enumerate(rows)],
    }  # fmt: skip
    (out_dir / "costmodel.json").write_text(json.dumps(report, indent=1))
    return report


def _plan(arch, device, provider) -> tuple[float, str]:
    from dflop_jax.config import load_config
    from dflop_jax.planner import PlanningError, describe_layout, make_plan
    from dflop_jax.planner.resolve import load_shapes, training_planner
    from dflop_jax.runtime.config import TrainConfig

    cfg = load_config(
        TrainConfig, Path(__file__).resolve().parents[2] / "configs/plan_tiny_cpu.yaml"
    )
    planner = training_planner(
        cfg.planner, cfg.global_batch, True, cfg.optimizer.trainable, cfg.steps
    )
    shapes = load_shapes(cfg.profile.data_source, cfg.profile.data_samples, cfg.seed)
    t0 = time.perf_counter()
    try:
        plan = make_plan(arch, device, 8, shapes, planner, provider)
        desc = f"{describe_layout(plan.layout)} M={plan.microbatches}"
    except PlanningError as e:
        desc = f"infeasible: {e}"
    return time.perf_counter() - t0, desc


def _print(report: dict) -> None:
    print(f"profile: {report['entries']} entries ({report['skipped']} skipped) in "
          f"{report['profile_s']:.0f} s; plan in {report['plan_s']:.1f} s -> {report['plan']}")  # fmt: skip
    print("| stage | tp | bucket | measured | fit | + correction | interpolated |  (ms fwd / bwd)")
    print("|---|---|---|---|---|---|---|")
    for c in report["cases"]:
        name = (c["module"] + (" emb+" if c["emb"] else " ") + f"{c['layers']}L"
                + ("+head" if c["head"] else ""))  # fmt: skip
        ms = lambda v: f"{v[0] * 1e3:.2f} / {v[1] * 1e3:.2f}"
        print(f"| {name} | {c['tp']} | {c['bucket']} | {ms([c['fwd'][1], c['bwd'][1]])} | "
              f"{ms(c['pred'])} | {ms(c['corrected'])} | {ms(c['interpolated'])} |")  # fmt: skip
    for key, label in (("mape", "measured table, least-squares fit"),
                       ("mape_corrected", "+ adaptive correction"),
                       ("mape_interpolate", "measured table, interpolation"),
                       ("mape_analytic", "analytic cpu preset"), ("rep_to_rep", "timing noise (rep 1 vs 2)")):  # fmt: skip
        mean, worst = report[key]
        print(f"{label}: MAPE {mean:.1%}, worst {worst:.1%}")
    print(f"entry sources: {report['sources']}")


def main(argv: list[str] | None = None) -> int:
    cfg, args = load(COMMAND, CostModelBenchConfig, argv)
    simulate_cpu_devices(8)  # before jax starts its backend
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(out, cfg.runs, cfg.warmup, cfg.statistic)
    print(json.dumps(report, indent=1) if args.json else "", end="")
    if not args.json:
        _print(report)
    return 0
