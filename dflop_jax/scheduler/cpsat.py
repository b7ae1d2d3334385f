"""Exact CP-SAT re-packing of a few microbatches (the move of the large-neighbourhood search, `lns.py`).

Model over a neighbourhood: the samples of `m` microbatches (bins b = (k, r)), everything else fixed:
  x[i, b]  sample i in bin b                    exactly one b per i
  u[k, p]  microbatch k uses bucket pair p      exactly one p per k (non-dominated pairs only)
  tokens of bin (k, r) <= sum_p S_p u[k, p];  tiles of microbatch k <= v_dp * sum_p T_p u[k, p]
  every microbatch holds at least one sample (no empty microbatch)
  cost_k = sum_p W_p u[k, p] (W in integer units of max W / 1e5)
  minimize sum_k cost_k + (P - 1) max(cost_0, top outside the neighbourhood),  capped at the hint's value,
  then (second key) the tokens of the cheapest microbatch: equal-cost re-packings gather the slack there
Symmetry breaking: cost_k >= cost_{k+1} (so cost_0 is the neighbourhood's max) and, inside a
microbatch, shard loads non-increasing. The current answer, relabelled to satisfy both orders, is the
hint, so the search starts from a feasible solution at the cap.

Determinism: one worker, stopped by `max_deterministic_time` only, so the same neighbourhood and seed
give the same answer on any machine load. The caller's wall clock is the only time guard (`solve.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from ortools.sat.python import cp_model

from dflop_jax.scheduler.objective import CostTable

W_UNITS = 100_000

STATUS_NAMES = {
    cp_model.OPTIMAL: "OPTIMAL",
    cp_model.FEASIBLE: "FEASIBLE",
    cp_model.INFEASIBLE: "INFEASIBLE",
    cp_model.MODEL_INVALID: "MODEL_INVALID",
    cp_model.UNKNOWN: "UNKNOWN",
}


@dataclasses.dataclass(frozen=True)
class Neighbourhood:
    """A re-packing sub-problem: these samples into `m` microbatches of `ldp` shards.

    Attributes:
      tokens, tiles: [n] of the neighbourhood's samples.
      hint: [n] current bin of each sample, in 0..m*ldp-1.
      m, ldp, edp: microbatches, LLM and encoder data-parallel sizes.
      num_stages: P of the surrogate.
      outside_top: largest W (integer units) among the microbatches outside (0 if none).
    """

    tokens: np.ndarray
    tiles: np.ndarray
    hint: np.ndarray
    m: int
    ldp: int
    edp: int
    num_stages: int
    outside_top: int


@dataclasses.dataclass
class RepackResult:
    bin_of: np.ndarray | None  # [n] new bins, None: keep the hint
    status: str
    deterministic_time: float


def int_costs(table: CostTable) -> tuple[list[tuple[int, int, float]], list[int]]:
    """Non-dominated bucket pairs and their W in integer units (W_UNITS = the largest W)."""
    pairs = table.nondominated()
    wmax = max(w for _, _, w in pairs) or 1.0
    return pairs, [int(round(w / wmax * W_UNITS)) for _, _, w in pairs]


def repack(
    nb: Neighbourhood,
    table: CostTable,
    pairs: list[tuple[int, int, float]],
    wint: list[int],
    deterministic_time: float,
    seed: int,
) -> RepackResult:
    """Best re-packing of the neighbourhood found within `deterministic_time` (module docstring)."""
    model, x, hint_key = _build(nb, table, pairs, wint)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = deterministic_time
    solver.parameters.random_seed = seed
    # presolve spends the budget before loading the hint; without it the search starts at the hint
    solver.parameters.cp_model_presolve = False
    status = _solve(solver, model)
    name = STATUS_NAMES.get(status, str(status))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # charged the whole round
        return RepackResult(None, name, deterministic_time)
    used = float(solver.response_proto.deterministic_time)
    if solver.objective_value >= hint_key:
        return RepackResult(None, name, used)
    sol = np.asarray(solver.response_proto.solution, dtype=np.int64)
    xv = sol[np.array([[v.index for v in row] for row in x])]  # [n, bins] 0/1
    if not np.all(xv.sum(axis=1) == 1):
        return RepackResult(None, "not one bin per sample", used)
    return RepackResult(xv.argmax(axis=1), name, used)


def _build(nb: Neighbourhood, table: CostTable, pairs, wint):
    """The CP-SAT model of the module docstring with the relabelled hint: (model, x, objective at the hint)."""
    n, m, ldp = len(nb.tokens), nb.m, nb.ldp
    tok = [int(v) for v in nb.tokens]
    til = [int(v) for v in nb.tiles]
    hint_bins, hint_pairs = _relabelled_hint(nb, table, pairs, wint)
    model = cp_model.CpModel()
    x = [[model.new_bool_var("") for _ in range(m * ldp)] for _ in range(n)]
    u = [[model.new_bool_var("") for _ in pairs] for _ in range(m)]
    ws = cp_model.LinearExpr.weighted_sum
    s_caps = [int(table.lengths[s]) for _, s, _ in pairs]
    t_caps = [int(table.tiles[t]) * nb.edp for t, _, _ in pairs]
    with_tiles = [i for i in range(n) if til[i]]
    for i in range(n):
        model.add_exactly_one(x[i])
    cost = []
    for k in range(m):
        model.add_exactly_one(u[k])
        cap_s = ws(u[k], s_caps)
        loads = [ws([x[i][k * ldp + r] for i in range(n)], tok) for r in range(ldp)]
        for r in range(ldp):
            model.add(loads[r] <= cap_s)
            if r + 1 < ldp:
                model.add(loads[r] >= loads[r + 1])
        model.add(sum(x[i][k * ldp] for i in range(n)) >= 1)  # shard 0 is the fullest: non-empty
        if with_tiles:
            tile_vars = [x[i][k * ldp + r] for i in with_tiles for r in range(ldp)]
            weights = [til[i] for i in with_tiles for _ in range(ldp)]
            model.add(ws(tile_vars, weights) <= ws(u[k], t_caps))
        cost.append(ws(u[k], wint))
    for k in range(m - 1):
        model.add(cost[k] >= cost[k + 1])
    top = model.new_int_var(nb.outside_top, max(max(wint), nb.outside_top), "top")
    model.add(top >= cost[0])
    objective = sum(cost) + (nb.num_stages - 1) * top
    hint_top = max(wint[hint_pairs[0]], nb.outside_top)
    hint_obj = sum(wint[p] for p in hint_pairs) + (nb.num_stages - 1) * hint_top
    model.add(objective <= hint_obj)
    # second key: empty the cheapest microbatch (tokens of its bins), so that equal-cost re-packings
    # gather the slack in one place, where a later round can drop that microbatch a bucket step
    last = ws(
        [x[i][(m - 1) * ldp + r] for i in range(n) for r in range(ldp)],
        [tok[i] for i in range(n) for _ in range(ldp)],
    )
    model.minimize(objective * (sum(tok) + 1) + last)
    hint_last = sum(tok[i] for i in range(n) if hint_bins[i] // ldp == m - 1)
    hint = model.proto.solution_hint  # bulk: add_hint per variable costs ~30 us each
    hint.vars.extend(
        [v.index for row in x for v in row] + [v.index for row in u for v in row] + [top.index]
    )
    hint.values.extend(
        [int(b == hint_bins[i]) for i in range(n) for b in range(m * ldp)]
        + [int(p == hint_pairs[k]) for k in range(m) for p in range(len(pairs))]
        + [hint_top]
    )
    return model, x, hint_obj * (sum(tok) + 1) + hint_last


def _solve(solver: cp_model.CpSolver, model: cp_model.CpModel):
    """The one call into the solver (a seam for tests forcing bad statuses)."""
    return solver.solve(model)


def _relabelled_hint(nb: Neighbourhood, table: CostTable, pairs, wint):
    """Hint bins relabelled to the symmetry-breaking orders, and each microbatch's cheapest fitting pair."""
    m, ldp = nb.m, nb.ldp
    tok_load = np.bincount(nb.hint, weights=nb.tokens, minlength=m * ldp).reshape(m, ldp)
    tile_load = np.bincount(nb.hint // ldp, weights=nb.tiles, minlength=m)
    chosen = []
    for k in range(m):
        fit = [
            p
            for p, (t, s, _) in enumerate(pairs)
            if table.lengths[s] >= tok_load[k].max() and table.tiles[t] * nb.edp >= tile_load[k]
        ]
        chosen.append(min(fit, key=lambda p: (wint[p], p)))
    mb_order = sorted(range(m), key=lambda k: (-wint[chosen[k]], k))  # new k -> old k
    new_bin = np.empty(m * ldp, dtype=np.int64)  # old bin -> new bin
    for new_k, old_k in enumerate(mb_order):
        shard_order = sorted(range(ldp), key=lambda r: (-tok_load[old_k, r], r))
        for new_r, old_r in enumerate(shard_order):
            new_bin[old_k * ldp + old_r] = new_k * ldp + new_r
    return new_bin[nb.hint], [chosen[k] for k in mb_order]
