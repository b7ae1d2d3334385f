"""`python -m dflop_jax.train --dry-run` and `plan --check`: the run's stage programs compiled from
abstract arrays beside the memory model's prediction; nothing is materialized."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

from dflop_jax.costs import AnalyticCostProvider
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.resolve.plan_sources import resolve_plan
from dflop_jax.resolve.run_context import RunContext
from dflop_jax.runtime.config import TrainConfig

log = logging.getLogger(__name__)

# What a dry run of `plan: auto` says where no GPU is present.
DRY_RUN_ANALYTIC_NOTE = (
    "plan: auto profiles the model on the devices present, and these are {platform} devices, not "
    "GPUs: this dry run plans with the analytic costs (plan=analytic); on the GPU the run profiles first"
)


def dry_run(cfg: TrainConfig, show=print) -> list[dict]:
    """Resolve the run's plan, `show` it (a line at a time, before anything compiles), then compile
    each kind of stage program once at its largest buckets from abstract arrays
    (`profiling/compile_check.py`). Writes `run_dir/dry_run.yaml` (per stage: predicted and compiled
    GiB, compile seconds, the residual policy and the training programs' FLOPs summed over its
    buckets, compiled at the largest and scaled to the others by the cost model,
    `profiling/stage_report.py`; per transfer its bytes per microbatch) and returns its stages.

    `plan: auto` profiles the model on the devices present: without a GPU (a CPU checking a GPU
    config) the dry run plans with the analytic costs instead (`plan: analytic`), says so, and
    records it in dry_run.yaml (`plan_note`); profiling a real-size model on CPU would take hours and
    price a CPU."""
    import yaml

    from dflop_jax.planner.plan_file import check_to_dict
    from dflop_jax.planner.progress import progress_bar
    from dflop_jax.profiling.stage_report import SCALED, stage_flops, transfer_bytes_per_microbatch

    note = ""
    if cfg.plan == "auto" and jax.devices()[0].platform != "gpu":
        note = DRY_RUN_ANALYTIC_NOTE.format(platform=jax.devices()[0].platform)
        show(note)
        cfg = dataclasses.replace(cfg, plan="analytic")
    ctx = RunContext.build(cfg)
    with progress_bar() as progress:
        resolved = resolve_plan(ctx, progress)
    show("plan:")
    for line in resolved.describe(ctx.multimodal):
        show(f"  {line}")
    with progress_bar() as progress:  # each compile takes minutes at real sizes
        checks = compile_stages(ctx, resolved, progress)
    flops = stage_flops(resolved.layout, resolved.buckets, ctx.arch, checks, ctx.multimodal)
    stages = [
        {"stage": c.stage, "memory_gib": round(c.predicted / 2**30, 2),
         **check_to_dict(c, c.predicted), **f}
        for c, f in zip(checks, flops)
    ]  # fmt: skip
    transfers = transfer_bytes_per_microbatch(resolved.layout, resolved.buckets, ctx.model_cfg,
                                              _compute_dtype(ctx), ctx.trainable)  # fmt: skip
    out = Path(ctx.cfg.run_dir) / "dry_run.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"flops": SCALED, **({"plan_note": note} if note else {}), "layout": stages,
              "transfers": transfers}  # fmt: skip
    out.write_text(yaml.safe_dump(report, sort_keys=False))
    return stages


def _compute_dtype(ctx: RunContext):
    import jax.numpy as jnp

    return jnp.dtype(ctx.cfg.compute_dtype)


def compile_stages(ctx: RunContext, resolved: ResolvedPlan, progress=None) -> list:
    """Every stage program of `resolved` compiled at its largest buckets under the residual policies
    the run trains (`resolved.residuals`), each `StageCheck` beside the memory model's prediction
    for the same policy: what `train --dry-run` and `plan --check` report."""
    from dflop_jax.planner.scoring import in_flight
    from dflop_jax.profiling.compile_check import check_layout

    lay = resolved.layout
    counts = in_flight(lay.num_stages, resolved.microbatches[1], ctx.cfg.pipeline)
    predicted = [m.total() for m in predicted_stage_memory(ctx, resolved)]
    return check_layout(lay, resolved.buckets, counts, predicted, ctx.model_cfg,
                        compute_dtype=_compute_dtype(ctx), trainable=ctx.trainable,
                        progress=progress or (lambda *_: None),
                        residuals=resolved.residuals)  # fmt: skip


def predicted_stage_memory(ctx: RunContext, resolved: ResolvedPlan) -> list:
    """The memory model's `StageMemory` per stage of `resolved` at its largest buckets and in-flight
    counts, under the residual policies the run trains (`resolved.residuals`): what the dry run and
    `plan --check` set beside the compiled programs."""
    from dflop_jax.costs import layout_memory
    from dflop_jax.planner.scoring import in_flight

    lay = resolved.layout
    counts = in_flight(lay.num_stages, resolved.microbatches[1], ctx.cfg.pipeline)
    provider = memory_provider(ctx, resolved)
    return layout_memory(provider, lay, resolved.buckets, counts, residuals=resolved.residuals)


def memory_provider(ctx: RunContext, resolved: ResolvedPlan):
    """The provider that predicts the dry run's stage memory: the plan's, unless a stage saves its
    residuals and the plan's provider (a measured cost table) prices "recompute" only; then the
    analytic memory model, as `stage_residuals` picks the policies with."""
    saving = any(r != "recompute" for r in resolved.residuals or ())
    if not saving or isinstance(resolved.provider, AnalyticCostProvider):
        return resolved.provider
    log.warning("the cost table prices recomputing stages only: the analytic memory model "
                "predicts the stages under residual policies %s", list(resolved.residuals))  # fmt: skip
    return ctx.analytic
