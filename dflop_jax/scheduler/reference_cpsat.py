"""The DFLOP reference's own scheduling model, solved with CP-SAT (a baseline, `baselines.py`).

The reference balances whole samples over bins (microbatch x data-parallel shard) with a min-max
integer program over two per-sample costs, vision and LLM, and knows nothing of buckets:

    minimize  max_b max(sum_{i in b} v_i, sum_{i in b} l_i),   every sample in exactly one bin,

with v_i = seconds per tile x tiles_i and l_i = seconds per token x tokens_i, both read off the cost
table (`baselines.side_rates`). We solve that model (LPT answer as hint, one worker, a
deterministic-time limit, so it is reproducible) and then run its answer through the same evaluator as
DFLOP's: each microbatch gets the cheapest static buckets that hold what it was given, a bin over the
largest buckets is repaired as for reference-like. This is the reference's formulation, not its code
(which times out, retries at 10x its limit, and raises when N < bins).
"""

from __future__ import annotations

import numpy as np
from ortools.sat.python import cp_model

_UNITS = 1_000_000


def minmax_bins(
    vision: np.ndarray, llm: np.ndarray, bins: int, hint: np.ndarray, deterministic_time: float
) -> np.ndarray:
    """bin_of [N] minimising the largest per-bin max(vision load, LLM load); `hint` if none better."""
    scale = _UNITS / max(float(vision.sum()), float(llm.sum()), 1e-30)
    v = [int(round(x * scale)) for x in vision]
    lc = [int(round(x * scale)) for x in llm]
    n = len(v)
    model = cp_model.CpModel()
    x = [[model.new_bool_var("") for _ in range(bins)] for _ in range(n)]
    top = model.new_int_var(0, max(sum(v), sum(lc)), "top")
    ws = cp_model.LinearExpr.weighted_sum
    for i in range(n):
        model.add_exactly_one(x[i])
    for b in range(bins):
        col = [x[i][b] for i in range(n)]
        model.add(ws(col, v) <= top)
        model.add(ws(col, lc) <= top)
    model.minimize(top)
    for i in range(n):
        for b in range(bins):
            model.add_hint(x[i][b], int(hint[i] == b))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = deterministic_time
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint
    sol = np.array([[solver.value(x[i][b]) for b in range(bins)] for i in range(n)])
    return sol.argmax(axis=1)
