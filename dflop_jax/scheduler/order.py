"""Stage-aware microbatch order: the order that shortens the simulated 1F1B step (DESIGN section 4).

The surrogate `sum_k W_k + (P-1) max_k W_k` sees a microbatch only through its slowest stage, so it is
blind to order. In a pipeline with encoder stages a tile-heavy microbatch is slow on the encoder stages
and a token-heavy one on the LLM stages; which one goes first decides the fill and drain bubbles. We
score orders with the simulator's 1F1B makespan (`sim.pipeline.simulate`, the figure the planner
uses): a few seeds (as given, heaviest first, lightest first, and encoder-heavy/LLM-heavy interleaved)
then first-improvement moves (move one microbatch to another position, or swap two) until none helps or
`max_evaluations` simulations were spent (deterministic: no randomness, no clock).

`makespan_lower_bound` is a bound valid for every order and every pipeline schedule of the same
microbatches: stage s cannot start before the cheapest forward reaches it, must do all its own work,
and its last backward still has to flow back through the stages before it.
"""

from __future__ import annotations

import numpy as np

from dflop_jax.sim.pipeline import simulate


def makespan_lower_bound(costs: np.ndarray) -> float:
    """Lower bound on any pipeline step over microbatches `costs` [M, P, 2] (module docstring)."""
    costs = np.asarray(costs, dtype=np.float64)
    fwd_before = (
        np.cumsum(costs[:, :, 0], axis=1) - costs[:, :, 0]
    )  # [M, P] forwards before stage s
    bwd_before = np.cumsum(costs[:, :, 1], axis=1) - costs[:, :, 1]
    per_stage = costs.sum(axis=(0, 2)) + fwd_before.min(axis=0) + bwd_before.min(axis=0)  # [P]
    one_mb = costs.sum(axis=(1, 2)).max()  # a microbatch's own chain through every stage
    return float(max(per_stage.max(), one_mb))


def order_microbatches(costs: np.ndarray, max_evaluations: int = 200) -> tuple[list[int], float]:
    """(order, 1F1B makespan) of the best order found; `costs` [M, P, 2] in the current order."""
    costs = np.asarray(costs, dtype=np.float64)
    m, p, _ = costs.shape
    ident = list(range(m))
    if m < 2 or p < 2:
        return ident, simulate(costs).step_time
    evals = 0

    def score(order):
        nonlocal evals
        evals += 1
        return simulate(costs[order]).step_time

    best = min(_seeds(costs), key=lambda o: (score(o), o))
    best_t = score(best)
    improved = True
    while improved and evals < max_evaluations:
        improved = False
        for cand in _neighbours(best):
            if evals >= max_evaluations:
                break
            t = score(cand)
            if t < best_t - 1e-12:
                best, best_t, improved = cand, t, True
                break
    return best, best_t


def _neighbours(order: list[int]):
    """Orders one move away: a microbatch moved to another position, or two swapped."""
    m = len(order)
    for i in range(m):
        for j in range(m):
            if i != j:
                cand = order[:i] + order[i + 1 :]
                cand.insert(j, order[i])
                yield cand
    for i in range(m):
        for j in range(i + 2, m):  # adjacent swaps are moves already
            cand = list(order)
            cand[i], cand[j] = cand[j], cand[i]
            yield cand


def _seeds(costs: np.ndarray) -> list[list[int]]:
    """Starting orders: as given, heaviest first, lightest first, encoder/LLM-heavy interleaved."""
    m, p, _ = costs.shape
    w = costs.sum(axis=2).max(axis=1)  # [M] slowest stage of each microbatch
    total = costs.sum(axis=2)  # [M, P]
    tilt = total[:, 0] / np.maximum(total.max(axis=1), 1e-30)  # share of the first stage
    by_tilt = list(np.lexsort((np.arange(m), -tilt)))
    mix = [int(by_tilt[i // 2] if i % 2 == 0 else by_tilt[m - 1 - i // 2]) for i in range(m)]
    return [
        list(range(m)),
        [int(k) for k in np.lexsort((np.arange(m), -w))],
        [int(k) for k in np.lexsort((np.arange(m), w))],
        mix,
    ]
