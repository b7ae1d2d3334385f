"""Candidate choice by the pipeline's 1F1B makespan (issue 14 item 3, DESIGN section 4).

The greedy and the refinement compare candidates by the surrogate `sum_k W_k + (P-1) max_k W_k`, which
sees a microbatch only through its slowest stage. With encoder stages in the pipeline a tile-heavy
microbatch is slow on the encoder stages and a token-heavy one on the LLM stages; two packings with
the same surrogate can differ by whole bubbles. So when the pipeline has more than one stage, the
candidates the greedy built (every microbatch count and packing it tried) and the refinement's answer
are scored by the simulated 1F1B makespan of a good order of their microbatches (`order.py`'s search
with `evaluations` simulations: its seed orders, then first-improvement moves), and the lowest wins;
ties go to the lower surrogate, then to the earlier candidate. The winner's order is then searched
with the full order budget by the caller.

Everything is evaluated at the candidates' static buckets (what the runtime pays). Deterministic: no
randomness, no clock; the cost is `evaluations` simulations per distinct candidate (~15 candidates).
"""

from __future__ import annotations

import numpy as np

from dflop_jax.scheduler.greedy import balance_shards, ensure_nonempty
from dflop_jax.scheduler.objective import CostTable, evaluate
from dflop_jax.scheduler.order import order_microbatches
from dflop_jax.scheduler.types import ScheduleProblem


def finish(bin_of, m, tokens, problem: ScheduleProblem, min_count: int) -> tuple[np.ndarray, int]:
    """What the runtime gets from a candidate: no empty microbatch, shards balanced (never dearer)."""
    bin_of, m = ensure_nonempty(bin_of, m, problem.llm_dp, min_count)
    return balance_shards(bin_of, m, tokens, problem.llm_dp), m


def pick_by_makespan(
    candidates: list[tuple[np.ndarray, int]],
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
    evaluations: int,
) -> tuple[int, list[float]]:
    """(index of the best candidate, per-candidate makespan score; inf for duplicates).

    `candidates` are finished (`finish`) (bin_of, m) pairs; see the module docstring for the rule.
    """
    seen: set[bytes] = set()
    scores, keys = [], []
    for idx, (bin_of, m) in enumerate(candidates):
        sig = np.asarray(bin_of, dtype=np.int64).tobytes() + m.to_bytes(4, "little")
        obj, _, ti, si = evaluate(bin_of, m, tokens, tiles, problem, table)
        t = np.inf
        if sig not in seen:
            seen.add(sig)
            t = order_microbatches(table.stage[ti, si], evaluations)[1]
        scores.append(float(t))
        keys.append((t, obj, idx))
    return min(keys)[2], scores
