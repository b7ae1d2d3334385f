"""Tiles packed by row: every sample's tiles in its row's block (`ScheduleProblem.tiles_by_row`).

The greedy and the refinement balance a microbatch's tiles over its shards as one pool. Packed by
row, each LLM row's block of tile slots holds exactly its own samples' tiles (a colocated encoder
encodes them on the row's shard; a separate one sends each row only its own features), so the
fullest row sets the microbatch's tile bucket and no row may hold more tiles than the largest
bucket. `fit_rows` repairs a finished assignment for that:

1. within each microbatch, re-pack its samples over its shards, tiles first (LPT on tiles, ties on
   tokens), kept when it lowers the fullest shard's tiles and no row grows past its length bucket;
2. a bin still over the largest tile bucket gives samples (most tiles first) to the bin with the
   fewest tiles that has room for them under the largest buckets (any microbatch).

Deterministic (stable orders, index tie-breaks). What stays infeasible scores inf (`evaluate`) and
`schedule_batch` says so.
"""

from __future__ import annotations

import numpy as np

from dflop_jax.contracts import ScheduleProblem
from dflop_jax.scheduler.objective import CostTable


def fit_rows(
    bin_of: np.ndarray,
    m: int,
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
) -> np.ndarray:
    """`bin_of` (bins k * l_dp + r) with each bin's tiles balanced and, where possible, within the
    largest tile bucket; unchanged for a problem whose tiles are not packed by row."""
    if not problem.tiles_by_row:
        return bin_of
    out = bin_of.copy()
    for k in range(m):
        _repack(out, k, tokens, tiles, problem.llm_dp, table)
    _spill(out, m, tokens, tiles, problem.llm_dp, table)
    return out


def _repack(bin_of, k, tokens, tiles, ldp, table) -> None:
    members = np.flatnonzero(bin_of // ldp == k)
    shard = bin_of[members] % ldp
    old_tiles = np.bincount(shard, weights=tiles[members], minlength=ldp).max()
    old_tok = np.bincount(shard, weights=tokens[members], minlength=ldp).max()
    cap = table.lengths[min(np.searchsorted(table.lengths, old_tok), len(table.lengths) - 1)]
    t_load, s_load = np.zeros(ldp), np.zeros(ldp)
    new = np.empty(len(members), dtype=np.int64)
    for j in np.lexsort((members, -tokens[members], -tiles[members])):
        fits = s_load + tokens[members[j]] <= cap
        r = int(np.lexsort((s_load, t_load, ~fits))[0])
        new[j] = r
        t_load[r] += tiles[members[j]]
        s_load[r] += tokens[members[j]]
    if t_load.max() < old_tiles and s_load.max() <= cap:
        bin_of[members] = k * ldp + new


def _spill(bin_of, m, tokens, tiles, ldp, table) -> None:
    tmax, smax = float(table.tiles[-1]), float(table.lengths[-1])
    t_load = np.bincount(bin_of, weights=tiles, minlength=m * ldp)
    s_load = np.bincount(bin_of, weights=tokens, minlength=m * ldp)
    for b in np.flatnonzero(t_load > tmax):
        members = np.flatnonzero(bin_of == b)
        for i in members[np.lexsort((members, -tiles[members]))]:
            if t_load[b] <= tmax:
                break
            room = (t_load + tiles[i] <= tmax) & (s_load + tokens[i] <= smax)
            room[b] = False
            if not room.any() or tiles[i] == 0:
                continue
            c = int(np.flatnonzero(room)[np.argmin(t_load[room])])
            bin_of[i] = c
            t_load[b] -= tiles[i]
            t_load[c] += tiles[i]
            s_load[b] -= tokens[i]
            s_load[c] += tokens[i]
