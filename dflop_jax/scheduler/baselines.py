"""The two baselines of DESIGN section 8, measured with the same surrogate objective as the scheduler.

- data-blind (Megatron/MaxText style): microbatches cut in loader order (equal sample counts), in-order
  first-fit of each microbatch's samples into its LLM shards, every microbatch at the LARGEST buckets,
  fixed count. A sample that no longer fits its microbatch moves on to the next one; samples left after
  the last microbatch open extra microbatches (`info["extra_microbatches"]`).
- reference-like (the DFLOP reference's rule): per-sample cost proportional to its predicted work
  (a cost per token and per tile read off the cost table), min-max over all (microbatch, shard) bins by
  LPT, blind to buckets; each microbatch then gets the cheapest buckets that fit what it was given. A
  microbatch that fits no bucket is repaired by moving its largest samples to the emptiest bins that can
  take them (`info["repaired_moves"]`); if none can, an extra microbatch (`info["extra_microbatches"]`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from dflop_jax.scheduler.bound import aggregate_bound
from dflop_jax.scheduler.objective import (
    CostTable,
    check_fits,
    evaluate,
    load_balance,
    padding_ratios,
    to_plans,
)
from dflop_jax.scheduler.types import SampleShape, Schedule, ScheduleProblem


def _prepare(
    shapes: Sequence[SampleShape], problem: ScheduleProblem
) -> tuple[np.ndarray, np.ndarray, CostTable]:
    """Checks every sample fits the largest buckets; returns (tokens [N], tiles [N], cost table)."""
    shapes = list(shapes)
    check_fits(shapes, problem)
    tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
    tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
    return tokens, tiles, CostTable.build(problem)


def _report(name, bin_of, m, ti, si, tokens, tiles, problem, table, t0, info) -> Schedule:
    w = table.w[ti, si]
    obj = float(w.sum() + (problem.num_stages - 1) * w.max())
    plans = to_plans(bin_of, m, ti, si, problem, table)
    lb, _ = aggregate_bound(tokens, tiles, dataclasses.replace(problem, microbatches=(m, m)), table)
    info.update(padding_ratios(plans, tokens, tiles, problem))
    info.update(load_balance(bin_of, m, tokens, tiles, problem.llm_dp))
    info["microbatches"] = m
    return Schedule(plans, obj, lb, name, time.perf_counter() - t0, info)


def data_blind_schedule(
    shapes: Sequence[SampleShape], problem: ScheduleProblem, microbatches: int
) -> Schedule:
    """Loader-order microbatches, in-order first-fit into the largest buckets (module docstring)."""
    t0 = time.perf_counter()
    tokens, tiles, table = _prepare(shapes, problem)
    ldp, smax = problem.llm_dp, float(table.lengths[-1])
    tmax = float(table.tiles[-1]) * problem.encoder_dp
    n = len(tokens)
    bounds = np.linspace(0, n, microbatches + 1).round().astype(int)
    bin_of = np.empty(n, dtype=np.int64)
    carry: list[int] = []
    k = 0
    while k < microbatches or carry:
        todo = carry + (list(range(bounds[k], bounds[k + 1])) if k < microbatches else [])
        carry = []
        tok_load, tile_load = np.zeros(ldp), 0.0
        for i in todo:
            free = np.flatnonzero(tok_load + tokens[i] <= smax)
            if free.size == 0 or tile_load + tiles[i] > tmax:
                carry.append(i)
                continue
            r = int(free[0])
            bin_of[i] = k * ldp + r
            tok_load[r] += tokens[i]
            tile_load += tiles[i]
        k += 1
    top = np.full(k, 0)
    info = {"extra_microbatches": k - microbatches}
    return _report(
        "data-blind", bin_of, k, top + len(table.tiles) - 1, top + len(table.lengths) - 1,
        tokens, tiles, problem, table, t0, info,
    )  # fmt: skip


def per_sample_costs(tokens: np.ndarray, tiles: np.ndarray, table: CostTable) -> np.ndarray:
    """Work-proportional cost of each sample [N]: seconds per token and per tile from the cost table."""
    total = table.stage.sum(axis=(2, 3))  # [nT, nS] all stages, fwd + bwd
    ls, ts = table.lengths.astype(np.float64), table.tiles.astype(np.float64)
    per_tok = (
        (total[0, -1] - total[0, 0]) / (ls[-1] - ls[0]) if len(ls) > 1 else total[0, 0] / ls[0]
    )
    per_tile = (total[-1, 0] - total[0, 0]) / (ts[-1] - ts[0]) if len(ts) > 1 else 0.0
    return max(per_tok, 0.0) * tokens + max(per_tile, 0.0) * tiles


def reference_like_schedule(
    shapes: Sequence[SampleShape], problem: ScheduleProblem, microbatches: int
) -> Schedule:
    """Cost-proportional min-max (LPT) over all bins, blind to buckets (module docstring)."""
    t0 = time.perf_counter()
    tokens, tiles, table = _prepare(shapes, problem)
    ldp, m = problem.llm_dp, microbatches
    cost = per_sample_costs(tokens, tiles, table)
    load = np.zeros(m * ldp)
    bin_of = np.empty(len(tokens), dtype=np.int64)
    for i in np.lexsort((np.arange(len(cost)), -cost)):
        b = int(np.argmin(load))
        bin_of[i] = b
        load[b] += cost[i]
    bin_of, m2, moves = _repair(bin_of, m, tokens, tiles, problem, table)
    _, _, ti, si = evaluate(bin_of, m2, tokens, tiles, problem, table)
    info = {"repaired_moves": moves, "extra_microbatches": m2 - m}
    return _report("reference-like", bin_of, m2, ti, si, tokens, tiles, problem, table, t0, info)


def _repair(bin_of, m, tokens, tiles, problem, table) -> tuple[np.ndarray, int, int]:
    """Moves samples out of bins over the largest buckets (largest first, to the emptiest bin that
    takes them); samples no bin takes open extra microbatches. Returns (bin_of, microbatches, moves)."""
    ldp, smax = problem.llm_dp, table.lengths[-1]
    tmax = table.tiles[-1] * problem.encoder_dp
    moves = 0
    while True:
        nb = m * ldp
        mb = np.arange(nb) // ldp
        tok = np.bincount(bin_of, weights=tokens, minlength=nb)
        til = np.bincount(bin_of // ldp, weights=tiles, minlength=m)
        over_bins, over_mbs = np.flatnonzero(tok > smax), np.flatnonzero(til > tmax)
        if over_bins.size:
            src_mb = int(over_bins[0]) // ldp
            members = np.flatnonzero(bin_of == over_bins[0])
            key = tokens[members]
        elif over_mbs.size:
            src_mb = int(over_mbs[0])
            members = np.flatnonzero(bin_of // ldp == src_mb)
            key = tiles[members]
        else:
            return bin_of, m, moves
        for i in members[np.argsort(-key, kind="stable")]:
            ok = (tok + tokens[i] <= smax) & (til[mb] + tiles[i] <= tmax) & (mb != src_mb)
            if ok.any():
                bin_of[i] = int(np.flatnonzero(ok)[np.argmin(tok[ok])])
                break
        else:  # nowhere to go: an extra microbatch takes the largest one
            i = members[np.argmax(key)]
            bin_of[i] = m * ldp
            m += 1
        moves += 1
