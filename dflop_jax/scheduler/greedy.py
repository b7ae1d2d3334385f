"""Greedy scheduler: two-resource LPT into (microbatch, shard) bins, then bucket-shrinking moves.

1. Vector LPT: samples in decreasing order of (tokens / mean bin tokens + tiles / mean microbatch
   tiles); each goes to the bin whose worse normalized load (its tokens, or its microbatch's tiles)
   grows least. This balances the shards of a microbatch (the max shard sets S_k) and the tiles per
   microbatch (which set T_k). Tiles packed by row (the fullest row sets T_k), a second LPT per
   count balances each row's tiles instead (per bin, over the mean bin tiles): the rows' tile
   balance then comes from the packing, not only from re-packing rows afterwards (`rows.py`).
2. Bucket shrinking: buckets are discrete, so perfectly balanced loads just above a bucket boundary waste
   a whole bucket step. For each microbatch, most expensive first, we try the next cheaper bucket pairs
   and move the excess samples into bins that have room under their *current* buckets (so no other
   microbatch gets dearer). Each accepted move strictly lowers the surrogate.
3. The microbatch count is tried over the allowed range (at most `MAX_COUNTS` values, evenly spread,
   ends included) and the best surrogate wins (ties: fewer microbatches).
4. Beside LPT, two packings into the bucket pairs of the lower bound's optimum: best-fit decreasing
   and minimum-slack filling (`fill.py`, exact subset sums); the latter is what reaches the bound on
   the benchmark workloads (docs/benchmarks.md), where LPT + shrinking stopped 1-3% above it.

Deterministic: no randomness, stable sorts with the sample index as tie-break.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dflop_jax.contracts import ScheduleProblem
from dflop_jax.scheduler.bound import aggregate_bound
from dflop_jax.scheduler.fill import fill_assign
from dflop_jax.scheduler.objective import CostTable, evaluate

MAX_COUNTS = 8
_SHRINK_CANDIDATES = 4
# moves per shrink attempt and per shrink() call: a deterministic bound on the greedy's time
_MAX_MOVES = 24
_MOVE_BUDGET = 1500


def candidate_counts(problem: ScheduleProblem, n: int) -> list[int]:
    """Microbatch counts the greedy tries: the allowed range (capped at n when possible), <= MAX_COUNTS."""
    lo, hi = problem.microbatches
    hi = max(lo, min(hi, n))
    if hi - lo + 1 <= MAX_COUNTS:
        return list(range(lo, hi + 1))
    return sorted({int(round(x)) for x in np.linspace(lo, hi, MAX_COUNTS)})


def lpt_assign(
    tokens: np.ndarray,
    tiles: np.ndarray,
    m: int,
    problem: ScheduleProblem,
    rows: bool = False,
    frames: np.ndarray | None = None,
) -> np.ndarray:
    """Vector LPT. Returns bin_of [N] with bins k * l_dp + r. `rows`: balance each bin's (row's)
    tiles rather than each microbatch's. `frames`: a third load per bin, audio frames
    (`audio_packing.py`). Each load is normalized by its mean per bin (tiles: per microbatch
    without `rows`); samples go in decreasing order of their summed normalized sizes, each to the
    bin whose largest normalized load after it is smallest (ties: the lower token load, then the
    lower bin)."""
    ldp = problem.llm_dp
    nb = m * ldp
    frames = np.zeros_like(tokens) if frames is None else frames
    tok_t = max(tokens.sum() / nb, 1.0)
    tile_t = max(tiles.sum() / (nb if rows else m), 1.0)
    audio_t = max(frames.sum() / nb, 1.0)
    key = tokens / tok_t + tiles / tile_t + frames / audio_t
    order = np.lexsort((np.arange(len(tokens)), -key))
    tok_load, audio_load = np.zeros(nb), np.zeros(nb)
    tile_load = np.zeros(nb if rows else m)
    tile_bin = np.arange(nb) if rows else np.arange(nb) // ldp  # the tile load each bin adds to
    bin_of = np.empty(len(tokens), dtype=np.int64)
    for i in order:
        score = np.maximum.reduce([(tok_load + tokens[i]) / tok_t,
                                   (tile_load[tile_bin] + tiles[i]) / tile_t,
                                   (audio_load + frames[i]) / audio_t])  # fmt: skip
        # tie-break on the token load so equal scores spread over shards
        b = int(np.lexsort((tok_load, score))[0])
        bin_of[i] = b
        tok_load[b] += tokens[i]
        audio_load[b] += frames[i]
        tile_load[tile_bin[b]] += tiles[i]
    return bin_of


def targeted_assign(
    tokens: np.ndarray,
    tiles: np.ndarray,
    target: list[tuple[int, int]],
    problem: ScheduleProblem,
    table: CostTable,
) -> np.ndarray | None:
    """Best-fit decreasing into microbatches with preset bucket pairs `target` [(ti, si)] * M.

    A sample that fits nowhere goes where it overflows least (evaluation then picks larger buckets for
    that microbatch); None if even the largest buckets cannot take it.
    """
    ldp, m = problem.llm_dp, len(target)
    cap_s = np.array([table.lengths[s] for _, s in target], dtype=np.float64)[
        np.arange(m * ldp) // ldp
    ]
    cap_t = np.array([table.tiles[t] * problem.tile_shards for t, _ in target], dtype=np.float64)
    mb = np.arange(m * ldp) // ldp
    key = tokens / max(tokens.mean(), 1.0) + tiles / max(tiles.mean(), 1.0)
    order = np.lexsort((np.arange(len(tokens)), -key))
    tok_load = np.zeros(m * ldp)
    tile_load = np.zeros(m)
    bin_of = np.empty(len(tokens), dtype=np.int64)
    for i in order:
        tok_room = (cap_s - tok_load - tokens[i]) / cap_s
        tile_room = (cap_t[mb] - tile_load[mb] - tiles[i]) / cap_t[mb]
        fits = (tok_room >= 0) & (tile_room >= 0)
        if fits.any():
            score = np.where(fits, tok_room + (tile_room if tiles[i] > 0 else 0.0), np.inf)
        else:  # overflow least, but never past the largest buckets
            hard = (tok_load + tokens[i] <= table.lengths[-1]) & (
                tile_load[mb] + tiles[i] <= table.tiles[-1] * problem.tile_shards
            )
            if not hard.any():
                return None
            score = np.where(hard, -np.minimum(tok_room, tile_room), np.inf)
        b = int(np.argmin(score))
        bin_of[i] = b
        tok_load[b] += tokens[i]
        tile_load[mb[b]] += tiles[i]
    return bin_of


class _State:
    """Mutable loads of one assignment, for cheap shrinking moves."""

    def __init__(self, bin_of, m, tokens, tiles, problem: ScheduleProblem, table: CostTable):
        self.bin_of, self.m, self.tokens, self.tiles = bin_of.copy(), m, tokens, tiles
        self.p, self.table, self.ldp = problem, table, problem.llm_dp
        self.tok_load = np.bincount(bin_of, weights=tokens, minlength=m * self.ldp)
        self.tile_load = np.bincount(bin_of // self.ldp, weights=tiles, minlength=m)
        self.mb_of_bin = np.arange(m * self.ldp) // self.ldp
        self.ti, self.si = self._pairs(np.arange(m))
        self._pairs_nd = table.nondominated()
        self.moves_made = 0

    def _pairs(self, ks):
        need_t = np.ceil(self.tile_load[ks] / self.p.tile_shards - 1e-9)
        need_s = self.tok_load.reshape(self.m, self.ldp)[ks].max(axis=1)
        return self.table.pair_for(need_t, need_s)

    def w(self) -> np.ndarray:
        return self.table.w[self.ti, self.si]

    def move(self, i: int, b: int) -> None:
        self.moves_made += 1
        a = self.bin_of[i]
        self.tok_load[a] -= self.tokens[i]
        self.tok_load[b] += self.tokens[i]
        self.tile_load[a // self.ldp] -= self.tiles[i]
        self.tile_load[b // self.ldp] += self.tiles[i]
        self.bin_of[i] = b

    def try_shrink(self, k: int) -> bool:
        """Tries cheaper bucket pairs for microbatch k; commits the first that can be reached."""
        cur = self.table.w[self.ti[k], self.si[k]]
        cheaper = sorted(((w, t, s) for t, s, w in self._pairs_nd if w < cur), reverse=True)
        for _, t, s in cheaper[:_SHRINK_CANDIDATES]:
            moves = self._plan_moves(
                k, int(self.table.tiles[t]) * self.p.tile_shards, int(self.table.lengths[s])
            )
            if moves is not None:
                self.ti, self.si = self._pairs(np.arange(self.m))
                return True
        return False

    def _plan_moves(self, k: int, tile_cap: int, tok_cap: int) -> list[tuple[int, int]] | None:
        """Moves (sample, bin) getting microbatch k under the caps; applied, or undone and None."""
        done: list[tuple[int, int]] = []
        bins_k = range(k * self.ldp, (k + 1) * self.ldp)
        if not self._room_for(k, tile_cap, tok_cap):
            return None
        ok = True
        for b in bins_k:
            while ok and self.tok_load[b] > tok_cap and len(done) < _MAX_MOVES:
                ok = self._move_one(
                    b, k, self.tok_load[b] - tok_cap, tok_cap, tile_cap, done, by_tiles=False
                )
        while ok and self.tile_load[k] > tile_cap and len(done) < _MAX_MOVES:
            src = [
                b
                for b in bins_k
                if any(self.tiles[i] > 0 for i in np.flatnonzero(self.bin_of == b))
            ]
            ok = bool(src) and self._move_one(
                src[0], k, self.tile_load[k] - tile_cap, tok_cap, tile_cap, done, by_tiles=True
            )
        ok = ok and self.tile_load[k] <= tile_cap and self.tok_load[bins_k].max() <= tok_cap
        if ok:
            return done
        for i, b in reversed(done):
            self.move(i, b)
        return None

    def _room_for(self, k: int, tile_cap: int, tok_cap: int) -> bool:
        """Necessary condition: the other microbatches have room for k's excess under their buckets."""
        caps = self.table.lengths[self.si].astype(np.float64)
        caps[k] = tok_cap
        tok = self.tok_load.reshape(self.m, self.ldp)
        excess = np.maximum(tok[k] - tok_cap, 0.0).sum()
        room = np.maximum(caps[:, None] - tok, 0.0).sum()
        tile_caps = self.table.tiles[self.ti].astype(np.float64) * self.p.tile_shards
        tile_excess = max(self.tile_load[k] - tile_cap, 0.0)
        tile_room = np.maximum(np.delete(tile_caps - self.tile_load, k), 0.0).sum()
        return excess <= room and tile_excess <= tile_room

    def _move_one(self, src, k, excess, tok_cap, tile_cap, done, by_tiles) -> bool:
        members = np.flatnonzero(self.bin_of == src)
        size = self.tiles[members] if by_tiles else self.tokens[members]
        members = members[size > 0]
        size = size[size > 0]
        # smallest sample covering the excess first, then the largest ones
        order = np.concatenate(
            [
                np.flatnonzero(size >= excess)[np.argsort(size[size >= excess], kind="stable")],
                np.flatnonzero(size < excess)[np.argsort(-size[size < excess], kind="stable")],
            ]
        )
        s_of_bin = self.table.lengths[self.si][self.mb_of_bin].astype(np.float64)
        t_cap_of_mb = self.table.tiles[self.ti].astype(np.float64) * self.p.tile_shards
        s_of_bin[self.mb_of_bin == k] = tok_cap
        t_cap_of_mb[k] = tile_cap
        for j in order:
            i = members[j]
            tok_room = s_of_bin - self.tok_load - self.tokens[i]
            tile_room = t_cap_of_mb[self.mb_of_bin] - self.tile_load[self.mb_of_bin] - self.tiles[i]
            same_mb = self.mb_of_bin == k
            tile_room[same_mb] = 0.0  # tiles stay inside microbatch k: never the problem
            fits = (tok_room >= 0) & (tile_room >= 0) & (np.arange(len(tok_room)) != src)
            if by_tiles:
                fits &= ~same_mb
            if not fits.any():
                continue
            cand = np.flatnonzero(fits)
            b = int(cand[np.argmin(tok_room[cand])])  # best fit
            done.append((int(i), int(src)))
            self.move(int(i), b)
            return True
        for j in order:  # no plain move: swap with a smaller sample elsewhere
            if self._swap_one(
                int(members[j]), src, k, excess, s_of_bin, t_cap_of_mb, done, by_tiles
            ):
                return True
        return False

    def _swap_one(self, i, src, k, excess, s_of_bin, t_cap_of_mb, done, by_tiles) -> bool:
        """Swaps sample i (bin src of microbatch k) with a smaller one that fits; True if done."""
        tok, til, bins = self.tokens, self.tiles, self.bin_of
        mb_j = self.mb_of_bin[bins]  # [N] microbatch of every sample
        d_tok, d_til = tok[i] - tok, til[i] - til  # [N] what moves into j's bin / out of src
        other = mb_j != k
        ok = (bins != src) & ((d_til if by_tiles else d_tok) > 0)
        ok &= self.tok_load[bins] + d_tok <= s_of_bin[bins]
        ok &= ~other | (self.tile_load[mb_j] + d_til <= t_cap_of_mb[mb_j])
        ok &= self.tok_load[src] - d_tok <= (s_of_bin[src] if by_tiles else np.inf)
        if not by_tiles:  # do not undo tile progress of k
            ok &= ~other | (d_til >= 0) | (self.tile_load[k] - d_til <= t_cap_of_mb[k])
        else:
            ok &= other
        if not ok.any():
            return False
        gain = (d_til if by_tiles else d_tok)[ok]
        cand = np.flatnonzero(ok)
        covering = gain >= excess
        pick = (
            cand[covering][np.argmin(gain[covering])] if covering.any() else cand[np.argmax(gain)]
        )
        j, bj = int(pick), int(bins[pick])
        done.append((i, src))
        done.append((j, bj))
        self.move(i, bj)
        self.move(j, src)
        return True


def shrink(
    bin_of, m, tokens, tiles, problem: ScheduleProblem, table: CostTable, max_passes: int = 4
) -> np.ndarray:
    """Bucket-shrinking local search; returns an assignment whose surrogate is <= the input's."""
    st = _State(bin_of, m, tokens, tiles, problem, table)
    for _ in range(max_passes):
        improved = False
        for k in np.argsort(-st.w(), kind="stable"):
            while st.moves_made < _MOVE_BUDGET and st.try_shrink(int(k)):
                improved = True
        if not improved:
            break
    return st.bin_of


def balance_shards(bin_of: np.ndarray, m: int, tokens: np.ndarray, ldp: int) -> np.ndarray:
    """Re-packs each microbatch's samples over its shards by LPT when that lowers its largest shard.

    Tiles stay in the microbatch and no shard grows past the old maximum, so buckets (and the
    objective) can only stay or shrink; the real work per shard gets even, which matters when kernels
    skip padded blocks.
    """
    out = bin_of.copy()
    for k in range(m):
        members = np.flatnonzero(bin_of // ldp == k)
        old_max = np.bincount(bin_of[members] % ldp, weights=tokens[members], minlength=ldp).max()
        load = np.zeros(ldp)
        new = np.empty(len(members), dtype=np.int64)
        for j in np.lexsort((members, -tokens[members])):
            r = int(np.argmin(load))
            new[j] = r
            load[r] += tokens[members[j]]
        if load.max() < old_max:
            out[members] = k * ldp + new
    return out


def ensure_nonempty(bin_of: np.ndarray, m: int, ldp: int, min_count: int) -> tuple[np.ndarray, int]:
    """No empty microbatch: drops empty ones, then, while fewer than `min_count` remain (and samples
    allow), moves the last sample of the fullest microbatch into a new one. Returns (bin_of, m).

    Dropping an empty microbatch never raises the surrogate (one W term less, the max unchanged or
    lower); a split adds a microbatch at the buckets its one sample needs. Deterministic.
    """
    mb, shard = bin_of // ldp, bin_of % ldp
    kept = np.flatnonzero(np.bincount(mb, minlength=m) > 0)  # [M'] old ids, order kept
    new_id = np.full(m, -1, dtype=np.int64)
    new_id[kept] = np.arange(len(kept))
    out, m = new_id[mb] * ldp + shard, len(kept)
    while m < min(min_count, len(out)):
        sizes = np.bincount(out // ldp, minlength=m)
        donor = int(np.argmax(sizes))  # >= 2 samples: fewer microbatches than samples
        out[np.flatnonzero(out // ldp == donor)[-1]] = m * ldp
        m += 1
    return out, m


def _filled(tokens, tiles, target, problem, table, lb=0.0) -> tuple[np.ndarray, int, float] | None:
    """Best minimum-slack filling of `target` (both opening rules, `fill.py`) after shrinking;
    stops at the first that reaches `lb`."""
    best = None
    for largest_first in (False, True) if target else ():
        if best is not None and best[2] <= lb * (1 + 1e-9):
            break
        cand = fill_assign(tokens, tiles, target, problem, table, largest_first)
        if cand is not None:
            cand = shrink(cand, len(target), tokens, tiles, problem, table)
            obj = evaluate(cand, len(target), tokens, tiles, problem, table)[0]
            best = _better(best, (cand, len(target), obj))
    return best


def _lpt_shrunk(tokens, tiles, m, problem, table) -> list[tuple[np.ndarray, int, float]]:
    """LPT + shrink at count m: [(bin_of, m, surrogate)], a candidate per LPT (the microbatches'
    tiles balanced; packed by row, also the rows'), none that overflows the largest buckets."""
    out = []
    for rows in (False, True) if problem.tiles_by_row else (False,):
        try:
            bin_of = lpt_assign(tokens, tiles, m, problem, rows)
            bin_of = shrink(bin_of, m, tokens, tiles, problem, table)
            out.append((bin_of, m, evaluate(bin_of, m, tokens, tiles, problem, table)[0]))
        except ValueError:
            continue
    return out


def _better(a, b):
    """The better of two (bin_of, m, surrogate) candidates (ties: the earlier), None-safe."""
    if a is None:
        return b
    if b is None or a[2] <= b[2] + 1e-15:
        return a
    return b


def greedy_schedule(
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
    pool: list | None = None,
) -> tuple[np.ndarray, int, float, float]:
    """Best greedy assignment: (bin_of [N], microbatches, surrogate, lower bound).

    Candidates: best-fit packing and minimum-slack filling (`fill.py`) into the bucket pairs of the
    aggregate lower bound's optimum (`bound.aggregate_bound`; returned at once if one reaches the
    bound), vector LPT + shrink at the candidate counts and at the bound's count, then at the
    neighbours of the best count while that improves (`_best_lpt`).

    With `pool` (a list), every candidate built is appended to it as (bin_of, m, surrogate) and no
    shortcut is taken at the bound: the caller chooses among them by another measure (`select.py`).
    """
    exhaustive = pool is not None
    pool = [] if pool is None else pool

    def better(a, b):
        if b is not None:
            pool.append(b)
        return _better(a, b)

    lb, target = aggregate_bound(tokens, tiles, problem, table)
    # early: an answer at the bound; with a pool the search goes on (to fill it) but returns it
    packed, early = _targeted(tokens, tiles, target, problem, table, lb, pool)
    if early is not None and not exhaustive:
        return (*early, lb)
    filled = _filled(tokens, tiles, target, problem, table, lb)
    if early is None and filled is not None and _at_bound(filled[2], lb):
        early = filled
        if not exhaustive:
            return (*early, lb)
    best = _best_lpt(tokens, tiles, problem, table, target, better)
    best = better(best, filled)
    if best is not None and target and best[1] != len(target):  # fill at the count LPT liked too
        best = better(best, _filled_at_count(tokens, tiles, best[1], problem, table))
    if packed is not None:
        best = _with_shrunk_packing(
            best, packed, len(target), tokens, tiles, problem, table, better
        )
    if early is not None:
        return (*early, lb)
    if best is None:
        lo, hi = problem.microbatches
        raise ValueError(
            f"the batch ({int(tokens.sum())} tokens, {int(tiles.sum())} tiles) does not fit {lo}..{hi} "
            f"microbatches of llm_dp={problem.llm_dp} x {problem.buckets.lengths[-1]} tokens and "
            f"{problem.tile_shards} tile shards x {problem.buckets.tiles[-1]} tiles: raise the largest "
            "buckets or the microbatch count"
        )
    return (*best, lb)


def _at_bound(obj: float, lb: float) -> bool:
    """Whether a surrogate reaches the lower bound (to rounding): nothing left to gain."""
    return obj <= lb * (1 + 1e-9)


def _targeted(tokens, tiles, target, problem, table, lb, pool):
    """Best-fit packing into the bound's bucket pairs `target` (`targeted_assign`), unshrunk:
    (packed bin_of or None, (bin_of, m, surrogate) if it reaches `lb` else None). The packing, when
    one is found, is appended to `pool`."""
    if not target:
        return None, None
    packed = targeted_assign(tokens, tiles, target, problem, table)
    if packed is None:
        return None, None
    obj = evaluate(packed, len(target), tokens, tiles, problem, table)[0]
    pool.append((packed, len(target), obj))
    return packed, ((packed, len(target), obj) if _at_bound(obj, lb) else None)


def _best_lpt(tokens, tiles, problem, table, target, better):
    """Best LPT + shrink over the candidate counts (plus the bound's count, when allowed), then over
    the neighbours of the best count while that improves: the coarse grid of a wide range can miss
    the best count. `better(a, b)` keeps the better candidate (and records `b`)."""
    lo, hi = problem.microbatches
    counts = candidate_counts(problem, len(tokens))
    if target and lo <= len(target) <= hi and len(target) not in counts:
        counts.append(len(target))
    best, tried = None, set()
    for m in counts:
        for cand in _lpt_shrunk(tokens, tiles, m, problem, table):
            best = better(best, cand)
        tried.add(m)
    step = 1
    while best is not None and step <= 2:  # neighbours of the best count
        cand = [m for m in (best[1] - step, best[1] + step) if lo <= m <= hi and m not in tried]
        before = best
        for m in cand:
            for shrunk in _lpt_shrunk(tokens, tiles, m, problem, table):
                best = better(best, shrunk)
            tried.add(m)
        step = 1 if best is not before else step + 1
    return best


def _filled_at_count(tokens, tiles, m, problem, table) -> tuple[np.ndarray, int, float] | None:
    """Minimum-slack filling of the bucket pairs the lower bound picks with exactly m microbatches."""
    at_m = dataclasses.replace(problem, microbatches=(m, m))
    return _filled(tokens, tiles, aggregate_bound(tokens, tiles, at_m, table)[1], problem, table)


def _with_shrunk_packing(best, packed, m, tokens, tiles, problem, table, better):
    """`best`, or the targeted packing `packed` (m microbatches) after shrinking if that is better.
    A packing that overflowed (already worse than `best` before shrinking) rarely wins and is slow
    to shrink: it is skipped."""
    raw = evaluate(packed, m, tokens, tiles, problem, table)[0]
    if best is None or raw < best[2]:
        shrunk = shrink(packed, m, tokens, tiles, problem, table)
        obj = evaluate(shrunk, m, tokens, tiles, problem, table)[0]
        best = better(best, (shrunk, m, obj))
    return best
