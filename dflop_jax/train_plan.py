"""The plan `python -m dflop_jax.train` trains with: `TrainConfig.plan` resolved on this run's devices.

    resolved = resolve_plan(cfg, model_cfg)   # -> planner.resolve.ResolvedPlan

Beside the entry point because it joins the two sides the runtime must not import: the planner
(`planner/resolve.py`, no jax) and, for `plan: auto`, the profiler (`profiling/pipeline.py`, which runs
the real stage programs). "explicit" is the config's `layout` section; "analytic" plans on the
dataset's shapes with analytic costs; a path loads a plan.yaml; "auto" profiles data and model in
`run_dir/auto_plan` (reusing fresh outputs) and plans on measured costs, which the scheduler then
predicts with too.
"""

from __future__ import annotations

from pathlib import Path

import jax

from dflop_jax.costs import AnalyticCostProvider, arch_of_model, get_device
from dflop_jax.planner.resolve import ResolvedPlan, static_plan, training_planner
from dflop_jax.runtime.config import TrainConfig


def resolve_plan(cfg: TrainConfig, model_cfg) -> ResolvedPlan:
    """The layout, buckets, microbatch range and cost provider of `cfg.plan` for `model_cfg`."""
    arch, device = arch_of_model(model_cfg), get_device(cfg.plan_device)
    analytic = AnalyticCostProvider(arch, device)
    multimodal = cfg.model.kind != "decoder"
    if cfg.plan == "explicit":
        lay = cfg.layout
        resolved = ResolvedPlan(lay.layout(), lay.buckets(), tuple(lay.microbatches), analytic)
        return resolved.check_runnable(cfg.plan, multimodal)
    planner = training_planner(cfg.planner, cfg.global_batch, multimodal)
    if cfg.plan == "auto":
        from dflop_jax.profiling.pipeline import AutoPlanConfig, profiled_plan

        auto = AutoPlanConfig(cfg.plan_device, len(jax.devices()), "dataset", seed=cfg.seed,
                              profile=cfg.profile, planner=planner)  # fmt: skip
        cache = Path(cfg.run_dir) / "auto_plan"
        plan, measured = profiled_plan(
            auto, model_cfg, cache, cfg.data, name=f"{cfg.model.kind}-run"
        )
        return ResolvedPlan.of(plan, measured).check_runnable(cfg.plan, multimodal)
    plan = static_plan(cfg.plan, arch, device, len(jax.devices()), planner,
                       lambda: _sample_shapes(cfg), cfg.run_dir)  # fmt: skip
    return ResolvedPlan.of(plan, analytic).check_runnable(cfg.plan, multimodal)


def _sample_shapes(cfg: TrainConfig):
    """(tiles, tokens) of the dataset's samples from metadata (bad samples left out)."""
    from dflop_jax.data import BadSample, Processor, load_source

    processor, shapes = Processor(cfg.data), []
    for record in load_source(cfg.data, cfg.seed):
        try:
            shapes.append(processor.shape(record))
        except BadSample:
            continue
    return shapes
