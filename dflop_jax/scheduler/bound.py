"""Lower bound on the surrogate, and the bucket-pair multiset that attains it (a packing target).

Relaxation: forget which sample sits in which bin and keep only aggregate capacities. Any schedule with
M microbatches uses M bucket pairs p_k = (T_k, S_k) with
  sum_k l_dp * S_k >= all tokens,  sum_k v_dp * T_k >= all tiles,
and, for every length bucket S_j, the samples longer than S_j sit in microbatches with S_k > S_j, so
  sum_{k: S_k > S_j} l_dp * S_k >= tokens of the samples longer than S_j   (same for tiles / T_j);
its surrogate is sum_k W(p_k) + (P-1) max_k W(p_k). The minimum of that over integer pair counts
(a tiny integer program: one count per bucket pair) is a valid lower bound; CP-SAT solves it in
milliseconds and we take its proven `best_objective_bound` (valid even if stopped early), with costs
rounded *down* to integer units. A weak-duality LP bound (`_dual_bound`) is the fallback. The optimal
counts are also a packing target for the greedy (`greedy.targeted_assign`).
"""

from __future__ import annotations

import logging
import math

import numpy as np
from ortools.sat.python import cp_model

from dflop_jax.contracts import ScheduleProblem
from dflop_jax.scheduler.objective import CostTable

_UNITS = 1_000_000
log = logging.getLogger(__name__)


def aggregate_bound(
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
    deterministic_limit: float = 0.05,
) -> tuple[float, list[tuple[int, int]] | None]:
    """(lower bound in seconds, target pairs [(ti, si)] * M or None), see the module docstring."""
    dual = _dual_bound(tokens, tiles, problem, table)
    lo, hi = problem.microbatches
    nt, ns = table.w.shape
    # a dominated pair can always be swapped for its dominator without breaking any constraint
    pairs = [(t, s) for t, s, _ in table.nondominated()]
    wmax = float(table.w.max()) or 1.0
    wint = [math.floor(table.w[t, s] / wmax * _UNITS) for t, s in pairs]
    ldp, edp = problem.llm_dp, problem.tile_shards
    cap_s = [int(table.lengths[s]) * ldp for _, s in pairs]
    cap_t = [int(table.tiles[t]) * edp for t, _ in pairs]

    model = cp_model.CpModel()
    n = [model.new_int_var(0, hi, f"n{p}") for p in range(len(pairs))]
    used = [model.new_bool_var(f"y{p}") for p in range(len(pairs))]
    top = model.new_int_var(0, max(wint), "top")
    model.add(sum(n) >= lo)
    model.add(sum(n) <= hi)
    for p in range(len(pairs)):
        model.add(n[p] <= hi * used[p])
        model.add(top >= wint[p]).only_enforce_if(used[p])
    for j, length in enumerate(table.lengths.tolist() + [0]):
        # j == len: all samples; else samples longer than S_j need pairs with S > S_j
        thr = -1 if j == ns else length
        need = int(tokens[tokens > thr].sum())
        if need:
            model.add(
                sum(n[p] * cap_s[p] for p, (_, s) in enumerate(pairs) if table.lengths[s] > thr)
                >= need
            )
    for j, tb in enumerate(table.tiles.tolist() + [0]):
        thr = -1 if j == nt else tb * edp
        need = int(tiles[tiles > thr].sum())
        if need:
            model.add(
                sum(n[p] * cap_t[p] for p, (t, _) in enumerate(pairs) if table.tiles[t] * edp > thr)
                >= need
            )
    model.minimize(sum(n[p] * wint[p] for p in range(len(pairs))) + (problem.num_stages - 1) * top)
    solver = cp_model.CpSolver()
    # a deterministic stop only: a wall-clock limit firing on a loaded machine would change the bound
    # and the packing target, hence the greedy's answer
    solver.parameters.max_deterministic_time = deterministic_limit
    solver.parameters.num_workers = 1
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return dual, None
    bound = solver.best_objective_bound * wmax / _UNITS
    log.debug("aggregate bound: %s in %.3fs", solver.status_name(status), solver.wall_time)
    target = [pairs[p] for p in range(len(pairs)) for _ in range(solver.value(n[p]))]
    return max(dual, bound), target


def _dual_bound(
    tokens: np.ndarray, tiles: np.ndarray, problem: ScheduleProblem, table: CostTable
) -> float:
    """LP-relaxation bound by weak duality over a (lambda, mu) grid; valid for any grid point."""
    counts = range(problem.microbatches[0], problem.microbatches[1] + 1)
    s = np.repeat(table.lengths[None, :], len(table.tiles), 0).ravel().astype(np.float64)  # [nP]
    t = np.repeat(table.tiles[:, None], len(table.lengths), 1).ravel().astype(np.float64)
    w = table.w.ravel()
    a = float(tokens.sum()) / problem.llm_dp
    bt = float(tiles.sum()) / problem.tile_shards
    # the largest sample by tiles and the largest by tokens may differ: each alone forces a pair
    ti, si = table.pair_for(
        np.array([np.ceil(tiles.max() / problem.tile_shards - 1e-9), 0.0]),
        np.array([0.0, tokens.max()]),
    )
    w_big = float(table.w[ti, si].max())
    wscale = max(float(w.max()), 1e-30)
    lam = np.concatenate([[0.0], np.geomspace(1e-3, 10.0, 60)]) * wscale / s.max()
    mu = np.concatenate([[0.0], np.geomspace(1e-3, 10.0, 60)]) * wscale / t.max()
    reduced = (
        w[None, None, :]
        - lam[:, None, None] * s[None, None, :]
        - mu[None, :, None] * t[None, None, :]
    )
    best = np.inf
    for cap in np.unique(w[w >= w_big - 1e-15]):
        ok = w <= cap + 1e-15
        min_red = reduced[:, :, ok].min(axis=2)  # [L, U]
        ms = np.asarray(list(counts), dtype=np.float64)
        dual = ms[:, None, None] * min_red[None] + lam[None, :, None] * a + mu[None, None, :] * bt
        # each microbatch costs at least min W and one costs >= w_big
        floor = (ms - 1) * float(w[ok].min()) + w_big
        bound = np.maximum(dual.reshape(len(ms), -1).max(axis=1), floor)
        best = min(best, float(bound.min()) + (problem.num_stages - 1) * float(cap))
    return float(best)
