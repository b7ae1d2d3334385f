"""Minimum-slack filling: pack each bin of a bucket target as full as its samples allow (subset sum).

The aggregate lower bound (`bound.py`) often asks for bucket pairs whose total capacity exceeds the
batch by well under 1%: a packing that reaches it must fill almost every shard to its length bucket.
LPT and best-fit leave a few percent of slack per shard and end one bucket step above the target on a
few microbatches. Filling bins one at a time with the subset of the remaining samples whose tokens come
closest to the bin's capacity from below (Gupta and Ho's minimum bin slack, exact subset sum by a
Python-int bitset) closes that gap when samples are small against the bins, which is the regime of
N = 256..1024 into 32..128 bins.

Tiles: a microbatch's shards share its tile capacity; a shard may only take samples with tiles that
still fit it, and a chosen subset over it drops its tile-heaviest samples until it fits. Samples left
after the last bin go where they overflow least (`greedy.targeted_assign` rule); the evaluation then
gives that microbatch a larger bucket and the greedy's shrinking moves repair it. Deterministic.
"""

from __future__ import annotations

import numpy as np

from dflop_jax.contracts import ScheduleProblem
from dflop_jax.scheduler.objective import CostTable


def fill_assign(
    tokens: np.ndarray,
    tiles: np.ndarray,
    target: list[tuple[int, int]],
    problem: ScheduleProblem,
    table: CostTable,
    open_with_largest: bool = False,
) -> np.ndarray | None:
    """bin_of [N] for the target pairs [(ti, si)] * M, or None if a leftover fits nowhere.

    With `open_with_largest` every bin starts with the largest remaining sample (Gupta and Ho's
    rule), so large samples are not the ones left for the last bins; without it a bin takes any
    subset. Neither wins everywhere (heavy-tailed batches: each is better on some), so the greedy
    tries both.
    """
    ldp, edp, m = problem.llm_dp, problem.tile_shards, len(target)
    tok = tokens.astype(np.int64)
    left = np.ones(len(tok), dtype=bool)
    bin_of = np.full(len(tok), -1, dtype=np.int64)
    order = sorted(range(m), key=lambda k: (-table.lengths[target[k][1]], k))
    tile_room = np.array([table.tiles[t] * edp for t, _ in target], dtype=np.float64)
    tok_load = np.zeros(m * ldp)
    for k in order:
        cap = int(table.lengths[target[k][1]])
        for r in range(ldp):
            ok = np.flatnonzero(left & (tiles <= tile_room[k]))
            if ok.size == 0:
                continue
            first = ok[[int(np.argmax(tok[ok]))]] if open_with_largest else ok[:0]
            rest = np.setdiff1d(ok, first)
            room = cap - int(tok[first].sum())
            if room < 0:
                continue
            picked = np.concatenate([first, rest[_closest_subset(tok[rest], room)]])
            while picked.size and tiles[picked].sum() > tile_room[k]:
                picked = np.delete(picked, int(np.argmax(tiles[picked])))
            bin_of[picked] = k * ldp + r
            left[picked] = False
            tile_room[k] -= tiles[picked].sum()
            tok_load[k * ldp + r] = tok[picked].sum()
    tile_load = np.array([table.tiles[t] * edp for t, _ in target], dtype=np.float64) - tile_room
    return _place_leftovers(bin_of, left, tokens, tiles, tok_load, tile_load, problem, table)


def _closest_subset(sizes: np.ndarray, cap: int) -> np.ndarray:
    """Indices of a subset of `sizes` with the largest sum <= cap (exact subset sum, bitset DP)."""
    mask = (1 << (cap + 1)) - 1
    reach = [1]  # reach[j]: sums reachable with the first j items, as bits
    for s in sizes.tolist():
        reach.append((reach[-1] | (reach[-1] << s)) & mask)
    best = reach[-1].bit_length() - 1
    out, total = [], best
    for j in range(
        len(sizes), 0, -1
    ):  # walk back: item j-1 used iff total not reachable without it
        if not (reach[j - 1] >> total) & 1:
            out.append(j - 1)
            total -= int(sizes[j - 1])
    return np.array(out[::-1], dtype=np.int64)


def _place_leftovers(bin_of, left, tokens, tiles, tok_load, tile_load, problem, table):
    """Leftover samples into the least loaded bins that take them, never past the largest buckets."""
    ldp, edp = problem.llm_dp, problem.tile_shards
    mb = np.arange(len(tok_load)) // ldp
    for i in np.flatnonzero(left)[np.argsort(-tokens[left], kind="stable")]:
        hard = (tok_load + tokens[i] <= table.lengths[-1]) & (
            tile_load[mb] + tiles[i] <= table.tiles[-1] * edp
        )
        if not hard.any():
            return None
        b = int(np.argmin(np.where(hard, tok_load + tokens[i], np.inf)))
        bin_of[i] = b
        tok_load[b] += tokens[i]
        tile_load[mb[b]] += tiles[i]
    return bin_of
