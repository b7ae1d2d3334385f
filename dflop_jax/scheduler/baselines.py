"""The baselines of DESIGN section 8, measured with the same evaluator and objective as the scheduler.

API (for `bench scheduler`, `bench cluster` and the CLI): every baseline is a function
`(shapes, problem, microbatches) -> Schedule` listed in `BASELINES` by name; `run_baselines` runs some
or all of them on one batch and `strongest` picks the one with the lowest objective (the static-bucket
surrogate the runtime pays). Each report carries `info["simulated_makespan_s"]` (1F1B, in the
baseline's own order) for comparisons against `schedule_batch`'s stage-aware order.

- data-blind (Megatron/MaxText style): microbatches cut in loader order (equal sample counts), in-order
  first-fit of each microbatch's samples into its LLM shards, every microbatch at the LARGEST buckets,
  fixed count (tiles packed by row: a row also holds at most the largest tile bucket of tiles). A sample that no longer fits its microbatch
  moves on to the next one; samples left after the last microbatch open extra microbatches
  (`info["extra_microbatches"]`).
- reference-like (the DFLOP reference's rule): per-sample cost proportional to its predicted work
  (a cost per token and per tile read off the cost table), min-max over all (microbatch, shard) bins by
  LPT, blind to buckets; each microbatch then gets the cheapest buckets that fit what it was given. A
  microbatch that fits no bucket is repaired by moving its largest samples to the emptiest bins that can
  take them (`info["repaired_moves"]`); if none can, an extra microbatch (`info["extra_microbatches"]`).
- reference-exact: the reference's own min-max model over vision and LLM costs, whole samples, no
  buckets, solved by CP-SAT (`reference_cpsat.py`), then buckets fitted and repaired as reference-like.
- maxtext-packer (what a MaxText user has): samples in loader order, first-fit into fixed-length rows
  (the largest length bucket; a row also holds at most its share of the largest tile bucket), `l_dp`
  rows per microbatch, every microbatch at the largest buckets; no cost model, the count is whatever
  the packing needs (`info["extra_microbatches"]` against the requested count, may be negative).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from dflop_jax.contracts import SampleShape, Schedule, ScheduleProblem
from dflop_jax.scheduler.bound import aggregate_bound
from dflop_jax.scheduler.objective import (
    CostTable,
    check_fits,
    evaluate,
    load_balance,
    padding_ratios,
    to_plans,
    with_audio,
)
from dflop_jax.scheduler.reference_cpsat import minmax_bins
from dflop_jax.sim.pipeline import simulate

REFERENCE_DETERMINISTIC_TIME = 1.0  # CP-SAT deterministic seconds of the reference-exact baseline


def _prepare(
    shapes: Sequence[SampleShape], problem: ScheduleProblem
) -> tuple[np.ndarray, np.ndarray, CostTable]:
    """Checks every sample fits the largest buckets; returns (tokens [N], tiles [N], cost table)."""
    shapes = list(shapes)
    check_fits(shapes, problem)
    return (*_loads(shapes), CostTable.build(problem))


def _loads(shapes: Sequence[SampleShape]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N], tiles [N]) float64."""
    tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
    tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
    return tokens, tiles


def _report(name, bin_of, m, ti, si, shapes, problem, table, t0, info) -> Schedule:
    tokens, tiles = _loads(shapes)
    w = table.w[ti, si]
    obj = float(w.sum() + (problem.num_stages - 1) * w.max())
    plans = to_plans(bin_of, m, ti, si, problem, table)
    lb, _ = aggregate_bound(tokens, tiles, dataclasses.replace(problem, microbatches=(m, m)), table)
    info.update(padding_ratios(plans, tokens, tiles, problem))
    info.update(load_balance(bin_of, m, tokens, tiles, problem.llm_dp))
    info["microbatches"] = m
    info["simulated_makespan_s"] = simulate(table.stage[ti, si]).step_time
    plans = with_audio(plans, shapes, problem.buckets, problem.audio_always)
    return Schedule(plans, obj, lb, name, time.perf_counter() - t0, info)


def data_blind_schedule(
    shapes: Sequence[SampleShape], problem: ScheduleProblem, microbatches: int
) -> Schedule:
    """Loader-order microbatches, in-order first-fit into the largest buckets (module docstring)."""
    t0 = time.perf_counter()
    tokens, tiles, table = _prepare(shapes, problem)
    ldp, smax = problem.llm_dp, float(table.lengths[-1])
    # Tiles packed by row: the largest tile bucket bounds each row's tiles; otherwise the encoder
    # takes the microbatch's tiles as one pool over its encoder shards.
    by_row = problem.tiles_by_row
    tmax = float(table.tiles[-1]) * (1 if by_row else problem.encoder_dp)
    n = len(tokens)
    bounds = np.linspace(0, n, microbatches + 1).round().astype(int)
    bin_of = np.empty(n, dtype=np.int64)
    carry: list[int] = []
    k = 0
    while k < microbatches or carry:
        todo = carry + (list(range(bounds[k], bounds[k + 1])) if k < microbatches else [])
        carry = []
        tok_load, tile_load = np.zeros(ldp), np.zeros(ldp if by_row else 1)
        for i in todo:
            tiles_fit = tile_load + tiles[i] <= tmax
            free = np.flatnonzero((tok_load + tokens[i] <= smax) & tiles_fit)
            if free.size == 0:
                carry.append(i)
                continue
            r = int(free[0])
            bin_of[i] = k * ldp + r
            tok_load[r] += tokens[i]
            tile_load[r if by_row else 0] += tiles[i]
        k += 1
    top = np.full(k, 0)
    info = {"extra_microbatches": k - microbatches}
    return _report(
        "data_blind", bin_of, k, top + len(table.tiles) - 1, top + len(table.lengths) - 1,
        shapes, problem, table, t0, info,
    )  # fmt: skip


def side_rates(table: CostTable) -> tuple[float, float]:
    """(seconds per token, seconds per tile), all stages fwd + bwd, read off the cost table's slopes."""
    total = table.stage.sum(axis=(2, 3))  # [nT, nS] all stages, fwd + bwd
    ls, ts = table.lengths.astype(np.float64), table.tiles.astype(np.float64)
    per_tok = (
        (total[0, -1] - total[0, 0]) / (ls[-1] - ls[0]) if len(ls) > 1 else total[0, 0] / ls[0]
    )
    per_tile = (total[-1, 0] - total[0, 0]) / (ts[-1] - ts[0]) if len(ts) > 1 else 0.0
    return max(per_tok, 0.0), max(per_tile, 0.0)


def per_sample_costs(tokens: np.ndarray, tiles: np.ndarray, table: CostTable) -> np.ndarray:
    """Work-proportional cost of each sample [N]: seconds per token and per tile from the cost table."""
    per_tok, per_tile = side_rates(table)
    return per_tok * tokens + per_tile * tiles


def reference_like_schedule(
    shapes: Sequence[SampleShape], problem: ScheduleProblem, microbatches: int
) -> Schedule:
    """Cost-proportional min-max (LPT) over all bins, blind to buckets (module docstring)."""
    t0 = time.perf_counter()
    tokens, tiles, table = _prepare(shapes, problem)
    ldp, m = problem.llm_dp, microbatches
    bin_of = _lpt(per_sample_costs(tokens, tiles, table), m * ldp)
    return _fit_buckets("reference-like", bin_of, m, shapes, problem, table, t0)


def reference_exact_schedule(
    shapes: Sequence[SampleShape],
    problem: ScheduleProblem,
    microbatches: int,
    deterministic_time: float = REFERENCE_DETERMINISTIC_TIME,
) -> Schedule:
    """The reference's CP-SAT min-max over vision and LLM costs, blind to buckets (module docstring)."""
    t0 = time.perf_counter()
    tokens, tiles, table = _prepare(shapes, problem)
    per_tok, per_tile = side_rates(table)
    bins = microbatches * problem.llm_dp
    hint = _lpt(per_sample_costs(tokens, tiles, table), bins)
    bin_of = minmax_bins(per_tile * tiles, per_tok * tokens, bins, hint, deterministic_time)
    return _fit_buckets("reference-exact", bin_of, microbatches, shapes, problem, table, t0)


def maxtext_packer_schedule(
    shapes: Sequence[SampleShape], problem: ScheduleProblem, microbatches: int
) -> Schedule:
    """Loader-order first-fit into fixed-length rows, l_dp rows per microbatch (module docstring)."""
    t0 = time.perf_counter()
    tokens, tiles, table = _prepare(shapes, problem)
    ldp, smax = problem.llm_dp, float(table.lengths[-1])
    tmax = float(table.tiles[-1]) * problem.tile_shards
    row_tiles = max(tmax // ldp, float(tiles.max()))  # a row's share, at least the largest sample
    tok_load: list[float] = []
    tile_load: list[float] = []
    bin_of = np.empty(len(tokens), dtype=np.int64)
    mb_tiles: list[float] = []  # per microbatch (l_dp consecutive rows)
    for i in range(len(tokens)):
        for r in range(len(tok_load)):
            if (
                tok_load[r] + tokens[i] <= smax
                and tile_load[r] + tiles[i] <= row_tiles
                and mb_tiles[r // ldp] + tiles[i] <= tmax
            ):
                break
        else:  # no open row takes it: a new row, in a new microbatch if this one has no tile room
            r = len(tok_load)
            if r % ldp and mb_tiles[r // ldp] + tiles[i] > tmax:
                r += ldp - r % ldp
            tok_load += [0.0] * (r + 1 - len(tok_load))
            tile_load += [0.0] * (r + 1 - len(tile_load))
            mb_tiles += [0.0] * (r // ldp + 1 - len(mb_tiles))
        bin_of[i] = r
        tok_load[r] += tokens[i]
        tile_load[r] += tiles[i]
        mb_tiles[r // ldp] += tiles[i]
    m = -(-len(tok_load) // ldp)
    top = np.zeros(m, dtype=np.int64)
    info = {"extra_microbatches": m - microbatches}
    return _report(
        "maxtext-packer", bin_of, m, top + len(table.tiles) - 1, top + len(table.lengths) - 1,
        shapes, problem, table, t0, info,
    )  # fmt: skip


BaselineFn = Callable[[Sequence[SampleShape], ScheduleProblem, int], Schedule]
BASELINES: dict[str, BaselineFn] = {
    "data_blind": data_blind_schedule,
    "reference-like": reference_like_schedule,
    "reference-exact": reference_exact_schedule,
    "maxtext-packer": maxtext_packer_schedule,
}


def run_baselines(
    shapes: Sequence[SampleShape],
    problem: ScheduleProblem,
    microbatches: int,
    names: Sequence[str] | None = None,
) -> dict[str, Schedule]:
    """Schedules of the named baselines (default: all of `BASELINES`) for one global batch.

    Raises:
      ValueError: an unknown name (the known ones are listed).
    """
    names = list(BASELINES) if names is None else list(names)
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}: choose from {', '.join(BASELINES)}")
    return {n: BASELINES[n](shapes, problem, microbatches) for n in names}


def strongest(
    results: dict[str, Schedule], key: Callable[[Schedule], float] | None = None
) -> tuple[str, Schedule]:
    """The (name, schedule) with the lowest `key` (default: the objective, the static-bucket
    surrogate; e.g. `lambda s: s.info["simulated_makespan_s"]` for the 1F1B makespan); ties: the
    first in `results`' order."""
    if not results:
        raise ValueError("strongest() needs at least one baseline result")
    key = key or (lambda s: s.objective)
    name = min(results, key=lambda n: key(results[n]))
    return name, results[name]


def _lpt(cost: np.ndarray, bins: int) -> np.ndarray:
    """Longest-processing-time min-max of `cost` [N] over `bins` bins; bin_of [N]."""
    load = np.zeros(bins)
    bin_of = np.empty(len(cost), dtype=np.int64)
    for i in np.lexsort((np.arange(len(cost)), -cost)):
        b = int(np.argmin(load))
        bin_of[i] = b
        load[b] += cost[i]
    return bin_of


def _fit_buckets(name, bin_of, m, shapes, problem, table, t0) -> Schedule:
    """Bucket-blind bins -> cheapest fitting buckets per microbatch, repaired when over the largest."""
    tokens, tiles = _loads(shapes)
    bin_of, m2, moves = _repair(bin_of, m, tokens, tiles, problem, table)
    _, _, ti, si = evaluate(bin_of, m2, tokens, tiles, problem, table)
    info = {"repaired_moves": moves, "extra_microbatches": m2 - m}
    return _report(name, bin_of, m2, ti, si, shapes, problem, table, t0, info)


def _repair(bin_of, m, tokens, tiles, problem, table) -> tuple[np.ndarray, int, int]:
    """Moves samples out of bins over the largest buckets (largest first, to the emptiest bin that
    takes them); samples no bin takes open extra microbatches. Returns (bin_of, microbatches, moves)."""
    ldp, smax = problem.llm_dp, table.lengths[-1]
    tmax = table.tiles[-1] * problem.tile_shards
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
