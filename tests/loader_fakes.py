"""Test doubles for the loader (no tests here): a processor over tiny fake records, a first-fit scheduler.

Module-level classes, so grain worker processes can unpickle them.
"""

from __future__ import annotations

import numpy as np

from dflop_jax.contracts import (
    BucketSet,
    SampleShape,
    Schedule,
    ScheduledMicrobatch,
    ScheduleProblem,
)
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.sample_arrays import TEXT, ProcessedSample

TPT = 2
TILE = (2, 2, 3)


def tagged_tile(sample: int, t: int) -> np.ndarray:
    """A uint8 tile whose first pixel names (sample, t): (sample // 256, sample % 256, t)."""
    tile = np.zeros(TILE, np.uint8)
    tile[0, 0] = (sample // 256, sample % 256, t)
    return tile


def tile_tag(tile: np.ndarray) -> tuple[int, int]:
    """(sample, t) of a `tagged_tile`."""
    hi, lo, t = (int(v) for v in tile[0, 0])
    return hi * 256 + lo, t


def fake_records(
    n: int, seed: int = 0, bad: dict[int, str] | None = None, bad_load: dict[int, str] | None = None
):
    """n records {"id", "tiles", "text"}; `bad` / `bad_load` map an index to a BadSample reason raised by
    shape() / process()."""
    rng = np.random.default_rng(seed)
    bad, bad_load = bad or {}, bad_load or {}
    out = []
    for i in range(n):
        rec = {
            "id": i,
            "tiles": int(rng.integers(0, 4)),
            "text": int(rng.integers(2, 12)),
            "_location": f"fake:{i}",
        }
        if i in bad:
            rec["bad"] = bad[i]
        if i in bad_load:
            rec["bad_load"] = bad_load[i]
        out.append(rec)
    return out


class FakeProcessor:
    """shape(): tiles + text + TPT tokens per tile; process(): deterministic arrays traceable to the id."""

    tile_shape = TILE
    tokens_per_tile = TPT

    def shape(self, record) -> SampleShape:
        if "bad" in record:
            raise BadSample(record["bad"], record["_location"], "fake")
        t = record["tiles"]
        return SampleShape(record["id"], t, record["text"] + t * TPT, "image" if t else "text")

    def process(self, record) -> ProcessedSample:
        if "bad_load" in record:
            raise BadSample(record["bad_load"], record["_location"], "fake load failure")
        i, t, x = record["id"], record["tiles"], record["text"] + record.get("lie", 0)
        src = np.array([TEXT] * x + list(range(t * TPT)), np.int32)
        ids = np.arange(len(src), dtype=np.int32) + 100 * i + 1
        mask = np.arange(len(src)) % 2 == 0
        tiles = np.stack([tagged_tile(i, k) for k in range(t)]) if t else np.zeros((0, *TILE))
        return ProcessedSample(
            i, ids, mask, src, tiles.astype(np.uint8), np.zeros(t, bool), "image"
        )


class CountingProcessor(FakeProcessor):
    """Records the ids it processed (in-process use only)."""

    def __init__(self):
        self.processed: list[int] = []
        self.shaped: list[int] = []

    def shape(self, record) -> SampleShape:
        self.shaped.append(record["id"])
        return super().shape(record)

    def process(self, record) -> ProcessedSample:
        self.processed.append(record["id"])
        return super().process(record)


def fake_problem(encoder_dp=2, llm_dp=2, tiles=(2, 4), lengths=(16, 32, 64)) -> ScheduleProblem:
    def costs(T, S):
        return np.array([[T * 1.0, T * 2.0], [S * 0.1, S * 0.2]])

    return ScheduleProblem(encoder_dp, llm_dp, 2, (1, 8), BucketSet(tiles, lengths), costs)


class FirstFit:
    """In-order first fit into microbatches of llm_dp rows (the smallest fitting buckets). Not a good
    scheduler, just a valid and deterministic one; counts its calls."""

    def __init__(self, problem: ScheduleProblem):
        self.p = problem
        self.calls = 0

    def __call__(self, shapes: list[SampleShape], index: int) -> Schedule:
        self.calls += 1
        p, S_max = self.p, self.p.buckets.lengths[-1]
        tile_cap = p.encoder_dp * p.buckets.tiles[-1]
        mbs: list[list[list[int]]] = []
        for i, s in enumerate(shapes):
            placed = False
            for mb in mbs:
                tiles = sum(shapes[j].tiles for row in mb for j in row)
                if tiles + s.tiles > tile_cap:
                    continue
                for row in mb:
                    if sum(shapes[j].tokens for j in row) + s.tokens <= S_max:
                        row.append(i)
                        placed = True
                        break
                if placed:
                    break
            if not placed:
                mbs.append([[i]] + [[] for _ in range(p.llm_dp - 1)])
        plans = []
        for mb in mbs:
            tokens = max(sum(shapes[j].tokens for j in row) for row in mb)
            tiles = sum(shapes[j].tiles for row in mb for j in row)
            S = next(b for b in p.buckets.lengths if b >= tokens)
            T = next(b for b in p.buckets.tiles if b * p.encoder_dp >= tiles)
            plans.append(ScheduledMicrobatch(T, S, tuple(tuple(row) for row in mb)))
        return Schedule(tuple(plans), 1.0, 1.0, "firstfit", 0.0)


class DyingProcessor(FakeProcessor):
    """Kills its (worker) process when asked to process record `die_at`: the loader must raise, not hang."""

    def __init__(self, die_at: int):
        self.die_at = die_at

    def process(self, record) -> ProcessedSample:
        if record["id"] == self.die_at:
            import os

            os._exit(3)
        return super().process(record)
