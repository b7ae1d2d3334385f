"""A run config resolved once per command: its `RunContext` (model config, architecture, device,
devices, the plan file read once) and the plan it trains with (`resolve_plan`).

    ctx = RunContext.build(cfg)             # train, plan, profile, export and the benchmarks alike
    resolved = resolve_plan(ctx, progress)  # -> planner.resolve.ResolvedPlan

It joins the two sides the runtime must not import: the planner (no jax) and, for `plan: auto`, the
profiler (`profiling/auto_plan.py`, which runs the real stage programs).
"""

from dflop_jax.resolve.plan_sources import PLAN_SOURCES, plan_source, resolve_plan
from dflop_jax.resolve.run_context import RunContext

__all__ = ["PLAN_SOURCES", "RunContext", "plan_source", "resolve_plan"]
