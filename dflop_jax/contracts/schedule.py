"""The schedule contract: the problem a plan fixes, and the static-shape schedule of one global batch.

Written by the scheduler, read by the data layer (which packs arrays from a `Schedule`), the planner
(which scores layouts by scheduling sampled batches) and the runtime. Pure Python / NumPy.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from dflop_jax.contracts.shapes import BucketSet, SampleShape

# (tile_bucket, length_bucket) -> array [num_stages, 2] of (forward, backward) seconds for one microbatch,
# stages in pipeline order (encoder stages, then LLM stages). Buckets are per data-parallel shard.
StageCostFn = Callable[[int, int], np.ndarray]


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
      colocated: the encoder runs on the LLM's data shards (encoder_dp == llm_dp): each sample's tiles
        go to the shard holding its row, so a microbatch's tile bucket covers its fullest shard.
    """

    encoder_dp: int
    llm_dp: int
    num_stages: int
    microbatches: tuple[int, int]
    buckets: BucketSet
    stage_costs: StageCostFn
    colocated: bool = False

    def __post_init__(self):
        if self.colocated and self.encoder_dp != self.llm_dp:
            raise ValueError(
                f"colocated encoder: encoder_dp={self.encoder_dp} must equal llm_dp={self.llm_dp}"
            )


@dataclasses.dataclass(frozen=True)
class MicrobatchPlan:
    """One microbatch: its buckets and which samples each LLM data-parallel shard packs.

    Attributes:
      tile_bucket: T, tiles per encoder shard (all encoder shards use the same T).
      length_bucket: S, tokens per LLM shard row (all LLM shards use the same S).
      shards: per LLM dp shard, indices into the global batch's sample list, in packing order.
      tiles_by_row: the encoder is colocated: shard r's samples' tiles fill encoder shard r.
    """

    tile_bucket: int
    length_bucket: int
    shards: tuple[tuple[int, ...], ...]
    tiles_by_row: bool = False

    def samples(self) -> tuple[int, ...]:
        return tuple(i for shard in self.shards for i in shard)

    def encoder_tiles(
        self, shapes: Sequence[SampleShape], encoder_dp: int
    ) -> list[list[tuple[int, int]]]:
        """Tiles per encoder shard as (sample index, tile index), filled in order: shard 0 up to T, ...

        The encoder's tiles are independent, so any sample's tiles may be split across shards; with
        `tiles_by_row` shard r holds exactly the tiles of LLM shard r's samples (so the colocated
        encoder's features stay on the shard that places them).
        """
        if self.tiles_by_row:
            out = [[(i, t) for i in shard for t in range(shapes[i].tiles)] for shard in self.shards]
            if len(out) != encoder_dp or max(map(len, out), default=0) > self.tile_bucket:
                raise ValueError(
                    f"colocated microbatch: shard tiles {[len(o) for o in out]} over encoder_dp="
                    f"{encoder_dp} shards of tile bucket {self.tile_bucket}"
                )
            return out
        out: list[list[tuple[int, int]]] = [[] for _ in range(encoder_dp)]
        slot = 0
        for i in self.samples():
            for t in range(shapes[i].tiles):
                out[slot // self.tile_bucket].append((i, t))
                slot += 1
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

    microbatches: tuple[MicrobatchPlan, ...]
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
    before dispatching a batch (`runtime/agreement.py` compares it every step).
    """
    if schedule is None:
        return ""
    text = repr([(p.tile_bucket, p.length_bucket, p.shards) for p in schedule.microbatches])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class ScheduleFn(Protocol):
    """Schedules global batch `index` (its position in the run, from 0) given its sample shapes.

    The index is explicit so that a schedule depends only on (shapes, index) and the function's owner's
    state, never on how many batches were prefetched or whether the run resumed: the runtime owns the
    online `Scheduler` and hands the loader this function.
    """

    def __call__(self, shapes: list[SampleShape], index: int) -> Schedule: ...
