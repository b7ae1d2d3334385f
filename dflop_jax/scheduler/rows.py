"""Tiles packed by row: every sample's tiles in its row's block (`ScheduleProblem.tiles_by_row`).

The greedy and the refinement balance a microbatch's tiles over its shards as one pool. Packed by
row, each LLM row's block of tile slots holds exactly its own samples' tiles (a colocated encoder
encodes them on the row's shard; a separate one sends each row only its own features), so the
fullest row sets the microbatch's tile bucket and no row may hold more tiles than the largest
bucket. `fit_rows` repairs a finished assignment for that:

1. within each microbatch, re-pack its samples over its shards, tiles first (LPT on tiles, ties on
   tokens), kept when it lowers the fullest shard's tiles and no row grows past its length bucket;
2. a bin still over the largest tile bucket gives samples (most tiles first) to the bin with the
   fewest tiles that has room for them under the largest buckets (any microbatch);
3. tile buckets lowered where they cost nothing (`lower_tile_buckets`): a microbatch's rows give
   samples to rows (of any microbatch) with room under their own microbatch's buckets, so that
   its tile bucket drops a step and no microbatch's bucket pair grows. The surrogate cannot grow,
   and the encoder computes fewer padded tiles: where the LLM stages set every microbatch's cost
   (a small encoder), the search is indifferent to the tile bucket and would leave rows that a
   single sample fills next to empty ones.

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
    if not problem.buckets.audio:  # blind to audio frames: a move could raise an audio bucket
        lower_tile_buckets(out, m, tokens, tiles, problem.llm_dp, table)
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
            _apply([(i, c)], bin_of, tokens, tiles, ldp, t_load, s_load)


_MOVE_BUDGET = 2000  # sample moves per call: a deterministic bound on the pass's time


def lower_tile_buckets(bin_of, m, tokens, tiles, ldp, table: CostTable) -> None:
    """Step 3 of the module docstring, in place: microbatches in decreasing tile bucket, each
    lowered a step at a time while its over-full rows' samples (fewest tiles that end the excess
    first) find rows with room under their microbatch's bucket pair (the lowered pair in its own
    microbatch; best fit); never a microbatch left empty, never a pair that costs more."""
    t_load = np.bincount(bin_of, weights=tiles, minlength=m * ldp)
    s_load = np.bincount(bin_of, weights=tokens, minlength=m * ldp)
    if t_load.max(initial=0) > table.tiles[-1] or s_load.max(initial=0) > table.lengths[-1]:
        return  # infeasible as it is: `evaluate` says so
    ti, si = table.pair_for(t_load.reshape(m, ldp).max(axis=1), s_load.reshape(m, ldp).max(axis=1))
    cap_t, cap_s = table.tiles[ti].astype(float), table.lengths[si].astype(float)
    count = np.bincount(bin_of // ldp, minlength=m)
    moves = 0
    for k in np.lexsort((np.arange(m), -cap_t)):
        while ti[k] > 0 and moves < _MOVE_BUDGET:
            t2, s2 = (int(a) for a in table.pair_for(table.tiles[ti[k] - 1], cap_s[k]))
            if table.tiles[t2] >= cap_t[k] or table.w[t2, s2] > table.w[ti[k], si[k]]:
                break
            caps_t, caps_s = np.repeat(cap_t, ldp), np.repeat(cap_s, ldp)
            rows = slice(k * ldp, (k + 1) * ldp)
            caps_t[rows], caps_s[rows] = table.tiles[t2], table.lengths[s2]
            moved = _moves_under(bin_of, k, tokens, tiles, ldp, t_load, s_load, caps_t, caps_s,
                                 count)  # fmt: skip
            if moved is None:
                break
            _apply(moved, bin_of, tokens, tiles, ldp, t_load, s_load, count)
            moves += len(moved)
            ti[k], si[k] = t2, s2
            cap_t[k], cap_s[k] = table.tiles[t2], table.lengths[s2]


def _moves_under(bin_of, k, tokens, tiles, ldp, t_load, s_load, caps_t, caps_s, count):
    """[(sample, new bin)] that bring every row of microbatch `k` within `caps_t`, every row within
    its caps, or None where some row's excess finds no room. A row gives a sample to a row with
    room (`_move`), else swaps one for a sample with fewer tiles (`_swap`)."""
    t_load, s_load, count = t_load.copy(), s_load.copy(), count.copy()
    where = bin_of.copy()
    out = []
    for b in range(k * ldp, (k + 1) * ldp):
        while t_load[b] > caps_t[b]:
            step = _move(where, b, k, tokens, tiles, ldp, t_load, s_load, caps_t, caps_s, count)
            step = step or _swap(where, b, tokens, tiles, t_load, s_load, caps_t, caps_s)
            if not step:
                return None
            _apply(step, where, tokens, tiles, ldp, t_load, s_load, count)
            out += step
    return out


def _apply(moves, bin_of, tokens, tiles, ldp, t_load, s_load, count=None) -> None:
    """Each (sample, bin) of `moves` in turn, in place: the sample's bin and the bins' loads (and
    the microbatches' sample counts, where kept)."""
    for i, c in moves:
        t_load[bin_of[i]] -= tiles[i]
        s_load[bin_of[i]] -= tokens[i]
        if count is not None:
            count[bin_of[i] // ldp] -= 1
            count[c // ldp] += 1
        bin_of[i] = c
        t_load[c] += tiles[i]
        s_load[c] += tokens[i]


def _ordered_members(where, b, tiles, excess):
    """Row `b`'s samples with tiles: the fewest tiles that end `excess` first, then the rest by most
    tiles; ties by index."""
    members = np.flatnonzero((where == b) & (tiles > 0))
    ends = tiles[members] >= excess
    return members[np.lexsort((members, np.where(ends, tiles[members], -tiles[members]), ~ends))]


def _move(where, b, k, tokens, tiles, ldp, t_load, s_load, caps_t, caps_s, count):
    """[(sample, bin)]: one of row `b`'s samples into the row with the least tile room left that
    takes it (never microbatch `k`'s last sample out of it); [] where none fits."""
    inside = np.arange(len(t_load)) // ldp == k
    for i in _ordered_members(where, b, tiles, t_load[b] - caps_t[b]):
        room_t = caps_t - t_load - tiles[i]
        fits = (room_t >= 0) & (caps_s - s_load - tokens[i] >= 0) & (inside | (count[k] > 1))
        fits[b] = False
        if fits.any():
            c = np.flatnonzero(fits)
            return [(int(i), int(c[np.lexsort((c, room_t[c]))[0]]))]
    return []


def _swap(where, b, tokens, tiles, t_load, s_load, caps_t, caps_s):
    """[(sample, bin), (other, b)]: one of row `b`'s samples swapped with a sample of fewer tiles in
    another row, both rows within their caps after but for `b`'s own excess, which must shrink
    (most shrink up to the excess first); [] where no swap does."""
    excess = t_load[b] - caps_t[b]
    others = np.flatnonzero(where != b)
    c = where[others]
    for i in _ordered_members(where, b, tiles, excess):
        gain = tiles[i] - tiles[others]
        ok = (gain > 0) & (t_load[c] + gain <= caps_t[c])
        ok &= s_load[c] - tokens[others] + tokens[i] <= caps_s[c]
        ok &= s_load[b] - tokens[i] + tokens[others] <= caps_s[b]
        if ok.any():
            j = np.flatnonzero(ok)
            short = np.maximum(excess - gain[j], 0)  # what stays over after the swap
            best = j[np.lexsort((others[j], gain[j], short))[0]]
            return [(int(i), int(c[best])), (int(others[best]), int(b))]
    return []
