"""schedule_batch: greedy, then large-neighbourhood search, then the stage-aware order and the report.

What is promised (DESIGN section 4):

- Deterministic. For the same (batch, problem, config) the answer is a pure function of its inputs: the
  greedy and the lower bound have no randomness and no clock, and the refinement (`lns.py`) is bounded
  only by deterministic units (rounds and CP-SAT deterministic time, one worker, seeded by
  `config.seed`). The machine's load changes how long it takes, never what it returns.
- Bounded. The greedy always runs to completion (no clock inside; ~0.1 s CPU at N=256, ~0.6 s at
  N=1024). The wall clock (`clock`, `config.time_limit_s`) is only a backstop on the refinement: when
  it has passed between two rounds, the whole refinement is dropped and the greedy answer -- itself
  deterministic -- is returned, with `info["wall_clock_cutoff"] = True` and the reason in
  `info["fallback"]`. So under any load the answer is either the refined one or the greedy one, both
  fixed by the inputs, and the report says which. Which of the two still depends on the load, so a
  multi-process run, where every process must reach the same answer, turns the backstop off
  (`backstop=False`): the answer is then the refined one on every process whatever the load, and the
  refinement's time is bounded by its deterministic budget alone (`runtime/schedule_agreement.py` checks the
  digest of every batch anyway).
- Never fails because of the solver: an infeasible/invalid CP-SAT model or any exception inside the
  refinement keeps the greedy answer, with the reason in `info["fallback"]`.
- Stage-aware: with more than one pipeline stage (and `config.select == "makespan"`), the answer is the
  candidate -- any the greedy built, or the refinement's -- with the lowest simulated 1F1B makespan
  (`select.py`); the objective reported stays that candidate's static-bucket surrogate, and the
  lower bound the surrogate's, so `gap` can exceed the surrogate-best candidate's.
- Audio (a problem with an audio ladder): every microbatch is priced at its audio bucket, and the
  answer is the best of the tile/length search's and three-resource packings by the same rule
  (`audio_packing.py`), ordered by those audio-priced costs.
- No empty microbatch: with fewer samples than the smallest allowed count, the count shrinks to the
  number of samples (`info["microbatches_below_range"]`); no microbatch ever computes only padding.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from dflop_jax.contracts import SampleShape, Schedule, ScheduleProblem
from dflop_jax.scheduler.audio_packing import pick_with_audio
from dflop_jax.scheduler.baselines import data_blind_schedule
from dflop_jax.scheduler.config import SchedulerConfig
from dflop_jax.scheduler.greedy import ensure_nonempty, greedy_schedule
from dflop_jax.scheduler.lns import Aborted, LnsBudget, lns
from dflop_jax.scheduler.objective import (
    CostTable,
    check_fits,
    evaluate,
    load_balance,
    padding_ratios,
    to_plans,
    with_audio,
)
from dflop_jax.scheduler.order import makespan_lower_bound, order_microbatches
from dflop_jax.scheduler.select import finish, pick_by_makespan
from dflop_jax.sim.pipeline import simulate

log = logging.getLogger(__name__)


def schedule_batch(
    shapes: Sequence[SampleShape],
    problem: ScheduleProblem,
    config: SchedulerConfig,
    *,
    table: CostTable | None = None,
    clock: Callable[[], float] = time.perf_counter,
    backstop: bool = True,
) -> Schedule:
    """Packs one global batch into microbatches and LLM shards with per-microbatch buckets.

    Args:
      shapes: the global batch's N samples (indices into this list appear in the answer).
      problem: dp sizes, stage count, allowed microbatch counts, buckets, stage costs.
      config: solver choice, deterministic budget, wall-clock backstop, seed.
      table: a precomputed `CostTable.build(problem)` (the stateful Scheduler caches it).
      clock: the wall clock of the backstop and of `time_s` (tests inject a slow one).
      backstop: False = no wall-clock cut-off (the answer is a function of the inputs alone; multi-
        process runs).
    Returns:
      Schedule: microbatches in the order that minimises the simulated 1F1B step, the surrogate
      objective of their static buckets (what the runtime pays), a valid lower bound on it, and the
      report in `info` (greedy objective, refinement rounds, fallback; the simulated 1F1B makespan in
      the chosen order and in solve order, and a lower bound on it for these microbatches).
    Raises:
      ValueError: an empty batch, a sample no bucket can hold (named), or bad problem sizes.
    """
    _check_problem(problem)
    shapes = list(shapes)
    if not shapes:
        raise ValueError("schedule_batch got an empty batch: need at least one sample")
    if config.solver == "data_blind":
        return data_blind_schedule(shapes, problem, problem.microbatches[0])
    t0 = clock()
    elapsed = lambda: clock() - t0
    check_fits(shapes, problem)
    lo, hi = problem.microbatches
    n = len(shapes)
    # with fewer samples than microbatches, one sample each (no microbatch of padding only)
    eff = dataclasses.replace(problem, microbatches=(min(lo, n), min(hi, n)))
    table = table if table is not None else CostTable.build(problem)
    tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
    tiles = np.array([s.tiles for s in shapes], dtype=np.float64)

    by_makespan = config.select == "makespan" and problem.num_stages > 1
    pool: list | None = [] if by_makespan else None
    bin_of, m, lb, info = _greedy(tokens, tiles, (eff, lo), table, pool, elapsed)
    solver = "greedy"
    if config.solver in ("cpsat", "auto"):
        bin_of, solver = _refine(bin_of, m, info["greedy_objective"], lb, tokens, tiles, eff, table,
                                 config, lambda: backstop and elapsed() > config.time_limit_s,
                                 info)  # fmt: skip
    bin_of, m = finish(bin_of, m, tokens, tiles, problem, table, eff.microbatches[0])
    ordered = None  # (order, makespan): the makespan pick has them already
    if by_makespan:
        bin_of, m, *ordered = _select(bin_of, m, pool, tokens, tiles, eff, table, config, info)
    else:
        bin_of, m = _repaired_row_caps(bin_of, m, tokens, tiles, eff, table, info)
    obj, ti, si = _surrogate_of(bin_of, m, tokens, tiles, eff, table)
    plans = _ordered_plans(
        bin_of, m, (ti, si), ordered, tokens, tiles, problem, table, config, info
    )
    if problem.buckets.audio:  # audio frames weighed, every microbatch priced at its audio bucket
        try:
            plans = with_audio(plans, shapes, problem.buckets, problem.audio_always)
        except ValueError:  # a row's audio over the largest bucket: the audio packings only
            plans = None
        plans, obj = pick_with_audio(plans, shapes, problem, eff, table, config, info)
    return Schedule(plans, obj, lb, solver, elapsed(), info)


def _greedy(tokens, tiles, capped, table, pool, elapsed):
    """The greedy answer with no empty microbatch: (bin_of, m, lower bound, info), `info` starting
    the report with its surrogate and time. `capped`: (the problem with its microbatch counts capped
    at the sample count, the smallest count asked for). `pool` collects every greedy candidate
    (`select.py`)."""
    problem, lo = capped
    bin_of, m, _, lb = greedy_schedule(tokens, tiles, problem, table, pool)
    bin_of, m = ensure_nonempty(bin_of, m, problem.llm_dp, problem.microbatches[0])
    greedy_obj = evaluate(bin_of, m, tokens, tiles, problem, table)[0]
    info: dict = {"greedy_objective": greedy_obj, "greedy_time_s": elapsed()}
    if len(tokens) < lo:
        info["microbatches_below_range"] = (
            f"{len(tokens)} samples < {lo} microbatches: one sample each"
        )
    return bin_of, m, lb, info


def _repaired_row_caps(bin_of, m, tokens, tiles, problem, table, info):
    """(bin_of, m) as is, or, packed by row with a row over its tile cap (an infinite surrogate),
    the best fitting greedy candidate (`_fitting`)."""
    if problem.tiles_by_row and not np.isfinite(
        evaluate(bin_of, m, tokens, tiles, problem, table)[0]
    ):
        return _fitting(tokens, tiles, problem, table, info)
    return bin_of, m


def _surrogate_of(bin_of, m, tokens, tiles, problem, table):
    """(surrogate, tile bucket ids, length bucket ids) of the final assignment; raises when packed
    by row no candidate kept every row within the largest tile bucket."""
    obj, _, ti, si = evaluate(bin_of, m, tokens, tiles, problem, table)
    if not np.isfinite(obj):
        raise ValueError(
            f"tiles packed by row: no schedule keeps every row's tiles within the largest tile "
            f"bucket {problem.buckets.tiles[-1]} ({int(tiles.sum())} tiles, llm_dp="
            f"{problem.llm_dp}); raise the largest tile bucket or the microbatch count"
        )
    return obj, ti, si


def _ordered_plans(bin_of, m, buckets, ordered, tokens, tiles, problem, table, config, info):
    """The microbatch plans in run order, with the rest of the report in `info` (padding, load
    balance, the 1F1B makespans in that order and in solve order, and their lower bound).
    `buckets`: (tile, length) bucket ids per microbatch; `ordered`: (order, makespan) of the
    makespan pick, or None to order them here (`order_microbatches`)."""
    ti, si = buckets
    stage = table.stage[ti, si]  # [M, P, 2]
    if ordered is None:
        order, makespan = order_microbatches(stage, config.order_evaluations)
    else:
        order, makespan = ordered
    plans = to_plans(bin_of, m, ti, si, problem, table)
    plans = tuple(plans[k] for k in order)
    info.update(padding_ratios(plans, tokens, tiles, problem))
    info.update(load_balance(bin_of, m, tokens, tiles, problem.llm_dp))
    info.update(
        microbatches=m,
        simulated_makespan_s=makespan,
        solve_order_makespan_s=simulate(stage).step_time,
        makespan_lower_bound_s=makespan_lower_bound(stage),
    )
    return plans


def _select(bin_of, m, pool, tokens, tiles, problem, table, config, info):
    """(bin_of, m, order, 1F1B makespan) of the candidate with the lowest makespan (`select.py`);
    the surrogate's answer is candidate 0."""
    cands = [(bin_of, m)] + [
        finish(b, k, tokens, tiles, problem, table, problem.microbatches[0]) for b, k, _ in pool
    ]
    best, order, makespan, scores = pick_by_makespan(
        cands, tokens, tiles, problem, table, config.select_evaluations, config.order_evaluations
    )
    info.update(
        selected_by="makespan",
        candidates_scored=int(np.isfinite(scores).sum()),
        selected_surrogate_pick=best == 0,
    )
    return (*cands[best], order, makespan)


def _fitting(tokens, tiles, problem, table, info):
    """Packed by row, the greedy's surrogate pick may break a row's tile cap that `finish` cannot
    repair: then every greedy candidate, finished, and the one with the lowest finite surrogate
    (the first when none fits: `schedule_batch` says so)."""
    pool: list = []
    greedy_schedule(tokens, tiles, problem, table, pool)
    finished = [finish(b, k, tokens, tiles, problem, table, problem.microbatches[0])
                for b, k, _ in pool]  # fmt: skip
    objs = [evaluate(b, k, tokens, tiles, problem, table)[0] for b, k in finished]
    best = int(np.argmin(objs))
    info["fallback"] = "the surrogate's pick broke a row's tile cap: the best fitting candidate"
    return finished[best]


def _refine(bin_of, m, greedy_obj, lb, tokens, tiles, problem, table, config, stop, info):
    """LNS refinement; returns (bin_of, solver name). Falls back to the greedy on any problem."""
    if greedy_obj <= lb * (1 + 1e-4):
        info["fallback"] = "refinement skipped: the greedy reached the lower bound"
        return bin_of, "greedy"
    budget = LnsBudget(
        config.refine_rounds,
        config.refine_deterministic_time,
        config.round_deterministic_time,
        config.neighbourhood,
        config.max_cpsat_vars,
    )
    try:
        new, report = lns(bin_of, m, tokens, tiles, problem, table, budget, config.seed, lb, stop)
    except Aborted:
        info["wall_clock_cutoff"] = True
        info["fallback"] = (
            f"wall-clock cut-off ({config.time_limit_s}s) fired during the refinement: "
            "the deterministic greedy answer is returned"
        )
        return bin_of, "greedy"
    except Exception as e:  # the step must never fail because of the solver
        log.warning("refinement failed, keeping greedy: %r", e)
        info["fallback"] = f"exception: {e!r}"
        return bin_of, "greedy"
    info.update(report)
    obj = evaluate(new, m, tokens, tiles, problem, table)[0]
    info["refined_objective"] = obj
    if obj < greedy_obj - 1e-12:
        return new, "lns"
    info["fallback"] = "refinement found nothing better than greedy"
    return bin_of, "greedy"


def _check_problem(problem: ScheduleProblem) -> None:
    lo, hi = problem.microbatches
    if not (1 <= lo <= hi):
        raise ValueError(f"problem.microbatches={problem.microbatches}: need 1 <= min <= max")
    if problem.encoder_dp < 1 or problem.llm_dp < 1 or problem.num_stages < 1:
        raise ValueError(
            f"encoder_dp={problem.encoder_dp}, llm_dp={problem.llm_dp}, "
            f"num_stages={problem.num_stages}: all must be >= 1"
        )
