"""Scoring a candidate layout: memory check, a typical-batch screen, and the expected step time.

Expected step time (DESIGN section 7): the mean over K global batches sampled from the shape
distribution of the simulated makespan of the scheduler's actual output -- `schedule_batch` (or a
baseline scheduler) on the layout's `ScheduleProblem`, then the discrete-event simulator with each
microbatch's per-stage costs and transfers at its buckets. The same K batches score every candidate
(common random numbers), so differences between candidates are not sampling noise.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from dflop_jax.contracts.layout import Layout
from dflop_jax.costs import (
    AnalyticCostProvider,
    layout_memory,
    layout_stage_costs,
    layout_transfer_costs,
    residual_policies,
)
from dflop_jax.costs.update import layout_update_times, norm_barrier_time
from dflop_jax.planner.buckets import ShapeStats, bucket_set
from dflop_jax.planner.candidates import Candidate
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.scheduler import (
    BucketSet,
    SampleShape,
    Schedule,
    ScheduleProblem,
    SchedulerConfig,
    schedule_batch,
)
from dflop_jax.sim import SimResult, StepUpdate, device_order, simulate

# (shapes, problem) -> Schedule: how the planner schedules a sampled batch (the online scheduler or a
# baseline). Not `contracts.ScheduleFn`, which schedules batch k of a run for the loader.
SchedulePolicy = Callable[[Sequence[SampleShape], ScheduleProblem], Schedule]


@dataclasses.dataclass(frozen=True)
class LayoutCosts:
    """A layout's cost functions, memoized per bucket triple (tile, length, audio; audio 0 for a
    model without audio)."""

    layout: Layout  # with chunks > 1 the virtual layout (one entry per virtual stage)
    stage: Callable[..., np.ndarray]  # (T, S, A=0) -> [P, 2]
    transfer: Callable[..., np.ndarray]  # (T, S, A=0) -> [P - 1]
    chunks: int = 1  # model chunks per device group: > 1 simulates interleaved 1F1B
    update: StepUpdate | None = None  # the per-step update after the pipeline (costs/update.py)

    @classmethod
    def build(
        cls, provider, layout: Layout, chunks: int = 1, residuals: Sequence[str] | None = None
    ) -> LayoutCosts:
        """Transfers between virtual stages are costed as if the virtual stages sat on consecutive
        devices (the same stage sizes; the wrap-around from the last device group to the first is
        counted like any stage boundary). Every step pays the update after its pipeline: ZeRO-1
        reduce-scatter, global-norm barrier, AdamW, all-gather (`costs/update.py`). Stage times are
        those of each stage's residual policy (`residuals`, `costs.layout_stage_costs`)."""
        xfer = layout_transfer_costs(provider, layout)
        cache: dict[tuple[int, int, int], np.ndarray] = {}

        def transfer(t: int, s: int, a: int = 0) -> np.ndarray:
            if (t, s, a) not in cache:
                cache[t, s, a] = xfer(t, s, a)
            return cache[t, s, a]

        groups = layout_update_times(provider, layout, chunks)
        update = StepUpdate(tuple(r for r, _ in groups), tuple(a for _, a in groups),
                            norm_barrier_time(provider))  # fmt: skip
        stage = layout_stage_costs(provider, layout, residuals)
        return cls(layout, stage, transfer, chunks, update)

    def simulate(self, times: np.ndarray, transfer, kind: str) -> SimResult:
        """`sim.simulate` of `times` [M, P, 2] under `kind`, interleaved when the layout has chunks.

        Interleaving needs a multiple of the stage count; a schedule with more (the data-blind
        scheduler spills past its M when a microbatch overflows its bucket) is padded with empty,
        zero-cost microbatches up to the next multiple: Megatron would run a full group there.
        A layout with audio stages is an in-tree of two encoder branches (`Layout.children`)."""
        if self.chunks == 1:
            children = self.layout.children if self.layout.audio_stages else None
            return simulate(times, transfer, kind, update=self.update, children=children)
        p = self.layout.num_stages // self.chunks
        times = np.asarray(times, dtype=np.float64)
        extra = -len(times) % p
        if extra:
            xfer = np.broadcast_to(
                np.asarray(transfer, dtype=np.float64), times.shape[:1] + (times.shape[1] - 1,)
            )
            times = np.concatenate([times, np.zeros((extra,) + times.shape[1:])])
            transfer = np.concatenate([xfer, np.zeros((extra, xfer.shape[1]))])
        return simulate(times, transfer, "interleaved", self.chunks, self.update)


def candidate_buckets(cand: Candidate, stats: ShapeStats, config: PlannerConfig) -> BucketSet:
    lay = cand.layout
    return bucket_set(
        stats,
        config.global_batch,
        cand.microbatches,
        lay.encoder_dp,
        lay.llm_dp,
        cand.num_buckets,
        config.length_align,
        by_row=lay.tiles_by_row,
        pooled=lay.pooled_tiles,
    )


def in_flight(num_stages: int, microbatches: int, schedule: str) -> list[int]:
    """Microbatches alive at once per stage: 1F1B min(P - s, M) (sim/pipeline.py); GPipe all M."""
    if schedule == "gpipe":
        return [microbatches] * num_stages
    return [min(num_stages - s, microbatches) for s in range(num_stages)]


def stage_in_flight(cand: Candidate, config: PlannerConfig) -> list[int]:
    """Per stage, the microbatches alive at once at the most microbatches the scheduler may use."""
    most = microbatch_range(cand.microbatches, config.microbatch_slack)[1]
    return in_flight(cand.layout.num_stages, most, config.schedule)


def stage_residuals(
    provider, cand: Candidate, buckets: BucketSet, config: PlannerConfig, usable: float
) -> tuple[str, ...] | None:
    """Each stage's residual policy, the one its run trains (`residuals: auto`): with analytic
    costs the first of "all", "layers", "recompute" whose peak with its in-flight microbatches fits
    `usable` bytes (`costs.residual_policies`, the runtime's own rule); a measured table's own
    policy for every stage (its times and memory are that policy's); None for an interleaved
    baseline, planned as "recompute"."""
    if cand.chunks > 1:
        return None
    table = getattr(provider, "table", None)
    if table is not None:
        return (table.residuals,) * cand.layout.num_stages
    if not isinstance(provider, AnalyticCostProvider):
        return None
    counts = stage_in_flight(cand, config)
    return tuple(residual_policies(provider, cand.layout, buckets, counts, usable))


def stage_memory_bytes(
    provider,
    cand: Candidate,
    buckets: BucketSet,
    config: PlannerConfig,
    residuals: Sequence[str] | None = None,
) -> list[float]:
    """Peak bytes per device of each stage at the largest buckets with its in-flight activations
    under its residual policy (`stage_residuals`; with chunks: per device group, see
    `interleaved_memory_bytes`)."""
    if cand.chunks > 1:
        return interleaved_memory_bytes(provider, cand, buckets, config)
    counts = stage_in_flight(cand, config)
    analytic = isinstance(provider, AnalyticCostProvider)  # a table's memory is its own policy's
    policies = residuals if analytic else None
    return [m.total() for m in layout_memory(provider, cand.layout, buckets, counts, policies)]


def interleaved_memory_bytes(
    provider, cand: Candidate, buckets: BucketSet, config: PlannerConfig
) -> list[float]:
    """Per device group of an interleaved candidate: the state of all its chunks, plus the peak over
    its interleaved 1F1B order (sim.device_order) of the activations alive (a chunk's forward adds its
    virtual stage's, its backward frees them), plus the largest transient. The order is walked at the
    most microbatches the scheduler may use, rounded up to a multiple of the stage count."""
    v = cand.chunks
    p = len(cand.layout.llm_stages) // v
    most = microbatch_range(cand.microbatches, config.microbatch_slack)[1]
    most = -(-most // p) * p
    mems = layout_memory(provider, cand.layout, buckets, 1)
    out = []
    for d in range(p):
        mine = [mems[c * p + d] for c in range(v)]
        live = peak = 0.0
        for kind, _, j in device_order("interleaved", d, p, most, v):
            live += mems[j].activations_per_microbatch * (1 if kind == "F" else -1)
            peak = max(peak, live)
        state = sum(m.params + m.grads + m.optimizer for m in mine)
        out.append(state + peak + max(m.temp for m in mine))
    return out


def microbatch_range(microbatches: int, slack: float) -> tuple[int, int]:
    """(M, ceil(M x (1 + slack))): the counts the scheduler may use for a candidate with M."""
    return microbatches, math.ceil(microbatches * (1.0 + slack) - 1e-9)


def problem_for(
    costs: LayoutCosts, microbatches: tuple[int, int], buckets: BucketSet
) -> ScheduleProblem:
    """The scheduling problem a candidate is scored on: the runtime's own (`ResolvedPlan.problem`),
    tiles packed by row where the layout packs so (`Layout.tiles_by_row`: the fullest row sets the
    tile bucket)."""
    lay = costs.layout
    return ScheduleProblem(
        encoder_dp=lay.encoder_dp,
        llm_dp=lay.llm_dp,
        num_stages=lay.num_stages,
        microbatches=microbatches,
        buckets=buckets,
        stage_costs=costs.stage,
        tiles_by_row=lay.tiles_by_row,
        row_align=lay.row_align,
        audio_always=bool(lay.audio_stages),
    )


def simulate_schedule(schedule: Schedule, costs: LayoutCosts, kind: str = "1f1b") -> SimResult:
    """Simulates one step of `schedule`: per-microbatch stage costs [M, P, 2] and transfers at its buckets."""
    mbs = schedule.microbatches
    keys = [(mb.tile_bucket, mb.length_bucket, mb.audio_bucket) for mb in mbs]
    times = np.stack([costs.stage(*k) for k in keys])
    xfer = np.stack([costs.transfer(*k) for k in keys])
    return costs.simulate(times, xfer, kind)


def mean_shape_buckets(
    cand: Candidate, buckets: BucketSet, stats: ShapeStats, config: PlannerConfig
) -> tuple[int, int, int]:
    """(tile, length, audio) buckets of a microbatch carrying exactly the mean load (smallest that
    holds it; audio per LLM row, 0 without an audio ladder)."""
    lay = cand.layout
    g, m = config.global_batch, cand.microbatches
    tok = stats.mean_tokens * g / (m * lay.llm_dp)
    til = stats.mean_tiles * g / (m * lay.encoder_dp)
    frames = stats.mean_audio * g / (m * lay.llm_dp)
    return (_smallest_at_least(buckets.tiles, math.ceil(til - 1e-9)),
            _smallest_at_least(buckets.lengths, tok),
            _audio_bucket(buckets, frames, bool(lay.audio_stages)))  # fmt: skip


def mean_shape_surrogate(
    costs: LayoutCosts,
    cand: Candidate,
    buckets: BucketSet,
    stats: ShapeStats,
    config: PlannerConfig,
) -> float:
    """The scheduler's 1F1B surrogate (no transfers) of M identical microbatches at the smallest
    buckets holding the mean load, plus the step's update: cheap, computed for every candidate, over
    memory or not."""
    lay, m = costs.layout, cand.microbatches
    key = mean_shape_buckets(cand, buckets, stats, config)
    tail = costs.update.tail if costs.update is not None else 0.0
    return float((m + lay.num_stages - 1) * costs.stage(*key).sum(axis=1).max() + tail)


@dataclasses.dataclass(frozen=True, eq=False)
class ScreenBatch:
    """A typical global batch for the screen: `global_batch` samples at evenly spaced quantiles of the
    shape distribution's token counts, sorted by tokens (deterministic: no sampling noise in the
    ranking). tokens, tiles and audio (mel frames, `SampleShape.audio_frames`): [G] per sample."""

    tokens: np.ndarray
    tiles: np.ndarray
    audio: np.ndarray

    @classmethod
    def of(cls, shapes: Sequence[SampleShape], global_batch: int) -> ScreenBatch:
        order = sorted(shapes, key=lambda s: (s.tokens, s.tiles))
        picks = [order[int((i + 0.5) * len(order) / global_batch)] for i in range(global_batch)]
        return cls(
            *(
                np.array([get(s) for s in picks], dtype=np.float64)
                for get in (lambda s: s.tokens, lambda s: s.tiles, lambda s: s.audio_frames)
            )
        )


def screen_buckets(
    cand: Candidate, buckets: BucketSet, batch: ScreenBatch
) -> list[tuple[int, int, int]]:
    """Per microbatch of the screen, its (tile, length, audio) buckets: the typical batch, sorted, cut into M
    consecutive microbatches (a bucket-aware scheduler groups samples of like length), each at the
    smallest buckets holding its FULLEST shard. A packed row holds whole samples, so that shard holds
    at least the microbatch's longest sample, and at least the mean load; so does a row's block of
    tiles packed by row (`Layout.tiles_by_row`: the tile bucket is per row); otherwise the encoder
    shards split the tiles evenly. With about one sample per shard (high dp, few microbatches) the fullest shard is
    the longest sample, not the mean one: a mean-load screen ranks such layouts far too well. A
    row's audio frames likewise (the scheduler balances them over the rows, `balance_audio`)."""
    lay = cand.layout
    shape = (lay.llm_dp, lay.encoder_dp, lay.tiles_by_row, bool(lay.audio_stages))
    return list(_screen_keys(batch, shape, cand.microbatches, buckets))


@functools.lru_cache(maxsize=4096)  # candidates differing in tp, pp or placement share these
def _screen_keys(
    batch: ScreenBatch, shape: tuple[int, int, bool, bool], microbatches: int, buckets: BucketSet
) -> tuple[tuple[int, int, int], ...]:
    """`screen_buckets` of a layout's (llm_dp, encoder_dp, tiles_by_row, audio stages or not)."""
    llm_dp, encoder_dp, by_row, always = shape
    out = []
    split = (np.array_split(a, microbatches) for a in (batch.tokens, batch.tiles, batch.audio))
    for tok, til, aud in zip(*split):
        if not len(tok):
            out.append((buckets.tiles[0], buckets.lengths[0], _audio_bucket(buckets, 0, always)))
            continue
        length = max(tok.sum() / llm_dp, tok.max())
        tiles = max(til.sum() / llm_dp, til.max()) if by_row else til.sum() / encoder_dp
        frames = max(aud.sum() / llm_dp, aud.max())
        out.append((_smallest_at_least(buckets.tiles, math.ceil(tiles - 1e-9)),
                    _smallest_at_least(buckets.lengths, length),
                    _audio_bucket(buckets, frames, always)))  # fmt: skip
    return tuple(out)


def screen_pairs(cand: Candidate, buckets: BucketSet, batch: ScreenBatch) -> BucketSet:
    """`buckets` narrowed to the pairs the screen's typical batch uses and the largest: the screen's
    guess of the sparse pair set, for its compile estimate."""
    pairs = {(t, s) for t, s, _ in screen_buckets(cand, buckets, batch)} | {buckets.top}
    return dataclasses.replace(buckets, pairs=tuple(sorted(pairs)))


def screen_step_time(
    costs: LayoutCosts, cand: Candidate, buckets: BucketSet, batch: ScreenBatch, kind: str
) -> float:
    """Screening score: the typical batch's M microbatches (`screen_buckets`), simulated."""
    keys = screen_buckets(cand, buckets, batch)
    times = np.stack([costs.stage(*k) for k in keys])
    xfer = np.stack([costs.transfer(*k) for k in keys])
    return costs.simulate(times, xfer, kind).step_time


def _smallest_at_least(sizes: tuple[int, ...], need: float) -> int:
    for x in sizes:
        if x >= need:
            return x
    return sizes[-1]


def _audio_bucket(buckets: BucketSet, frames: float, always: bool) -> int:
    """The audio bucket of a row holding `frames` mel frames: 0 without audio, unless the layout's
    audio stages run every microbatch (`always`: `ScheduleProblem.audio_always`); 0 without an
    audio ladder."""
    if not buckets.audio or (frames <= 0 and not always):
        return 0
    return _smallest_at_least(buckets.audio, frames)


@dataclasses.dataclass(frozen=True)
class Score:
    """Simulated step times and idle fractions of a candidate over the K sampled batches, the
    (tile, length) pairs its schedules used and their mean padding."""

    step_times: tuple[float, ...]
    idle_fractions: tuple[float, ...]
    solver: str
    pairs: frozenset = frozenset()
    padding_tokens: float = 0.0
    padding_tiles: float = 0.0

    @property
    def failed(self) -> bool:
        return self.solver.startswith("failed")

    @property
    def mean(self) -> float:
        return float(np.mean(self.step_times))

    @property
    def p90(self) -> float:
        return float(np.percentile(self.step_times, 90))

    @property
    def idle(self) -> float:
        return float(np.mean(self.idle_fractions))


def expected_step_time(
    batches: Sequence[Sequence[SampleShape]],
    costs: LayoutCosts,
    problem: ScheduleProblem,
    scheduler: SchedulePolicy,
    kind: str,
) -> Score:
    """Schedules and simulates each batch; see the module docstring."""
    steps, idles, solvers, pairs, pads = [], [], set(), set(), []
    for batch in batches:
        try:
            sched = scheduler(batch, problem)
        except ValueError as e:  # e.g. a batch the candidate's buckets cannot hold: it fails
            return Score((math.inf,), (1.0,), f"failed: {e}")
        res = simulate_schedule(sched, costs, kind)
        steps.append(res.step_time)
        idles.append(res.idle_fraction)
        solvers.add(sched.solver)
        pairs.update((mb.tile_bucket, mb.length_bucket) for mb in sched.microbatches)
        pads.append((sched.info.get("padding_tokens", 0.0), sched.info.get("padding_tiles", 0.0)))
    tokens, tiles = (float(np.mean(col)) for col in zip(*pads))
    return Score(tuple(steps), tuple(idles), "+".join(sorted(solvers)), frozenset(pairs), tokens,
                 tiles)  # fmt: skip


def used_pairs(
    batches: Sequence[Sequence[SampleShape]], problem: ScheduleProblem, scheduler: SchedulePolicy
) -> BucketSet:
    """The problem's buckets narrowed to the (tile, length) pairs the scheduler uses on `batches`
    (and the largest pair, which holds anything): the sparse set a stage seeing both compiles
    (`BucketSet.pairs`). The grid where a batch cannot be scheduled."""
    b, pairs = problem.buckets, {problem.buckets.top}
    for batch in batches:
        try:
            sched = scheduler(batch, problem)
        except ValueError:
            return b
        pairs.update((mb.tile_bucket, mb.length_bucket) for mb in sched.microbatches)
    return dataclasses.replace(b, pairs=tuple(sorted(pairs)))


def online_scheduler(solver: str, seed: int, time_limit_s: float = 1.0) -> SchedulePolicy:
    """The online scheduler (`schedule_batch`) with a fixed solver and seed."""
    config = SchedulerConfig(solver=solver, time_limit_s=time_limit_s, correction="off", seed=seed)
    return lambda batch, problem: schedule_batch(batch, problem, config)


def sample_batches(
    shapes: Sequence[SampleShape], global_batch: int, k: int, seed: int
) -> list[list[SampleShape]]:
    """K global batches drawn from `shapes` with one generator (reproducible for a seed)."""
    from dflop_jax.scheduler import sample_global_batch

    rng = np.random.default_rng(seed)
    return [sample_global_batch(shapes, global_batch, rng) for _ in range(k)]
