"""The schedule contract: the problem a plan fixes, and the static-shape schedule of one global batch.

Written by the scheduler, read by the data layer (which packs arrays from a `Schedule`), the planner
(which scores layouts by scheduling sampled batches) and the runtime. Pure Python / NumPy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from dflop_jax.contracts.shapes import BucketSet, SampleShape

# (tile_bucket, length_bucket) -> array [num_stages, 2] of (forward, backward) seconds for one microbatch,
# stages in pipeline order (encoder stages, then LLM stages). Buckets are per data-parallel shard.
# (tile_bucket, length_bucket[, audio_bucket]) -> [P, 2] (fwd, bwd) seconds per stage; called with
# the audio bucket only where `BucketSet.audio` is not empty
StageCostFn = Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class ScheduleProblem:
    """Everything fixed by the plan for scheduling one global batch.

    Attributes:
      encoder_dp: encoder data-parallel degree v_dp.
      llm_dp: LLM data-parallel degree l_dp.
      num_stages: pipeline depth P (encoder + LLM stages).
      microbatches: allowed microbatch counts (min, max), inclusive.
      buckets: the bucket sets.
      stage_costs: predicted per-stage (fwd, bwd) seconds of a microbatch at given buckets.
      tiles_by_row: each LLM row's samples' tiles fill that row's own block of the microbatch's tile
        slots (`ScheduledMicrobatch.tile_slots`), so the first LLM stage gathers features only within a
        row; the tile bucket is then tiles per ROW and covers the fullest row. Every layout the
        runtime runs packs so (an encoder colocated on the LLM's shards, or one on its own stages).
      row_align: a row's block of tile slots is a multiple of this (the first LLM stage's tp, over
        whose devices the block arrives split; 1 for a colocated encoder).
      audio_always: every microbatch takes an audio bucket, at least the smallest (the audio
        encoder on stages of its own runs every microbatch: the pipeline's programs are static);
        otherwise a microbatch without audio takes none.
    """

    encoder_dp: int
    llm_dp: int
    num_stages: int
    microbatches: tuple[int, int]
    buckets: BucketSet
    stage_costs: StageCostFn
    tiles_by_row: bool = False
    row_align: int = 1
    audio_always: bool = False

    def __post_init__(self):
        if self.row_align < 1:
            raise ValueError(f"row_align={self.row_align}: need >= 1")

    def microbatch_costs(self, mb: ScheduledMicrobatch) -> np.ndarray:
        """[P, 2] predicted (fwd, bwd) seconds of `mb` at its buckets, its audio bucket included
        where the problem has an audio ladder."""
        audio = (mb.audio_bucket,) if self.buckets.audio else ()
        return np.asarray(self.stage_costs(mb.tile_bucket, mb.length_bucket, *audio))

    @property
    def tile_shards(self) -> int:
        """Over how many shards a microbatch's tiles spread, each holding at most the tile bucket:
        the LLM rows when tiles are packed by row, else the encoder's shards."""
        return self.llm_dp if self.tiles_by_row else self.encoder_dp


def row_tile_slots(tile_bucket: int, encoder_dp: int, llm_dp: int, row_align: int = 1) -> int:
    """Tile slots of one LLM row's block when tiles are packed by row: the row's tile bucket padded
    up to a multiple of `row_align` (the block splits evenly over the receiving stage's tp devices)
    and so that the llm_dp blocks together split evenly over the encoder's encoder_dp shards. The
    padding sits at the end of each block, so every block starts at row * slots."""
    step = math.lcm(row_align, encoder_dp // math.gcd(encoder_dp, llm_dp))
    return -(-tile_bucket // step) * step


@dataclasses.dataclass(frozen=True)
class ScheduledMicrobatch:
    """One scheduled microbatch: its buckets and which samples each LLM data-parallel shard packs.

    Attributes:
      tile_bucket: T, tiles per encoder shard (all encoder shards use the same T); with
        `tiles_by_row` tiles per LLM row.
      length_bucket: S, tokens per LLM shard row (all LLM shards use the same S).
      shards: per LLM dp shard, indices into the global batch's sample list, in packing order.
      tiles_by_row: row r's samples' tiles fill row r's own block of tile slots,
        [r * R, (r + 1) * R) with R = `row_tile_slots(T, encoder_dp, llm_dp, row_align)`.
      row_align: see `ScheduleProblem.row_align`.
      audio_bucket: A, audio encoder frames per LLM row: row r's samples' audio windows, their kept
        frames back to back (`SampleShape.audio_frames`), then padding; 0 for a microbatch without
        audio.
    """

    tile_bucket: int
    length_bucket: int
    shards: tuple[tuple[int, ...], ...]
    tiles_by_row: bool = False
    row_align: int = 1
    audio_bucket: int = 0

    def samples(self) -> tuple[int, ...]:
        return tuple(i for shard in self.shards for i in shard)

    def tile_slots(self, encoder_dp: int) -> int:
        """Tile slots of the microbatch (the encoder's tile axis, split over its encoder_dp shards)."""
        if not self.tiles_by_row:
            return encoder_dp * self.tile_bucket
        rows = len(self.shards)
        return rows * row_tile_slots(self.tile_bucket, encoder_dp, rows, self.row_align)

    def tile_placement(
        self, shapes: Sequence[SampleShape], encoder_dp: int
    ) -> dict[tuple[int, int], int]:
        """(sample index, tile index) -> tile slot. The encoder's tiles are independent, so without
        `tiles_by_row` they fill the slots in sample order (a sample's tiles may span encoder
        shards); with it row r's samples' tiles fill row r's block from its start."""
        if not self.tiles_by_row:
            tiles = [(i, t) for i in self.samples() for t in range(shapes[i].tiles)]
            if len(tiles) > self.tile_slots(encoder_dp):
                raise ValueError(
                    f"microbatch has {len(tiles)} tiles > encoder_dp {encoder_dp} x tile bucket "
                    f"{self.tile_bucket}"
                )
            return {it: k for k, it in enumerate(tiles)}
        block = self.tile_slots(encoder_dp) // len(self.shards)
        out = {}
        for r, shard in enumerate(self.shards):
            tiles = [(i, t) for i in shard for t in range(shapes[i].tiles)]
            if len(tiles) > self.tile_bucket:
                raise ValueError(
                    f"microbatch packed by row: row {r} has {len(tiles)} tiles > tile bucket "
                    f"{self.tile_bucket}"
                )
            out.update({it: r * block + k for k, it in enumerate(tiles)})
        return out

    def encoder_tiles(
        self, shapes: Sequence[SampleShape], encoder_dp: int
    ) -> list[list[tuple[int, int]]]:
        """Tiles per encoder shard as (sample index, tile index), in slot order (`tile_placement`)."""
        per_shard = self.tile_slots(encoder_dp) // encoder_dp
        out: list[list[tuple[int, int]]] = [[] for _ in range(encoder_dp)]
        for it, slot in sorted(self.tile_placement(shapes, encoder_dp).items(), key=lambda x: x[1]):
            out[slot // per_shard].append(it)
        return out


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The scheduler's answer for one global batch, with its quality report.

    Attributes:
      microbatches: the microbatches in execution order.
      objective: predicted step time in seconds (1F1B surrogate of DESIGN section 4).
      lower_bound: a proven lower bound on that objective for this batch.
      solver: which solver produced the answer ("greedy", "lns", or a baseline's name).
      time_s: wall time the scheduler took.
      info: extra report fields (greedy objective, cpsat status, padding ratios, ...).
    """

    microbatches: tuple[ScheduledMicrobatch, ...]
    objective: float
    lower_bound: float
    solver: str
    time_s: float
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def gap(self) -> float:
        return self.objective / self.lower_bound - 1.0 if self.lower_bound > 0 else float("inf")


def schedule_digest(schedule: Schedule | None) -> str:
    """A short hash of the schedule's buckets and assignment, in execution order ("" for None).

    It fixes which programs run and what each shard packs, so the processes of a run must agree on it
    before dispatching a batch (`runtime/schedule_agreement.py` compares it every step).
    """
    if schedule is None:
        return ""
    text = repr([(p.tile_bucket, p.length_bucket, p.shards) + ((p.audio_bucket,) if p.audio_bucket else ())
                 for p in schedule.microbatches])  # fmt: skip
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class ScheduleFn(Protocol):
    """Schedules global batch `index` (its position in the run, from 0) given its sample shapes.

    The index is explicit so that a schedule depends only on (shapes, index) and the function's owner's
    state, never on how many batches were prefetched or whether the run resumed: the runtime owns the
    online `Scheduler` and hands the loader this function.
    """

    def __call__(self, shapes: list[SampleShape], index: int) -> Schedule: ...
