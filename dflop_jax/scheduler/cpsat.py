"""CP-SAT refinement of a greedy schedule, at the greedy's microbatch count (OR-Tools cp_model).

Model (M fixed, bins b = (k, r)):
  x[i, b]  sample i in bin b                    exactly one b per i
  u[k, p]  microbatch k uses bucket pair p      exactly one p per k (non-dominated pairs only)
  tokens of bin (k, r) <= sum_p S_p u[k, p];  tiles of microbatch k <= v_dp * sum_p T_p u[k, p]
  cost_k = sum_p W_p u[k, p] (W in integer units of max W / 1e5)
  minimize sum_k cost_k + (P - 1) cost_0,  capped at the greedy's value
Symmetry breaking: cost_k >= cost_{k+1} (so cost_0 is the max) and, inside a microbatch, shard loads
non-increasing. The greedy answer, relabelled to satisfy both orders, is the hint, so the model always
starts from a feasible solution at the cap.

Determinism: with `config.deterministic` the search is interleaved (`interleave_search`) and stopped by
`max_deterministic_time` (DETERMINISTIC_FRACTION x time_limit_s), so a seed gives the same answer on any machine load; the wall-clock
`max_time_in_seconds` stays as the hard backstop and `info["cpsat_wall_limited"]` flags the rare runs it
cut. Without it, `num_workers` parallel workers race and results can vary run to run.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from ortools.sat.python import cp_model

from dflop_jax.scheduler.config import SchedulerConfig
from dflop_jax.scheduler.objective import CostTable
from dflop_jax.scheduler.types import ScheduleProblem

_W_UNITS = 100_000
# deterministic-time budget as a fraction of the wall limit, so the deterministic stop usually comes
# first even after the greedy used part of the wall budget
DETERMINISTIC_FRACTION = 0.5
WALL_FRACTION = 0.6
BUILD_FRACTION = 0.5  # of the budget, for building the model


_STATUS_NAMES = {
    cp_model.OPTIMAL: "OPTIMAL",
    cp_model.FEASIBLE: "FEASIBLE",
    cp_model.INFEASIBLE: "INFEASIBLE",
    cp_model.MODEL_INVALID: "MODEL_INVALID",
    cp_model.UNKNOWN: "UNKNOWN",
}


@dataclasses.dataclass
class RefineResult:
    bin_of: np.ndarray | None  # None: keep the greedy
    reason: str
    info: dict


def refine_cpsat(
    bin_of: np.ndarray,
    m: int,
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
    config: SchedulerConfig,
    seed: int,
    budget_s: float,
) -> RefineResult:
    """Tries to improve `bin_of` within `budget_s` wall seconds; see the module docstring."""
    t0 = time.perf_counter()
    n, ldp, nb = len(tokens), problem.llm_dp, m * problem.llm_dp
    if n * nb > config.max_cpsat_vars:
        return RefineResult(
            None, f"cpsat skipped: {n}x{nb} assignment variables > max_cpsat_vars", {}
        )
    pairs = table.nondominated()
    wmax = max(w for _, _, w in pairs) or 1.0
    wint = [int(round(w / wmax * _W_UNITS)) for _, _, w in pairs]
    tok = [int(v) for v in tokens]
    til = [int(v) for v in tiles]

    hint_bins, hint_pairs = _relabelled_hint(bin_of, m, tokens, tiles, problem, table, pairs, wint)
    # building is plain Python and cannot be interrupted by the solver's limit: check a deadline
    deadline = t0 + BUILD_FRACTION * budget_s
    model = cp_model.CpModel()
    x = []
    for _ in range(n):
        x.append([model.new_bool_var("") for _ in range(nb)])
        if time.perf_counter() > deadline:
            return _too_slow(t0, budget_s)
    u = [[model.new_bool_var("") for _ in pairs] for _ in range(m)]
    for i in range(n):
        model.add_exactly_one(x[i])
    cost = []
    ws = cp_model.LinearExpr.weighted_sum
    s_caps = [int(table.lengths[s]) for _, s, _ in pairs]
    t_caps = [int(table.tiles[t]) * problem.encoder_dp for t, _, _ in pairs]
    with_tiles = [i for i in range(n) if til[i]]
    for k in range(m):
        model.add_exactly_one(u[k])
        cap_s, cap_t = ws(u[k], s_caps), ws(u[k], t_caps)
        loads = [ws([x[i][k * ldp + r] for i in range(n)], tok) for r in range(ldp)]
        for r in range(ldp):
            model.add(loads[r] <= cap_s)
            if r + 1 < ldp:
                model.add(loads[r] >= loads[r + 1])
        if with_tiles:
            tile_vars = [x[i][k * ldp + r] for i in with_tiles for r in range(ldp)]
            model.add(ws(tile_vars, [til[i] for i in with_tiles for _ in range(ldp)]) <= cap_t)
        cost.append(ws(u[k], wint))
        if time.perf_counter() > deadline:
            return _too_slow(t0, budget_s)
    for k in range(m - 1):
        model.add(cost[k] >= cost[k + 1])
    objective = sum(cost) + (problem.num_stages - 1) * cost[0]
    hint_obj = sum(wint[p] for p in hint_pairs) + (problem.num_stages - 1) * wint[hint_pairs[0]]
    model.add(objective <= hint_obj)
    model.minimize(objective)
    hint = model.proto.solution_hint  # bulk: add_hint per variable costs ~30 us each
    hint.vars.extend([v.index for row in x for v in row] + [v.index for row in u for v in row])
    hint.values.extend(
        [int(b == hint_bins[i]) for i in range(n) for b in range(nb)]
        + [int(p == hint_pairs[k]) for k in range(m) for p in range(len(pairs))]
    )

    build_s = time.perf_counter() - t0
    remaining = budget_s - build_s
    info = {"cpsat_build_s": build_s, "cpsat_vars": n * nb + m * len(pairs)}
    if remaining <= 0.01:
        return RefineResult(
            None, f"cpsat skipped: model building took {build_s:.3f}s of the time limit", info
        )
    solver = cp_model.CpSolver()
    # leave room for decoding and the report so the whole call stays within its limit
    solver.parameters.max_time_in_seconds = WALL_FRACTION * remaining
    solver.parameters.num_workers = config.num_workers
    # measured at N=256 x 32 bins: presolve ate > 3 s without a solution; without it the hint is
    # loaded at once, so the search starts from the greedy answer within the budget
    solver.parameters.cp_model_presolve = False
    solver.parameters.random_seed = seed
    if config.deterministic:
        solver.parameters.interleave_search = True
        solver.parameters.max_deterministic_time = DETERMINISTIC_FRACTION * config.time_limit_s
    t_solve = time.perf_counter()
    status = _solve(solver, model)
    wall = time.perf_counter() - t_solve
    name = _STATUS_NAMES.get(status, str(status))
    info.update(
        cpsat_status=name,
        cpsat_solve_s=wall,
        cpsat_wall_limited=bool(wall >= WALL_FRACTION * remaining * 0.98),
    )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return RefineResult(None, f"cpsat status {name}", info)
    # read the assignment straight from the response (one value per model variable)
    sol = np.asarray(solver.response_proto.solution, dtype=np.int64)
    xv = sol[np.array([[v.index for v in row] for row in x])]  # [N, bins] 0/1
    if xv.shape != (n, nb) or not np.all(xv.sum(axis=1) == 1):
        return RefineResult(
            None, "cpsat returned an assignment that is not one bin per sample", info
        )
    return RefineResult(xv.argmax(axis=1), "", info)


def _too_slow(t0: float, budget_s: float) -> RefineResult:
    build_s = time.perf_counter() - t0
    reason = (
        f"cpsat skipped: model building passed {BUILD_FRACTION:.0%} of the {budget_s:.3f}s budget"
    )
    return RefineResult(None, reason, {"cpsat_build_s": build_s})


def _solve(solver: cp_model.CpSolver, model: cp_model.CpModel):
    """The one call into the solver (a seam for tests forcing timeouts or bad statuses)."""
    return solver.solve(model)


def _relabelled_hint(bin_of, m, tokens, tiles, problem, table, pairs, wint):
    """Greedy bins relabelled to the symmetry-breaking orders, and each microbatch's cheapest fitting pair."""
    ldp = problem.llm_dp
    tok_load = np.bincount(bin_of, weights=tokens, minlength=m * ldp).reshape(m, ldp)
    tile_load = np.bincount(bin_of // ldp, weights=tiles, minlength=m)
    chosen = []
    for k in range(m):
        fit = [
            p
            for p, (t, s, _) in enumerate(pairs)
            if table.lengths[s] >= tok_load[k].max()
            and table.tiles[t] * problem.encoder_dp >= tile_load[k]
        ]
        chosen.append(min(fit, key=lambda p: (wint[p], p)))
    mb_order = sorted(range(m), key=lambda k: (-wint[chosen[k]], k))  # new k -> old k
    new_bin = np.empty(m * ldp, dtype=np.int64)  # old bin -> new bin
    for new_k, old_k in enumerate(mb_order):
        shard_order = sorted(range(ldp), key=lambda r: (-tok_load[old_k, r], r))
        for new_r, old_r in enumerate(shard_order):
            new_bin[old_k * ldp + old_r] = new_k * ldp + new_r
    return new_bin[bin_of], [chosen[k] for k in mb_order]
