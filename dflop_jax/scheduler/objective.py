"""The scheduler's objective: per-microbatch costs at buckets, the 1F1B surrogate, and a lower bound.

The surrogate (DESIGN section 4) of a pipeline step over microbatches k = 1..M and stages s = 1..P, with
c_s(k) = forward + backward seconds of stage s at microbatch k's buckets, is

    step ~= sum_k max_s c_s(k) + (P - 1) * max_k max_s c_s(k)

(every microbatch passes the slowest stage once; the fill and drain of 1F1B cost P-1 more slots of the
slowest microbatch). It depends on a microbatch only through W(T_k, S_k) = max_s c_s(T_k, S_k), so the
scheduler precomputes W over all bucket pairs once (`CostTable`). Microbatches whose samples have no
tiles still run the encoder program at the smallest tile bucket (static shapes: every microbatch goes
through every stage), so they cost W(smallest T, S_k).

The lower bound is in `bound.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts import BucketSet, SampleShape, ScheduledMicrobatch, ScheduleProblem


def surrogate_step_time(costs: np.ndarray) -> float:
    """1F1B surrogate step time of `costs` [M, P, 2] (fwd, bwd seconds per microbatch and stage)."""
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 3 or costs.shape[2] != 2:
        raise ValueError(f"costs shape {costs.shape}: expected [microbatches, stages, 2]")
    if costs.shape[0] == 0:
        return 0.0
    per_mb = costs.sum(axis=2).max(axis=1)  # [M]
    return float(per_mb.sum() + (costs.shape[1] - 1) * per_mb.max())


@dataclasses.dataclass(frozen=True)
class CostTable:
    """W over all bucket pairs plus the cheapest allowed pair fitting any (tile, token) need.

    A sparse pair set (`BucketSet.pairs`) is taken as costs: a pair outside it costs what the
    cheapest allowed pair at least as large on both sides costs (where such a microbatch runs), and
    `best` never names it. So every search below (greedy, bound, filling, CP-SAT) sees the true
    cost of any bucket choice, and `pair_for` / `to_plans` return allowed pairs only.

    Attributes:
      tiles: tile buckets [nT]; lengths: length buckets [nS].
      stage: per-stage (fwd, bwd) seconds [nT, nS, P, 2] (of the covering allowed pair).
      w: max_s (fwd + bwd) [nT, nS] (of the covering allowed pair).
      best: [nT, nS, 2] index pair (ti, si) of the cheapest allowed pair with T >= tiles[ti] and
        S >= lengths[si].
    """

    tiles: np.ndarray
    lengths: np.ndarray
    stage: np.ndarray
    w: np.ndarray
    best: np.ndarray

    @classmethod
    def build(cls, problem: ScheduleProblem) -> CostTable:
        b = problem.buckets
        stage = np.zeros((len(b.tiles), len(b.lengths), problem.num_stages, 2))
        allowed = np.zeros((len(b.tiles), len(b.lengths)), dtype=bool)
        for ti, t in enumerate(b.tiles):
            for si, s in enumerate(b.lengths):
                if not b.allows(t, s):
                    continue
                allowed[ti, si] = True
                c = np.asarray(problem.stage_costs(t, s), dtype=np.float64)
                if (
                    c.shape != (problem.num_stages, 2)
                    or not np.all(np.isfinite(c))
                    or np.any(c < 0)
                ):
                    raise ValueError(
                        f"stage_costs({t}, {s}) gave {c!r}: need finite, non-negative, shape "
                        f"({problem.num_stages}, 2)"
                    )
                stage[ti, si] = c
        w = np.where(allowed, stage.sum(axis=3).max(axis=2), np.inf)
        best = _suffix_argmin(w)
        ti, si = best[..., 0], best[..., 1]
        return cls(np.asarray(b.tiles), np.asarray(b.lengths), stage[ti, si], w[ti, si], best)

    def nondominated(self) -> list[tuple[int, int, float]]:
        """Pairs (ti, si, W) no other pair beats: none at least as large on both sides and cheaper
        (or as cheap and different)."""
        nt, ns = self.w.shape
        allp = [(t, s, float(self.w[t, s])) for t in range(nt) for s in range(ns)]
        return [
            (t, s, w)
            for t, s, w in allp
            if not any(
                t2 >= t and s2 >= s and (w2 < w or (w2 == w and (t2, s2) != (t, s)))
                for t2, s2, w2 in allp
            )
        ]

    def pair_for(
        self, tile_need: np.ndarray, token_need: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Cheapest allowed bucket-pair indices (ti [M], si [M]) with T >= tile_need and
        S >= token_need."""
        ti = np.searchsorted(self.tiles, tile_need, side="left")
        si = np.searchsorted(self.lengths, token_need, side="left")
        if np.any(ti >= len(self.tiles)) or np.any(si >= len(self.lengths)):
            raise ValueError("a microbatch needs more than the largest bucket")
        p = self.best[ti, si]
        return p[..., 0], p[..., 1]


def _suffix_argmin(w: np.ndarray) -> np.ndarray:
    """[nT, nS, 2]: argmin of w over the quadrant ti' >= ti, si' >= si (ties: smallest buckets)."""
    nt, ns = w.shape
    best = np.zeros((nt, ns, 2), dtype=np.int64)
    for ti in range(nt - 1, -1, -1):
        for si in range(ns - 1, -1, -1):
            cand = [(ti, si)]
            if ti + 1 < nt:
                cand.append(tuple(best[ti + 1, si]))
            if si + 1 < ns:
                cand.append(tuple(best[ti, si + 1]))
            best[ti, si] = min(cand, key=lambda p: (w[p], p[0] + p[1], p))
    return best


@dataclasses.dataclass
class Assignment:
    """A candidate schedule in array form: sample i goes to bin `bin_of[i]` = k * l_dp + r."""

    bin_of: np.ndarray  # [N] int
    microbatches: int


def evaluate(
    bin_of: np.ndarray,
    m: int,
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (objective, W per microbatch [M], tile-bucket idx [M], length-bucket idx [M])."""
    ldp = problem.llm_dp
    tok_load = np.bincount(bin_of, weights=tokens, minlength=m * ldp).reshape(m, ldp)
    if problem.tiles_by_row:  # tiles stay in their row's block: the fullest row sets T
        need = np.bincount(bin_of, weights=tiles, minlength=m * ldp).reshape(m, ldp).max(axis=1)
    else:
        tile_load = np.bincount(bin_of // ldp, weights=tiles, minlength=m)
        need = np.ceil(tile_load / problem.tile_shards - 1e-9)
    over = need > table.tiles[-1]
    if problem.tiles_by_row and over.any():  # infeasible here; the search moves on (obj inf)
        need = np.minimum(need, table.tiles[-1])
    ti, si = table.pair_for(need, tok_load.max(axis=1))
    w = table.w[ti, si]
    obj = float(w.sum() + (problem.num_stages - 1) * w.max()) if m else 0.0
    return (np.inf if over.any() else obj), w, ti, si


def to_plans(
    bin_of: np.ndarray,
    m: int,
    ti: np.ndarray,
    si: np.ndarray,
    problem: ScheduleProblem,
    table: CostTable,
) -> tuple[ScheduledMicrobatch, ...]:
    """Array assignment -> ScheduledMicrobatches (samples within a shard keep their batch order)."""
    ldp = problem.llm_dp
    shards: list[list[list[int]]] = [[[] for _ in range(ldp)] for _ in range(m)]
    for i, b in enumerate(bin_of.tolist()):
        shards[b // ldp][b % ldp].append(i)
    ti, si = (np.asarray(a) for a in np.moveaxis(table.best[ti, si], -1, 0))  # allowed pairs only
    return tuple(
        ScheduledMicrobatch(
            int(table.tiles[ti[k]]),
            int(table.lengths[si[k]]),
            tuple(tuple(s) for s in shards[k]),
            tiles_by_row=problem.tiles_by_row,
            row_align=problem.row_align,
        )
        for k in range(m)
    )


def with_audio(
    plans: tuple[ScheduledMicrobatch, ...],
    shapes: Sequence[SampleShape],
    buckets: BucketSet,
    always: bool = False,
) -> tuple[ScheduledMicrobatch, ...]:
    """`plans` with each microbatch's audio bucket: the smallest that holds its fullest row's audio
    frames (`SampleShape.audio_frames`), after its rows are re-packed to balance those frames
    where the microbatch's own tile and length buckets allow (`balance_audio`); with `always`
    (`ScheduleProblem.audio_always`) at least the smallest bucket. Unchanged without audio."""
    if not buckets.audio:
        return plans
    out = []
    for p in plans:
        p = balance_audio(p, shapes)
        fullest = max(sum(shapes[i].audio_frames for i in row) for row in p.shards)
        bucket = buckets.audio_bucket(fullest) or (buckets.audio[0] if always else 0)
        out.append(dataclasses.replace(p, audio_bucket=bucket))
    return tuple(out)


def balance_audio(plan: ScheduledMicrobatch, shapes: Sequence[SampleShape]) -> ScheduledMicrobatch:
    """`plan` with its samples re-packed over its rows, most audio frames first, each to the row
    with the fewest frames that still holds it within the microbatch's length bucket (and, packed by
    row, its tile bucket): the tiles and tokens the buckets were chosen for still fit, so the
    vision and LLM programs do not change, and the fullest row's frames set a smaller audio bucket.
    Kept only when it lowers them; deterministic (index tie-breaks), samples in batch order."""
    members = sorted(plan.samples())
    frames = {i: shapes[i].audio_frames for i in members}
    rows = len(plan.shards)
    old = max(sum(frames[i] for i in row) for row in plan.shards)
    if rows < 2 or old == 0:
        return plan
    tile_cap = plan.tile_bucket if plan.tiles_by_row else float("inf")
    audio, tok, til = np.zeros(rows), np.zeros(rows), np.zeros(rows)
    new: list[list[int]] = [[] for _ in range(rows)]
    for i in sorted(members, key=lambda i: (-frames[i], -shapes[i].tokens, i)):
        fits = (tok + shapes[i].tokens <= plan.length_bucket) & (til + shapes[i].tiles <= tile_cap)
        if not fits.any():
            return plan
        r = int(np.lexsort((np.arange(rows), tok, audio, ~fits))[0])
        new[r].append(i)
        audio[r] += frames[i]
        tok[r] += shapes[i].tokens
        til[r] += shapes[i].tiles
    if audio.max() >= old:
        return plan
    return dataclasses.replace(plan, shards=tuple(tuple(sorted(row)) for row in new))


def check_fits(shapes: list[SampleShape], problem: ScheduleProblem) -> None:
    """Raises ValueError naming the first sample no bucket can hold (the data layer filters these)."""
    b: BucketSet = problem.buckets
    for i, s in enumerate(shapes):
        if s.tiles < 0 or s.tokens < 1:
            raise ValueError(
                f"sample {s.id!r} (index {i}): tiles={s.tiles}, tokens={s.tokens}: need tiles >= 0, tokens >= 1"
            )
        if s.tokens > b.lengths[-1]:
            raise ValueError(
                f"sample {s.id!r} (index {i}) has {s.tokens} tokens > largest length bucket {b.lengths[-1]}"
            )
        if not problem.tiles_by_row and s.tiles > problem.encoder_dp * b.tiles[-1]:
            raise ValueError(
                f"sample {s.id!r} (index {i}) has {s.tiles} tiles > encoder_dp*largest tile bucket "
                f"{problem.encoder_dp}*{b.tiles[-1]}"
            )
        if s.audio_windows and s.audio_frames > (b.audio[-1] if b.audio else 0):
            raise ValueError(
                f"sample {s.id!r} (index {i}) has {s.audio_frames} audio frames > largest audio "
                f"bucket {b.audio[-1] if b.audio else 0} (buckets.audio={list(b.audio)})"
            )
        if problem.tiles_by_row and s.tiles > b.tiles[-1]:
            raise ValueError(
                f"sample {s.id!r} (index {i}) has {s.tiles} tiles > largest tile bucket "
                f"{b.tiles[-1]} (tiles packed by row keep a sample's tiles in its row's block)"
            )


def padding_ratios(
    plans: tuple[ScheduledMicrobatch, ...],
    tokens: np.ndarray,
    tiles: np.ndarray,
    problem: ScheduleProblem,
) -> dict[str, float]:
    """1 - real / computed, per side (LLM tokens, encoder tiles)."""
    comp_tok = sum(p.length_bucket for p in plans) * problem.llm_dp
    comp_tile = sum(p.tile_slots(problem.encoder_dp) for p in plans)
    return {
        "padding_tokens": 1.0 - float(tokens.sum()) / comp_tok if comp_tok else 0.0,
        "padding_tiles": 1.0 - float(tiles.sum()) / comp_tile if comp_tile else 0.0,
    }


def load_balance(
    bin_of: np.ndarray, m: int, tokens: np.ndarray, tiles: np.ndarray, ldp: int
) -> dict[str, float]:
    """max/mean of real LLM tokens per (microbatch, shard) bin and of real tiles per microbatch."""
    tok = np.bincount(bin_of, weights=tokens, minlength=m * ldp)
    til = np.bincount(bin_of // ldp, weights=tiles, minlength=m)
    return {
        "bin_tokens_max_over_mean": float(tok.max() / tok.mean()) if tok.mean() > 0 else 1.0,
        "mb_tiles_max_over_mean": float(til.max() / til.mean()) if til.mean() > 0 else 1.0,
    }
