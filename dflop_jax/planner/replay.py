"""Replaying a plan on global batches: schedule each, simulate it, report (the simulate CLI's library)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflop_jax.planner.baseline import data_blind_scheduler
from dflop_jax.planner.plan_file import Plan
from dflop_jax.planner.scoring import LayoutCosts, online_scheduler, problem_for, simulate_schedule
from dflop_jax.planner.variants import plan_virtual_layout
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
    from dflop_jax.costs.recipe import TRAINABLE_PARTS

    # the plan's remat policy and training recipe (older plans: all trainable)
    trainable = tuple(plan.planner_config.get("trainable", TRAINABLE_PARTS))
    return AnalyticCostProvider(get_arch(plan.model), get_device(plan.device), remat=plan.remat,
                                trainable=trainable)  # fmt: skip


def replay(
    plan: Plan,
    batches: list[list[SampleShape]],
    scheduler: str,
    schedule: str,
    png: str | None = None,
) -> dict:
    """Schedules and simulates each batch on the plan's layout; returns a JSON-able report."""
    costs = LayoutCosts.build(
        provider_for(plan), *plan_virtual_layout(plan), plan.residuals or None
    )
    problem = problem_for(costs, plan.microbatch_range, plan.buckets)
    fn = (
        data_blind_scheduler() if scheduler == "data_blind" else online_scheduler(scheduler, seed=0)
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
