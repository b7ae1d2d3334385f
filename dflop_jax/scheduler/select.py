"""Candidate choice by the pipeline's 1F1B makespan (DESIGN section 4).

The greedy and the refinement compare candidates by the surrogate `sum_k W_k + (P-1) max_k W_k`, which
sees a microbatch only through its slowest stage. With encoder stages in the pipeline a tile-heavy
microbatch is slow on the encoder stages and a token-heavy one on the LLM stages; two packings with
the same surrogate can differ by whole bubbles. So when the pipeline has more than one stage, the
candidates the greedy built (every microbatch count and packing it tried) and the refinement's answer
are scored by the simulated 1F1B makespan of a good order of their microbatches, in two rounds:

1. every distinct candidate: `order.py`'s search cut at `quick` simulations (its seed orders, then
   first-improvement moves);
2. the surrogate's own pick (candidate 0) and the `finalists` best others of round 1: the full order
   search (`full` simulations). The lowest makespan wins; ties go to the lower surrogate, then to the
   earlier candidate.

Round 2 always includes the surrogate's pick with the same search the surrogate rule runs on it, so the
answer's makespan is never worse than the surrogate rule's; round 1 alone is not enough for that (a
short search can rank two candidates the other way round from a long one).

Everything is evaluated at the candidates' static buckets (what the runtime pays). Deterministic: no
randomness, no clock; the cost is `quick` simulations per distinct candidate (~10-20 candidates) plus
at most `finalists + 1` full searches.
"""

from __future__ import annotations

import numpy as np

from dflop_jax.contracts import ScheduleProblem
from dflop_jax.scheduler.greedy import balance_shards, ensure_nonempty
from dflop_jax.scheduler.objective import CostTable, evaluate
from dflop_jax.scheduler.order import order_microbatches
from dflop_jax.scheduler.rows import fit_rows


def finish(
    bin_of, m, tokens, tiles, problem: ScheduleProblem, table: CostTable, min_count: int
) -> tuple[np.ndarray, int]:
    """What the runtime gets from a candidate: no empty microbatch, shards balanced (never dearer);
    with tiles packed by row, each row's tiles balanced and within the largest bucket (`rows.py`;
    the token-only balancing, blind to tiles, is then left out)."""
    bin_of, m = ensure_nonempty(bin_of, m, problem.llm_dp, min_count)
    if problem.tiles_by_row:
        return fit_rows(bin_of, m, tokens, tiles, problem, table), m
    return balance_shards(bin_of, m, tokens, problem.llm_dp), m


def pick_by_makespan(
    candidates: list[tuple[np.ndarray, int]],
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
    quick: int,
    full: int,
    finalists: int = 2,
) -> tuple[int, list[int], float, list[float]]:
    """(index of the best candidate, its order, its 1F1B makespan, round-1 scores; inf: duplicate).

    `candidates` are finished (`finish`) (bin_of, m) pairs, the surrogate's pick first; see the
    module docstring for the rule.
    """
    seen: set[bytes] = set()
    stages, objs, scores = [], [], []
    for bin_of, m in candidates:
        sig = np.asarray(bin_of, dtype=np.int64).tobytes() + int(m).to_bytes(4, "little")
        obj, _, ti, si = evaluate(bin_of, m, tokens, tiles, problem, table)
        stages.append(table.stage[ti, si])
        objs.append(obj)
        fresh = sig not in seen and np.isfinite(
            obj
        )  # inf: infeasible (a row over the largest tile bucket)
        seen.add(sig)
        scores.append(order_microbatches(stages[-1], quick)[1] if fresh else np.inf)
    ranked = sorted(range(1, len(candidates)), key=lambda i: (scores[i], objs[i], i))
    final = [0] + [i for i in ranked[:finalists] if np.isfinite(scores[i])]
    results = {i: order_microbatches(stages[i], full) for i in final}
    best = min(final, key=lambda i: (results[i][1], objs[i], i))
    return best, results[best][0], results[best][1], scores
