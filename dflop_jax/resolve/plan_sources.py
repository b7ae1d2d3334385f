"""The plan a run trains with: `TrainConfig.plan` resolved on the run's devices, one named function
per way of getting it (`PLAN_SOURCES`).

"explicit" is the config's `layout` section; "analytic" plans on the dataset's shapes with analytic
costs; a path loads a plan.yaml; "auto" profiles data and model in `run_dir/auto_plan` (reusing fresh
outputs) and plans on measured costs, which the scheduler then predicts with too. A running job's
re-plan is the fifth way (`runtime/replan.next_plan`).

The same run config drives the step commands: `auto_plan_config` gives `python -m dflop_jax.profile
data|model|auto` the settings `plan: auto` uses (so each reuses what the other wrote), and
`plan_from_run_dir` is `python -m dflop_jax.plan` (the profiles in `run_dir/auto_plan` ->
`run_dir/plan.yaml`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from dflop_jax.planner.resolve import (
    ResolvedPlan,
    analytic_plan,
    check_plan_fits_run,
    plan_data_note,
)
from dflop_jax.resolve.run_context import PLAN_MODES, RunContext
from dflop_jax.runtime.config import TrainConfig

log = logging.getLogger(__name__)


def plan_source(plan: str) -> str:
    """The way `TrainConfig.plan` is got: "explicit", "analytic", "auto", or "file" (a plan.yaml
    path)."""
    return plan if plan in PLAN_MODES else "file"


def resolve_plan(ctx: RunContext, progress=None) -> ResolvedPlan:
    """The layout, buckets, microbatch range, cost provider and residual policies of the run's plan;
    `progress(phase, done, total)` reports the profiling and planning steps
    (`planner.progress.progress_bar`)."""
    get = PLAN_SOURCES[plan_source(ctx.cfg.plan)]
    resolved = get(ctx, progress).check_runnable(ctx.cfg.plan, ctx.multimodal)
    return dataclasses.replace(resolved, residuals=stage_residuals(ctx, resolved))


def _explicit_plan(ctx: RunContext, progress) -> ResolvedPlan:
    """The config's `layout` section, priced by the analytic provider."""
    lay = ctx.cfg.layout
    return ResolvedPlan(lay.layout(), lay.buckets(), tuple(lay.microbatches), ctx.analytic)


def _file_plan(ctx: RunContext, progress) -> ResolvedPlan:
    """A plan.yaml, refused when made for another model, recipe, device or global batch; a note when
    the data profile changed since."""
    from dflop_jax.profiling.auto_plan import shape_file

    cfg, plan = ctx.cfg, ctx.plan_file
    check_plan_fits_run(plan, cfg.plan, ctx.arch, ctx.device, ctx.num_devices, ctx.trainable,
                        cfg.global_batch)  # fmt: skip
    note = plan_data_note(plan, cfg.plan, shape_file(ctx.auto_plan_dir))
    if note:
        log.warning(note)
    return ResolvedPlan.of(plan, ctx.analytic)


def _auto_plan(ctx: RunContext, progress) -> ResolvedPlan:
    """Profiles data and model in `run_dir/auto_plan` (reusing fresh outputs) and plans on the
    measured costs, which the scheduler then predicts with."""
    from dflop_jax.profiling.auto_plan import profiled_plan

    auto = auto_plan_config(ctx)  # its search space checked before any profiling
    plan, measured = profiled_plan(auto, ctx.model_cfg, ctx.auto_plan_dir, ctx.cfg.data,
                                   arch=ctx.arch, progress=progress)  # fmt: skip
    return ResolvedPlan.of(plan, measured.with_trainable(auto.planner.trainable))


def _analytic_plan(ctx: RunContext, progress) -> ResolvedPlan:
    """Plans on the dataset's shapes with analytic costs; saves `run_dir/plan.yaml`."""
    plan = analytic_plan(ctx.arch, ctx.device, ctx.num_devices, ctx.planner,
                         lambda: sample_shapes(ctx.cfg), ctx.cfg.run_dir, ctx.analytic,
                         progress)  # fmt: skip
    return ResolvedPlan.of(plan, ctx.analytic)


# `plan_source(cfg.plan)` -> (context, progress) -> ResolvedPlan
PLAN_SOURCES = {
    "explicit": _explicit_plan,
    "file": _file_plan,
    "auto": _auto_plan,
    "analytic": _analytic_plan,
}


def stage_residuals(ctx: RunContext, resolved: ResolvedPlan) -> tuple[str, ...]:
    """Each stage's residual policy: `cfg.residuals` for every stage; under "auto" the plan's own
    (the planner chose each with the layout: what its memory and times assume), or for a plan
    that records none (an explicit layout) the one with the least backward work that fits the plan
    device's usable memory (analytic memory model at the plan's largest buckets and in-flight
    counts, the planner's rule)."""
    from dflop_jax.costs import AnalyticCostProvider, residual_policies
    from dflop_jax.planner.scoring import in_flight

    cfg, lay = ctx.cfg, resolved.layout
    if cfg.residuals != "auto":
        if resolved.residuals and set(resolved.residuals) != {cfg.residuals}:
            log.warning("residuals=%s for every stage: the plan was made for %s", cfg.residuals,
                        list(resolved.residuals))  # fmt: skip
        return (cfg.residuals,) * lay.num_stages
    if resolved.residuals:
        return tuple(resolved.residuals)
    analytic = AnalyticCostProvider(ctx.arch, ctx.device, remat=cfg.model.remat,
                                    trainable=ctx.trainable)  # fmt: skip
    counts = in_flight(lay.num_stages, resolved.microbatches[1], cfg.pipeline)
    budget = ctx.device.memory_bytes * (1.0 - cfg.planner.memory_margin)
    return tuple(residual_policies(analytic, lay, resolved.buckets, counts, budget))


def auto_plan_config(ctx: RunContext):
    """The auto-plan workflow's settings for this run (`profiling.auto_plan.AutoPlanConfig`): the same
    for `plan: auto` and `python -m dflop_jax.profile data|model|auto`, so each reuses what the
    other wrote while it is fresh."""
    from dflop_jax.profiling.auto_plan import AutoPlanConfig

    cfg = ctx.cfg
    return AutoPlanConfig(ctx.device, ctx.num_devices, cfg.profile.data_source,
                          cfg.profile.data_samples, seed=cfg.seed, profile=cfg.profile,
                          planner=ctx.planner)  # fmt: skip


def plan_from_run_dir(ctx: RunContext, progress=None):
    """`python -m dflop_jax.plan`: a plan on the shapes `profile data` wrote and the cost table
    `profile model` wrote in the run's auto_plan directory; where one is absent, one line says so
    and the data's shapes (from metadata) or the analytic cost model stand in. `Plan.inputs`
    records what was read (paths and sha256)."""
    from dflop_jax.costs.measured import MeasuredCostProvider
    from dflop_jax.planner import make_plan
    from dflop_jax.profiling.auto_plan import cost_table_file

    arch = ctx.arch
    provider, table = ctx.analytic, cost_table_file(ctx.auto_plan_dir)
    if table.is_file():
        provider = MeasuredCostProvider(table, arch, ctx.device, fallback=provider)
    else:
        log.warning("no cost table at %s (python -m dflop_jax.profile model writes it): "
                    "the analytic cost model prices the stages", table)  # fmt: skip
    shapes, shapes_input = plan_shapes(ctx)
    plan = make_plan(arch, ctx.device, ctx.num_devices, shapes, ctx.planner, provider, progress)
    inputs = {"shapes": shapes_input,
              "cost_table": _file_input(table) if table.is_file() else "analytic"}  # fmt: skip
    return dataclasses.replace(plan, inputs=inputs)


def plan_shapes(ctx: RunContext):
    """(the shapes the run plans for, how `Plan.inputs` records them), per `profile.data_source`."""
    from dflop_jax.contracts.profile_settings import SYNTHETIC_SHAPES
    from dflop_jax.planner.resolve import load_shapes
    from dflop_jax.profiling.auto_plan import shape_file

    cfg = ctx.cfg
    source = cfg.profile.data_source
    if source in SYNTHETIC_SHAPES:
        return load_shapes(source, cfg.profile.data_samples, cfg.seed), source
    path = shape_file(ctx.auto_plan_dir) if source == "dataset" else Path(source)
    if path.is_file():
        shapes = load_shapes(str(path), audio=ctx.arch.audio is not None, vision=ctx.multimodal)
        return shapes, _file_input(path)
    log.warning("no shape distribution at %s (python -m dflop_jax.profile data writes it): "
                "planning on the data's shapes from metadata", path)  # fmt: skip
    return sample_shapes(cfg), "dataset"


def _file_input(path) -> dict:
    from dflop_jax.contracts.files import file_hash

    return {"path": str(Path(path).resolve()), "sha256": file_hash(path)}


def sample_shapes(cfg: TrainConfig):
    """(tiles, tokens) of the dataset's samples from metadata (bad samples left out)."""
    from dflop_jax.data import BadSample, Processor, load_source

    processor, shapes = Processor(cfg.data), []
    for record in load_source(cfg.data, cfg.seed):
        try:
            shapes.append(processor.shape(record))
        except BadSample:
            continue
    return shapes
