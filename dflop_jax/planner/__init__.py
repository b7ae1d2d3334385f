"""Data-aware 3D-parallelism planner (DESIGN section 7): layouts scored by expected step time. No jax.

from dflop_jax.planner import PlannerConfig, make_plan, save_plan, load_plan
"""

from dflop_jax.planner.candidates import (
    Candidate,
    describe_layout,
    enumerate_candidates,
    enumerate_uniform,
)
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.explain import PlanningError
from dflop_jax.planner.plan_file import Alternative, Plan, load_plan, plan_to_dict, save_plan
from dflop_jax.planner.scoring import (
    LayoutCosts,
    expected_step_time,
    problem_for,
    simulate_schedule,
)
from dflop_jax.planner.search import make_plan

__all__ = [
    "Alternative",
    "Candidate",
    "LayoutCosts",
    "Plan",
    "PlannerConfig",
    "PlanningError",
    "describe_layout",
    "enumerate_candidates",
    "enumerate_uniform",
    "expected_step_time",
    "load_plan",
    "make_plan",
    "plan_to_dict",
    "problem_for",
    "save_plan",
    "simulate_schedule",
]
