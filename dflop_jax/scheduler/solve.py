"""schedule_batch: greedy, then time-boxed CP-SAT refinement, then the report (DESIGN section 4).

Never blocks past `config.time_limit_s` (the greedy always runs; CP-SAT gets what is left) and never fails because of the
solver: a timeout without a better answer, an infeasible or invalid model, or any exception inside the
refinement leaves the greedy answer in place, with the reason in `info["fallback"]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from dflop_jax.scheduler.baselines import data_blind_schedule
from dflop_jax.scheduler.config import SchedulerConfig
from dflop_jax.scheduler.greedy import balance_shards, greedy_schedule
from dflop_jax.scheduler.objective import (
    CostTable,
    check_fits,
    evaluate,
    load_balance,
    padding_ratios,
    to_plans,
)
from dflop_jax.scheduler.types import SampleShape, Schedule, ScheduleProblem

log = logging.getLogger(__name__)


def schedule_batch(
    shapes: Sequence[SampleShape],
    problem: ScheduleProblem,
    config: SchedulerConfig,
    seed: int = 0,
    table: CostTable | None = None,
) -> Schedule:
    """Packs one global batch into microbatches and LLM shards with per-microbatch buckets.

    Args:
      shapes: the global batch's N samples (indices into this list appear in the answer).
      problem: dp sizes, stage count, allowed microbatch counts, buckets, stage costs.
      config: solver choice and limits.
      seed: CP-SAT random seed (the greedy is deterministic).
      table: a precomputed `CostTable.build(problem)` (the stateful Scheduler caches it).
    Returns:
      Schedule with the 1F1B-surrogate objective (seconds), a valid lower bound and a report in `info`.
    Raises:
      ValueError: a sample no bucket can hold (named), or bad problem sizes.
    """
    if config.solver == "data_blind":
        _check_problem(problem)
        return data_blind_schedule(shapes, problem, problem.microbatches[0])
    t0 = time.perf_counter()
    shapes = list(shapes)
    _check_problem(problem)
    check_fits(shapes, problem)
    table = table if table is not None else CostTable.build(problem)
    tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
    tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
    if not shapes:
        raise ValueError("schedule_batch got an empty batch: need at least one sample")

    bin_of, m, greedy_obj, lb = greedy_schedule(tokens, tiles, problem, table)
    info: dict = {"greedy_objective": greedy_obj, "greedy_time_s": time.perf_counter() - t0}
    solver = "greedy"
    remaining = config.time_limit_s - (time.perf_counter() - t0)
    if config.solver in ("cpsat", "auto") and greedy_obj <= lb * (1 + 1e-4):
        info["fallback"] = "cpsat skipped: the greedy reached the lower bound"
    elif config.solver in ("cpsat", "auto") and remaining < 0.05:
        info["fallback"] = (
            f"cpsat skipped: the greedy used {config.time_limit_s - remaining:.3f}s of the time limit"
        )
    elif config.solver in ("cpsat", "auto"):
        bin_of, solver = _refine(
            bin_of, m, greedy_obj, tokens, tiles, problem, table, config, seed, remaining, info
        )

    bin_of = balance_shards(bin_of, m, tokens, problem.llm_dp)
    obj, _, ti, si = evaluate(bin_of, m, tokens, tiles, problem, table)
    plans = to_plans(bin_of, m, ti, si, problem, table)
    info.update(padding_ratios(plans, tokens, tiles, problem))
    info.update(load_balance(bin_of, m, tokens, tiles, problem.llm_dp))
    info["microbatches"] = m
    return Schedule(plans, obj, lb, solver, time.perf_counter() - t0, info)


def _refine(bin_of, m, greedy_obj, tokens, tiles, problem, table, config, seed, budget, info):
    """CP-SAT refinement; returns (bin_of, solver name). Falls back to the greedy on any problem."""
    from dflop_jax.scheduler.cpsat import refine_cpsat

    try:
        res = refine_cpsat(bin_of, m, tokens, tiles, problem, table, config, seed, budget)
        info.update(res.info)
        if res.bin_of is None:
            info["fallback"] = res.reason
            return bin_of, "greedy"
        obj = evaluate(res.bin_of, m, tokens, tiles, problem, table)[0]
    except Exception as e:  # the step must never fail because of the solver
        log.warning("CP-SAT refinement failed, keeping greedy: %r", e)
        info["fallback"] = f"exception: {e!r}"
        return bin_of, "greedy"
    info["cpsat_objective"] = obj
    if obj < greedy_obj - 1e-12:
        return res.bin_of, "cpsat"
    info["fallback"] = "cpsat found nothing better than greedy"
    return bin_of, "greedy"


def _check_problem(problem: ScheduleProblem) -> None:
    lo, hi = problem.microbatches
    if not (1 <= lo <= hi):
        raise ValueError(f"problem.microbatches={problem.microbatches}: need 1 <= min <= max")
    if problem.encoder_dp < 1 or problem.llm_dp < 1 or problem.num_stages < 1:
        raise ValueError(
            f"encoder_dp={problem.encoder_dp}, llm_dp={problem.llm_dp}, num_stages={problem.num_stages}: all must be >= 1"
        )
