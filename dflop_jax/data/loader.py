"""The grain input pipeline: records -> shapes -> scheduled global batch -> processed, packed arrays.

    loader = make_loader(data_cfg, records, problem, scheduler_cfg, global_batch_size=64, seed=0)
    for batch in loader:            # GlobalBatch: packed microbatches + schedule + stats
        ...
    state = loader.get_state()      # exact resume: make_loader(...).set_state(state)
    loader.close()

Pipeline (grain, all `MapDataset` up to prefetching, so the iterator state is an index and resume is exact):
  source(records).shuffle(seed).repeat(epochs)      # a new permutation every epoch
  .map(shape stage)          per record: `SampleShape` from metadata only (no pixels); a bad record or one
                             larger than the largest bucket becomes a counted skip, never a scheduler input
  .batch(B, batch_fn=list)
  .map_with_index(schedule)  the whole global batch (B records minus skips) goes to the scheduler, with
                             the batch index k as its seed (so a resumed run re-solves batch k the same way)
  .map(pack stage)           decode/tokenize only the samples this host's shards need, then pack
  .to_iter_dataset(...)      background thread prefetching `prefetch` global batches
  .mp_prefetch(...)          optional worker processes (`num_workers` > 0)

Skipped records are not replaced: a global batch holds B records minus its skips (`stats["skipped"]`);
a batch whose records are all bad has no microbatches. A sample that passed metadata but fails to decode
keeps its scheduled room as padding (counted), so every process still agrees on the layout.

Every process of a multi-host run computes the same schedule from the same records, seed and scheduler
(use the scheduler's deterministic mode); `stats["schedule_digest"]` lets the runtime compare.
Adaptive correction: the runtime's `Scheduler.observe()` reaches the schedule function only with
`num_workers=0` (workers hold copies). With prefetch > 0, batch k is solved in a background thread at a
time that depends on timing, so which observations it sees is not deterministic: for exact resume and
cross-host agreement with correction on, use `prefetch=0` (batch k is scheduled inside the k-th
`next()`, after the observations of step k-1), or correction "off".
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grain

from dflop_jax.data.errors import BadSample
from dflop_jax.data.packing import HostShardSpec, all_shards, needed_samples, pack_global_batch
from dflop_jax.data.types import GlobalBatch, ProcessedSample
from dflop_jax.scheduler.types import SampleShape, Schedule, ScheduleProblem

log = logging.getLogger(__name__)

# (shapes of one global batch, global batch index) -> Schedule. The index seeds any randomness in the
# solver, so a resumed run schedules batch k exactly as the uninterrupted run did.
ScheduleFn = Callable[[list[SampleShape], int], Schedule]


class SampleProcessor(Protocol):
    """What the loader needs of data processing (`dflop_jax.data.Processor` fits)."""

    def shape(self, record: Any) -> SampleShape: ...

    def process(self, record: Any) -> ProcessedSample: ...


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """The static shapes packing fills.

    Attributes:
      encoder_dp, llm_dp: data-parallel degrees (from the plan).
      tile_shape: (H, W, 3) of one encoder tile.
      tokens_per_tile: feature rows per tile slot (729 SigLIP-384, 256 InternViT after pixel shuffle).
      max_tiles: most tiles one sample may have (encoder_dp x largest tile bucket).
      max_tokens: most LLM tokens one sample may have (largest length bucket).
    """

    encoder_dp: int
    llm_dp: int
    tile_shape: tuple[int, int, int]
    tokens_per_tile: int
    max_tiles: int
    max_tokens: int

    @classmethod
    def from_problem(cls, problem: ScheduleProblem, tile_shape, tokens_per_tile: int) -> PackSpec:
        return cls(
            problem.encoder_dp,
            problem.llm_dp,
            tuple(tile_shape),
            tokens_per_tile,
            problem.encoder_dp * problem.buckets.tiles[-1],
            problem.buckets.lengths[-1],
        )


def _location(record: Any) -> str:
    return (
        str(record["_location"])
        if isinstance(record, dict) and "_location" in record
        else repr(record)[:80]
    )


class _SkipLog:
    """Logs each (reason, location) once per stage object (per process), then stays quiet."""

    def __init__(self):
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, stage: str, reason: str, location: str, detail: str = "") -> None:
        if (reason, location) not in self._seen:
            self._seen.add((reason, location))
            log.warning(
                "skipping sample at %s (%s, %s)%s",
                location,
                stage,
                reason,
                f": {detail}" if detail else "",
            )


@dataclasses.dataclass
class _Meta:
    """A record after the shape stage: its shape, or why it is skipped."""

    record: Any
    shape: SampleShape | None
    reason: str = ""


class _ShapeStage:
    """record -> _Meta; bad records and samples larger than the largest bucket are marked as skips."""

    def __init__(self, processor: SampleProcessor, spec: PackSpec, strict: bool):
        self.processor, self.spec, self.strict = processor, spec, strict
        self._log = _SkipLog()

    def __call__(self, item: Any) -> _Meta:
        record = item.record if isinstance(item, _Known) else item
        try:
            shape = self._shape(item)
            if shape.tokens > self.spec.max_tokens or shape.tiles > self.spec.max_tiles:
                raise BadSample(
                    "too_long",
                    _location(record),
                    f"{shape.tiles} tiles/{shape.tokens} tokens > largest buckets "
                    f"{self.spec.max_tiles}/{self.spec.max_tokens}",
                )
        except BadSample as e:
            if self.strict:
                raise
            self._log("metadata", e.reason, e.location, e.detail)
            return _Meta(record, None, e.reason)
        return _Meta(record, shape)

    def _shape(self, item: Any) -> SampleShape:
        if not isinstance(item, _Known):
            return self.processor.shape(item)
        if isinstance(item.shape, BadSample):
            raise item.shape
        return item.shape


@dataclasses.dataclass(frozen=True)
class _Known:
    """A record with its precomputed shape (or the BadSample computing it raised)."""

    record: Any
    shape: SampleShape | BadSample


class _WithShapes(Sequence):
    """records[i] paired with shapes[i], as a random-access source (nothing copied)."""

    def __init__(self, records: Sequence[Any], shapes: Sequence[SampleShape | BadSample]):
        if len(records) != len(shapes):
            raise ValueError(f"{len(records)} records but {len(shapes)} precomputed shapes")
        self.records, self.shapes = records, shapes

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        return _Known(self.records[i], self.shapes[i])


@dataclasses.dataclass
class _Scheduled:
    """A global batch after scheduling: the good records, their shapes, the schedule and the skip counts."""

    records: list
    shapes: list[SampleShape]
    schedule: Schedule | None
    skipped: dict[str, int]
    scheduler_latency_s: float


class _ScheduleStage:
    """(global batch index, the batch's records) -> one schedule for the whole batch (the scheduler's hook).

    It runs right after `.batch()` (as `map_with_index`, not as `batch_fn`, because the solver's seed
    comes from the batch index).
    """

    def __init__(self, schedule_fn: ScheduleFn):
        self.schedule_fn = schedule_fn

    def __call__(self, index: int, metas: Sequence[_Meta]) -> _Scheduled:
        good = [m for m in metas if m.shape is not None]
        skipped = dict(collections.Counter(m.reason for m in metas if m.shape is None))
        shapes = [m.shape for m in good]
        start = time.perf_counter()
        try:
            schedule = self.schedule_fn(shapes, index) if shapes else None
        except ValueError as e:  # e.g. the batch exceeds every allowed microbatch count's capacity
            raise ValueError(f"global batch {index} ({len(shapes)} samples): {e}") from None
        latency = time.perf_counter() - start
        return _Scheduled([m.record for m in good], shapes, schedule, skipped, latency)


class _PackStage:
    """_Scheduled -> GlobalBatch: process the samples this host needs, then pack."""

    def __init__(
        self, processor: SampleProcessor, spec: PackSpec, host: HostShardSpec, strict: bool
    ):
        self.processor, self.spec, self.host, self.strict = processor, spec, host, strict
        self._log = _SkipLog()

    def __call__(self, item: _Scheduled) -> GlobalBatch:
        skipped = collections.Counter(item.skipped)
        spec = self.spec
        if item.schedule is None:
            return GlobalBatch([], 0, None, self._stats(item, skipped, {}, 0.0))
        need: set[int] = set()
        for plan in item.schedule.microbatches:
            need |= needed_samples(plan, item.shapes, spec.encoder_dp, self.host)
        start = time.perf_counter()
        samples: list[ProcessedSample | None] = [None] * len(item.records)
        for i in sorted(need):
            samples[i] = self._load(item.records[i], item.shapes[i], skipped)
        load_s = time.perf_counter() - start
        batch = pack_global_batch(
            item.schedule,
            samples,
            item.shapes,
            encoder_dp=spec.encoder_dp,
            llm_dp=spec.llm_dp,
            tile_shape=spec.tile_shape,
            tokens_per_tile=spec.tokens_per_tile,
            host=self.host,
        )
        batch.stats = self._stats(item, skipped, batch.stats, load_s)
        return batch

    def _load(
        self, record: Any, shape: SampleShape, skipped: collections.Counter
    ) -> ProcessedSample | None:
        """Processes one sample; a failure after scheduling leaves its room as padding (counted)."""
        try:
            sample = self.processor.process(record)
        except BadSample as e:
            if self.strict:
                raise
            self._log("load", e.reason, e.location, e.detail)
            skipped[e.reason] += 1
            return None
        problem = self._mismatch(sample, shape)
        if problem:
            # The schedule reserved room for the metadata's sizes; another size cannot be packed.
            if self.strict:
                raise ValueError(f"{_location(record)}: {problem}")
            self._log("load", "metadata_mismatch", _location(record), problem)
            skipped["metadata_mismatch"] += 1
            return None
        return sample

    def _mismatch(self, sample: ProcessedSample, shape: SampleShape) -> str:
        if sample.num_tokens != shape.tokens or sample.num_tiles != shape.tiles:
            return (
                f"processed {sample.num_tiles} tiles/{sample.num_tokens} tokens, metadata said "
                f"{shape.tiles}/{shape.tokens}"
            )
        if sample.num_tiles and tuple(sample.tiles.shape[1:]) != self.spec.tile_shape:
            return f"tiles of shape {sample.tiles.shape[1:]}, expected {self.spec.tile_shape}"
        return ""

    def _stats(self, item: _Scheduled, skipped, packed: dict, load_s: float) -> dict:
        stats = dict(packed)
        stats.update(
            num_samples=len(item.shapes),
            sample_ids=[shape.id for shape in item.shapes],
            skipped=dict(skipped),
            scheduler_latency_s=item.scheduler_latency_s,
            load_s=load_s,
            schedule_digest=schedule_digest(item.schedule),
        )
        return stats


def schedule_digest(schedule: Schedule | None) -> str:
    """A short hash of the schedule's buckets and assignment: equal on every process of a run."""
    if schedule is None:
        return ""
    text = repr([(p.tile_bucket, p.length_bucket, p.shards) for p in schedule.microbatches])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def build_dataset(
    records: Sequence[Any],
    processor: SampleProcessor,
    schedule_fn: ScheduleFn,
    spec: PackSpec,
    *,
    global_batch_size: int,
    seed: int,
    host: HostShardSpec | None = None,
    strict: bool = False,
    num_epochs: int | None = None,
    shapes: Sequence[SampleShape | BadSample] | None = None,
) -> grain.MapDataset:
    """The random-access part of the pipeline: element k is global batch k (a `GlobalBatch`).

    `shapes` (optional, in record order, e.g. from `MetadataCache.shapes`) replaces the per-record
    `processor.shape` calls of the metadata stage; bad ones are skipped or raised as usual.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size}: must be >= 1")
    if len(records) < global_batch_size:
        raise ValueError(
            f"{len(records)} records < global_batch_size {global_batch_size}: need more data"
        )
    host = host or all_shards(spec.encoder_dp, spec.llm_dp)
    host.check(spec.encoder_dp, spec.llm_dp)
    source = records if shapes is None else _WithShapes(records, shapes)
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(num_epochs)
    ds = ds.map(_ShapeStage(processor, spec, strict))
    ds = ds.batch(global_batch_size, drop_remainder=True, batch_fn=list)
    ds = ds.map_with_index(_ScheduleStage(schedule_fn))
    return ds.map(_PackStage(processor, spec, host, strict))


class Loader:
    """Iterator over `GlobalBatch`es with checkpointable state and running metrics.

    Per batch, `batch.stats` holds: scheduler_latency_s (time in the scheduler hook), data_wait_s (time
    the consumer waited in `__next__`), load_s, skipped (counts by reason in this batch), padding ratios
    (llm_padding_ratio, encoder_padding_ratio), token/tile counts, schedule_digest, and sample_ids (the
    `SampleShape.id`s the schedule's sample indices refer to). With a `HostShardSpec`, arrays, token
    and tile counts and `num_loss_tokens` cover this host's shards only: the loss normalizer of the
    global batch is the sum over hosts.

    Attributes:
      scheduler: the online `Scheduler` when `make_loader` built it (the runtime feeds it measured stage
        times and checkpoints its `state_dict()` next to `get_state()`), else None.
    """

    _SUMS = (
        "scheduler_latency_s",
        "data_wait_s",
        "load_s",
        "tokens_real",
        "tokens_computed",
        "tiles_real",
    )
    _SUMS += ("tiles_computed", "num_samples")

    def __init__(
        self,
        dataset: grain.MapDataset,
        *,
        num_workers: int = 0,
        prefetch: int = 2,
        scheduler: Any = None,
    ):
        self.scheduler = (
            scheduler  # the online Scheduler when make_loader built it (runtime observes it)
        )
        if num_workers < 0 or prefetch < 0:
            raise ValueError(f"num_workers={num_workers}, prefetch={prefetch}: must be >= 0")
        it_ds = dataset.to_iter_dataset(
            grain.ReadOptions(
                num_threads=1 if prefetch else 0, prefetch_buffer_size=max(prefetch, 1)
            )
        )
        if num_workers:
            _mark_flags_parsed()
            it_ds = it_ds.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=num_workers, per_worker_buffer_size=max(prefetch, 1)
                )
            )
        self._it = iter(it_ds)
        self._totals = self._fresh_totals()

    @staticmethod
    def _fresh_totals() -> dict:
        return {"batches": 0, "skipped": {}, **dict.fromkeys(Loader._SUMS, 0.0)}

    @property
    def iterator(self) -> grain.DatasetIterator:
        """The grain iterator (for `grain.checkpoint.CheckpointSave`); `get_state` adds the loader's totals."""
        return self._it

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> GlobalBatch:
        start = time.perf_counter()
        batch = next(self._it)
        batch.stats["data_wait_s"] = time.perf_counter() - start
        self._accumulate(batch.stats)
        return batch

    def _accumulate(self, stats: dict) -> None:
        t = self._totals
        t["batches"] += 1
        for k in self._SUMS:
            t[k] += stats.get(k, 0)  # noqa: SIM910 - an empty batch has no packing counts
        for reason, n in stats["skipped"].items():
            t["skipped"][reason] = t["skipped"].get(reason, 0) + n  # noqa: SIM910 - counting

    def stats(self) -> dict:
        """Totals since the start of the run (kept across `set_state`): batches, skipped by reason, mean
        scheduler latency and data wait per batch, padding ratios over all batches served."""
        t = self._totals
        n = max(t["batches"], 1)
        return {
            "batches": t["batches"],
            "samples": int(t["num_samples"]),
            "skipped": dict(t["skipped"]),
            "scheduler_latency_s_mean": t["scheduler_latency_s"] / n,
            "data_wait_s_mean": t["data_wait_s"] / n,
            "load_s_mean": t["load_s"] / n,
            "llm_padding_ratio": 1 - t["tokens_real"] / t["tokens_computed"]
            if t["tokens_computed"]
            else 0.0,
            "encoder_padding_ratio": 1 - t["tiles_real"] / t["tiles_computed"]
            if t["tiles_computed"]
            else 0.0,
        }

    def get_state(self) -> dict:
        """{"iterator": grain iterator state, "totals": running counters}: both restore exactly."""
        totals = dict(self._totals, skipped=dict(self._totals["skipped"]))
        return {"iterator": self._it.get_state(), "totals": totals}

    def set_state(self, state: dict) -> None:
        self._it.set_state(state["iterator"])
        self._totals = dict(state["totals"], skipped=dict(state["totals"]["skipped"]))

    def close(self) -> None:
        """Stops prefetch threads and worker processes (call before exit when num_workers > 0)."""
        self._it.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _mark_flags_parsed() -> None:
    """grain workers read absl flags; outside `absl.app.run` they must be marked parsed (DESIGN 11)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class LazyProcessor:
    """`Processor(data_cfg)` built on first use in each process; pickles as its config only.

    Grain worker processes receive the pipeline by pickling; a built Processor holds a tokenizer and a
    compiled chat template, which need not (and do not all) survive pickling.
    """

    def __init__(self, data_cfg: Any):
        self.data_cfg = data_cfg
        self._processor = None

    def _get(self) -> SampleProcessor:
        if self._processor is None:
            from dflop_jax.data.process import Processor

            self._processor = Processor(self.data_cfg)
        return self._processor

    def shape(self, record: Any) -> SampleShape:
        return self._get().shape(record)

    def process(self, record: Any) -> ProcessedSample:
        return self._get().process(record)

    def __getstate__(self) -> dict:
        return {"data_cfg": self.data_cfg, "_processor": None}


class SchedulerHook:
    """Adapts the online `Scheduler` to `ScheduleFn`: batch k is solved with seed `scheduler.seed + k`.

    The runtime keeps the `Scheduler` (it feeds `observe()` and checkpoints `state_dict()`); with
    `num_workers=0` corrections reach the schedules of batches not yet prefetched.
    """

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    def __call__(self, shapes: list[SampleShape], index: int) -> Schedule:
        # The Scheduler seeds its solver with seed + steps; set steps from the batch index so the
        # schedule does not depend on how many batches were prefetched or on a resume.
        self.scheduler.steps = index
        return self.scheduler.schedule(shapes)


def pack_geometry(data_cfg: Any) -> tuple[tuple[int, int, int], int]:
    """((H, W, 3), tokens_per_tile) of the configured encoder: SigLIP 27x27 patches per 384 px tile for
    LLaVA-OV, InternViT (448/14)^2 patches pixel-shuffled 2x2 -> 256 rows."""
    px = data_cfg.tile_px
    patches = (px // 14) ** 2
    return (px, px, 3), patches if data_cfg.model_family == "llava_ov" else patches // 4


def make_loader(
    data_cfg: Any,
    records: Sequence[Any] | None,
    problem: ScheduleProblem,
    scheduler_config: Any = None,
    *,
    global_batch_size: int,
    seed: int,
    host: HostShardSpec | None = None,
    num_workers: int = 0,
    prefetch: int = 2,
    num_epochs: int | None = None,
    processor: SampleProcessor | None = None,
    schedule_fn: ScheduleFn | None = None,
    precompute_shapes: bool = False,
) -> Loader:
    """Builds the loader for one run.

    Args:
      data_cfg: `DataConfig` (processing, strict mode, and the source when `records` is None); its
        `max_tokens` is lowered to the largest length bucket, so `too_long="truncate"` cuts to fit.
      records: the dataset's records (a list or any random-access sequence); None = `load_source(data_cfg)`.
      problem: the plan's scheduling problem (dp degrees and buckets).
      scheduler_config: `SchedulerConfig` of the online `Scheduler` built here (see `Loader.scheduler`);
        unused when `schedule_fn` is given.
      global_batch_size: records drawn per global batch (skipped ones are not replaced).
      seed: shuffle seed (epoch e uses seed + e) and the scheduler's seed.
      host: this process's shards; None = all (single process).
      num_workers: grain worker processes (0 = a background thread in this process).
      prefetch: global batches prepared ahead.
      num_epochs: None = repeat forever.
      processor: overrides `Processor(data_cfg)` (tests, custom processing).
      schedule_fn: overrides the scheduler (`(shapes, batch_index) -> Schedule`).
      precompute_shapes: compute every record's shape up front through `MetadataCache` (on disk under
        `data_cfg.cache_dir`, so a second run, or a run after the data profiler, reads them for free)
        instead of per record in the pipeline; costs one pass over the dataset on the first run.
    """
    from dflop_jax.data.sources import load_source
    from dflop_jax.scheduler.correction import Scheduler

    if records is None:
        records = load_source(data_cfg, seed)
    # The largest length bucket caps a sample: the processor truncates to it ("truncate") or skips
    # longer samples as too_long ("skip"), before any scheduler sees them.
    cap = problem.buckets.lengths[-1]
    if data_cfg.max_tokens > cap:
        data_cfg = dataclasses.replace(data_cfg, max_tokens=cap)
    if precompute_shapes and processor is not None:
        raise ValueError(
            "precompute_shapes uses Processor(data_cfg); it cannot be combined with `processor`"
        )
    processor = processor or LazyProcessor(data_cfg)
    scheduler = None
    if schedule_fn is None:
        scheduler = Scheduler(problem, scheduler_config, seed=seed)
        schedule_fn = SchedulerHook(scheduler)
    shapes = None
    if precompute_shapes:
        from dflop_jax.data.metadata import MetadataCache
        from dflop_jax.data.process import Processor

        shapes = MetadataCache(data_cfg.cache_dir, Processor(data_cfg)).shapes(list(records))
    tile_shape, tokens_per_tile = pack_geometry(data_cfg)
    spec = PackSpec.from_problem(problem, tile_shape, tokens_per_tile)
    ds = build_dataset(
        records,
        processor,
        schedule_fn,
        spec,
        global_batch_size=global_batch_size,
        seed=seed,
        host=host,
        strict=data_cfg.strict,
        num_epochs=num_epochs,
        shapes=shapes,
    )
    return Loader(ds, num_workers=num_workers, prefetch=prefetch, scheduler=scheduler)


__all__ = [
    "LazyProcessor",
    "Loader",
    "PackSpec",
    "SampleProcessor",
    "SchedulerHook",
    "build_dataset",
    "make_loader",
    "pack_geometry",
    "schedule_digest",
]
