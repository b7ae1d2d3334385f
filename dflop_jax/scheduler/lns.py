"""Large-neighbourhood search: exact CP-SAT re-packing of a few microbatches at a time.

Each round takes q microbatches of the current answer (the neighbourhood), re-packs their samples
exactly with CP-SAT (`cpsat.repack`, everything else fixed) and keeps the result when it lowers the
surrogate, or keeps it equal while gathering slack in the neighbourhood's cheapest microbatch (the
model's second key), so that plateaus are crossed. It is exact on small batches (the neighbourhood is
then the whole batch); on the benchmark batches the greedy's minimum-slack filling usually reaches the
bound first and the search is skipped (docs/benchmarks.md says where it found nothing).

Neighbourhoods: the first microbatch is drawn with probability inversely proportional to its
relative excess over its nearest cheaper bucket pair (the ones closest to dropping a bucket step;
uniform when no microbatch has a cheaper pair), the others with probability proportional to their
relative room under their current pair, all from a generator seeded by `seed`; a neighbourhood that
failed is not retried until something changes. q shrinks so a model stays under `max_vars`
assignment variables.

Budget, in deterministic units only: at most `rounds` rounds and `deterministic_time` CP-SAT
deterministic seconds in total (`round_deterministic_time` per round). The search is a pure function
of (batch, problem, config); `stop()` (the caller's wall-clock backstop) can only abort it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from dflop_jax.contracts import ScheduleProblem
from dflop_jax.scheduler.cpsat import W_UNITS, Neighbourhood, int_costs, repack
from dflop_jax.scheduler.objective import CostTable, evaluate


class Aborted(Exception):
    """The caller's stop() fired: the search's answer would depend on the machine's speed."""


@dataclasses.dataclass(frozen=True)
class LnsBudget:
    """Deterministic budget of one search (see the module docstring)."""

    rounds: int
    deterministic_time: float
    round_deterministic_time: float
    neighbourhood: int
    max_vars: int


def lns(
    bin_of: np.ndarray,
    m: int,
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
    budget: LnsBudget,
    seed: int,
    lower_bound: float,
    stop: Callable[[], bool],
) -> tuple[np.ndarray, dict]:
    """Improves `bin_of` (no microbatch empty) by re-packing neighbourhoods; returns (bin_of, report).

    Raises:
      Aborted: when `stop()` returns True between rounds.
    """
    rng = np.random.default_rng(seed)
    pairs, wint = int_costs(table)
    best = bin_of.copy()
    obj = evaluate(best, m, tokens, tiles, problem, table)[0]
    det_used, rounds, improved = 0.0, 0, 0
    failed: set[tuple[int, ...]] = set()
    while rounds < budget.rounds and det_used < budget.deterministic_time:
        if obj <= lower_bound * (1 + 1e-4):
            break
        if stop():
            raise Aborted
        ks = _pick(best, m, tokens, tiles, problem, table, budget, rng, failed)
        if ks is None:
            break
        rounds += 1
        res, members = _repack(
            best, ks, m, tokens, tiles, problem, table, pairs, wint, budget, seed
        )
        det_used += res.deterministic_time
        cand = best.copy()
        if res.bin_of is not None:
            ldp = problem.llm_dp
            cand[members] = np.asarray(ks)[res.bin_of // ldp] * ldp + res.bin_of % ldp
        new_obj = evaluate(cand, m, tokens, tiles, problem, table)[0]
        if res.bin_of is not None and new_obj <= obj + 1e-12:  # better, or as good with more slack
            improved += new_obj < obj - 1e-12
            best, obj = cand, min(obj, new_obj)
            failed.clear()
        else:
            failed.add(ks)
    report = {
        "lns_rounds": rounds,
        "lns_improvements": improved,
        "lns_deterministic_time": det_used,
    }
    return best, report


def _repack(best, ks, m, tokens, tiles, problem, table, pairs, wint, budget, seed):
    """Re-packs microbatches `ks` of `best`; returns (RepackResult, indices of their samples)."""
    ldp = problem.llm_dp
    mb = best // ldp
    members = np.flatnonzero(np.isin(mb, ks))
    local = {k: j for j, k in enumerate(ks)}
    hint = np.array([local[int(mb[i])] * ldp + best[i] % ldp for i in members], dtype=np.int64)
    w_all = evaluate(best, m, tokens, tiles, problem, table)[1]
    outside = [k for k in range(m) if k not in local]
    wmax = max(w for _, _, w in pairs) or 1.0  # the integer units of `cpsat.int_costs`
    outside_top = int(round(max((w_all[k] for k in outside), default=0.0) / wmax * W_UNITS))
    nb = Neighbourhood(
        tokens[members], tiles[members], hint, len(ks), ldp, problem.tile_shards,
        problem.num_stages, outside_top,
    )  # fmt: skip
    return repack(nb, table, pairs, wint, budget.round_deterministic_time, seed), members


def _pick(best, m, tokens, tiles, problem, table, budget, rng, failed) -> tuple[int, ...] | None:
    """A neighbourhood (sorted microbatch indices) not in `failed`, or None if none is left to try."""
    # a model over q microbatches has ~(q * N / M) samples x (q * l_dp) bins
    fits = int(np.sqrt(budget.max_vars / max(len(tokens) / m * problem.llm_dp, 1.0)))
    q = min(max(2, min(budget.neighbourhood, fits)), m)
    excess, room = _excess_room(best, m, tokens, tiles, problem, table)
    p_first = excess / excess.sum() if excess.sum() > 0 else None
    for _ in range(8):  # a few draws before giving up on fresh neighbourhoods
        first = int(rng.choice(m, p=p_first))
        rest = np.delete(np.arange(m), first)
        w = room[rest] + 1e-3
        others = rng.choice(rest, size=q - 1, replace=False, p=w / w.sum()) if q > 1 else []
        ks = tuple(sorted([first, *map(int, others)]))
        if ks not in failed:
            return ks
    return None


def _excess_room(best, m, tokens, tiles, problem, table) -> tuple[np.ndarray, np.ndarray]:
    """Per microbatch: relative excess over its next cheaper bucket pair, and relative room under its own."""
    ldp, edp = problem.llm_dp, problem.tile_shards
    tok = np.bincount(best, weights=tokens, minlength=m * ldp).reshape(m, ldp).max(axis=1)
    til = np.bincount(best // ldp, weights=tiles, minlength=m)
    _, w, ti, si = evaluate(best, m, tokens, tiles, problem, table)
    cap_s = table.lengths[si].astype(np.float64)
    cap_t = table.tiles[ti].astype(np.float64) * edp
    room = np.maximum(1 - tok / cap_s, 0) + np.maximum(1 - til / cap_t, 0)
    excess = np.zeros(m)
    nd = table.nondominated()
    for k in range(m):
        cheaper = [
            max(tok[k] / table.lengths[s] - 1, 0) + max(til[k] / (table.tiles[t] * edp) - 1, 0)
            for t, s, wp in nd
            if wp < w[k]
        ]
        excess[k] = 1.0 / (1e-3 + min(cheaper)) if cheaper else 0.0
    return excess, room
