"""The grain input pipeline: records -> shapes -> scheduled global batch -> processed, packed arrays.

    loader = make_loader(data_cfg, records, problem, scheduler.schedule, global_batch_size=64, seed=0)
    for batch in loader:            # GlobalBatch: packed microbatches + schedule + stats
        ...
    state = loader.get_state()      # exact resume: make_loader(...).set_state(state)
    loader.close()

Pipeline (grain, all `MapDataset` up to prefetching, so the iterator state is an index and resume is exact;
the stages live in `dflop_jax/data/transforms.py`):
  source(records).shuffle(seed).repeat(epochs)      # a new permutation every epoch; a curriculum
                             (a mix with `phases:`, `mix.Phased`) is read in its own order, unshuffled
  .map(shape stage)          per record: `SampleShape` from metadata only (no pixels); a bad record or one
                             larger than the largest bucket becomes a counted skip, never a scheduler input
  .batch(B, batch_fn=list)
  .map_with_index(schedule)  the whole global batch (B records minus skips) goes to the schedule function
                             with its batch index k (so a resumed run re-solves batch k the same way)
  .map(pack stage)           decode/tokenize only the samples this host's shards need (in decode worker
                             processes when `decode_workers` > 0, `data/decode_pool.py`), then pack
                             uint8 tiles (the first encoder stage normalizes them on device)
  .to_iter_dataset(...)      background thread prefetching `prefetch` global batches
  .mp_prefetch(...)          optional worker processes (`num_workers` > 0); a batch crosses from a
                             worker as its arrays (in shared memory: /dev/shm must hold `prefetch`
                             batches per worker) plus a small pickled rest

Skipped records are not replaced: a global batch holds B records minus its skips (`stats.skipped`);
a batch whose records are all bad has no microbatches. A sample that passed metadata but fails to decode
keeps its scheduled room as padding (counted), so every process still agrees on the layout.

The loader owns no scheduler: the caller (the runtime) owns the online `Scheduler` and passes a
`ScheduleFn` `(shapes, batch_index) -> Schedule`. Every process of a multi-host run computes the same
schedule from the same records, seed and scheduler (use the scheduler's deterministic mode);
`stats.schedule_digest` fingerprints it (the runtime compares it across processes every step).
Adaptive correction: the runtime's `Scheduler.observe()` reaches the schedule function only with
`num_workers=0` (grain workers hold copies); decode workers keep the schedule in this process, which is
why they, not grain workers, are the default where decoding is heavy (`DataConfig.decode_workers`).
With prefetch > 0 batch k is solved in the background thread while earlier steps run; the schedule
function decides which observations it sees, deterministically: the runtime's `LaggedSchedule` applies
exactly the observations of steps <= k - prefetch before solving batch k (exact resume, cross-host
agreement), waiting for a step that has not finished.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from dflop_jax.config import ConfigError
from dflop_jax.contracts import SampleShape, ScheduleFn, ScheduleProblem
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.decode_pool import DecodePool, auto_decode_workers
from dflop_jax.data.packing import HostShardSpec, all_shards
from dflop_jax.data.sample_arrays import FEATURE_TAPS, BatchStats, GlobalBatch, ProcessedSample
from dflop_jax.data.transforms import (
    PackSpec,
    PackStage,
    SampleProcessor,
    ScheduleStage,
    ShapeStage,
    WithShapes,
    schedule_digest,
)


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
    pool: DecodePool | None = None,
    num_batches: int | None = None,
) -> grain.MapDataset:
    """The random-access part of the pipeline: element k is global batch k (a `GlobalBatch`).

    `num_batches` ends the dataset after that many global batches (a run's steps: prefetching never
    solves or decodes a batch no step will take).

    `shapes` (optional, in record order, e.g. from `MetadataCache.shapes`) replaces the per-record
    `processor.shape` calls of the metadata stage; bad ones are skipped or raised as usual. `pool`
    decodes the pack stage's samples in worker processes (`DecodePool`; None = in-process).
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size}: must be >= 1")
    if len(records) < global_batch_size:
        raise ValueError(
            f"{len(records)} records < global_batch_size {global_batch_size}: need more data"
        )
    host = host or all_shards(spec.encoder_dp, spec.llm_dp)
    host.check(spec.encoder_dp, spec.llm_dp)
    source = records if shapes is None else WithShapes(records, shapes)
    ds = grain.MapDataset.source(source)
    phase_ends = getattr(records, "phase_ends", None)  # a curriculum (`mix.Phased`): kept in order
    if phase_ends is None:
        ds = ds.shuffle(seed=seed)
    else:
        _check_phases(phase_ends, global_batch_size)
    ds = ds.repeat(num_epochs)
    ds = ds.map(ShapeStage(processor, spec, strict))
    ds = ds.batch(global_batch_size, drop_remainder=True, batch_fn=list)
    if num_batches is not None:
        ds = ds[:num_batches]
    ds = ds.map_with_index(ScheduleStage(schedule_fn))
    return ds.map(PackStage(processor, spec, host, strict, pool))


class TooFewRecords(ConfigError):
    """The data holds fewer usable records than one global batch (key `global_batch`, one line).

    Attributes:
      global_batch: records per global batch asked for.
      usable: records whose shape the loader would keep (metadata only: not bad, not too long).
      records: records in the data given to the loader.
      skipped: the others, by reason.
      held_out: records held out of the data for evaluation (`eval.fraction`), 0 for none.
      fraction: the `eval.fraction` that held them out.
    """

    def __init__(self, global_batch: int, usable: int, records: int, skipped: dict[str, int],
                 held_out: int = 0, fraction: float = 0.0):  # fmt: skip
        self.global_batch, self.usable, self.records = global_batch, usable, records
        self.skipped, self.held_out, self.fraction = dict(skipped), held_out, fraction
        counts = [f"{records} records"]
        if skipped:
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()))
            counts.append(f"{sum(skipped.values())} skipped ({reasons})")
        if held_out:
            counts.append(f"{held_out} more held out by eval.fraction={fraction}")
        fix = f"set global_batch={usable} or fewer, or" if usable else "fix the skipped records or"
        fix += " give more data" + (" (or a smaller eval.fraction)" if held_out else "")
        super().__init__(
            f"global_batch={global_batch}: the data has {usable} usable record(s), fewer than one "
            f"global batch ({'; '.join(counts)}); {fix}"
        )

    def with_held_out(self, held_out: int, fraction: float) -> TooFewRecords:
        """The same error naming the records held out for evaluation too."""
        return TooFewRecords(self.global_batch, self.usable, self.records, self.skipped,
                             held_out, fraction)  # fmt: skip


def check_usable(
    records: Sequence[Any], stage: ShapeStage, global_batch_size: int
) -> tuple[int, dict[str, int]]:
    """(usable records, skips by reason) of `records` under the loader's shape stage, read in dataset
    order until one global batch's worth is usable (metadata only, as the loader reads it). Raises
    `TooFewRecords` when fewer are: a loader of them would train on short or empty global batches."""
    usable, skipped = 0, collections.Counter()
    for i in range(len(records)):
        meta = stage(records[i])
        if meta.shape is None:
            skipped[meta.reason] += 1
            continue
        usable += 1
        if usable >= global_batch_size:
            return usable, dict(skipped)
    raise TooFewRecords(global_batch_size, usable, len(records), dict(skipped))


def _check_phases(phase_ends: Sequence[int], global_batch_size: int) -> None:
    """Every phase of a curriculum fills whole global batches (none mixes two phases)."""
    for k, end in enumerate(phase_ends):
        if end % global_batch_size:
            raise ConfigError(
                f"data mix phases[{k}] ends at record {end}, not a multiple of global_batch "
                f"{global_batch_size}: give every phase a multiple of the global batch"
            )


class Loader:
    """Iterator over `GlobalBatch`es with checkpointable state and running metrics.

    Per batch, `batch.stats` is a `BatchStats` (this loader sets its `data_wait_s`). With a
    `HostShardSpec`, arrays keep their global shapes but only this host's shards are filled in, and
    token and tile counts and `num_loss_tokens` cover this host's shards only: the loss normalizer of
    the global batch is the sum over hosts (the pipeline driver counts it on the last stage's devices).
    """

    # Running totals (a JSON-able dict, checkpointed by `get_state`): BatchStats fields and PackCounts.
    _SUMS = ("scheduler_latency_s", "data_wait_s", "load_s", "num_samples")
    _PACKED = ("tokens_real", "tokens_computed", "tiles_real", "tiles_computed")

    def __init__(
        self,
        dataset: grain.MapDataset,
        *,
        num_workers: int = 0,
        prefetch: int = 2,
        pool: DecodePool | None = None,
        place: Callable[[GlobalBatch], GlobalBatch] | None = None,
    ):
        self._pool = pool  # the pack stage's decode workers, closed with the loader
        if num_workers < 0 or prefetch < 0:
            raise ValueError(f"num_workers={num_workers}, prefetch={prefetch}: must be >= 0")
        # `place` runs where the batch is prepared: the prefetch thread (device arrays cannot leave
        # a worker process, so with workers it runs here, on the consuming thread).
        self._place = place if num_workers or not prefetch else None
        if place is not None and self._place is None:
            dataset = dataset.map(place)
        # A worker process fills its own buffer (`per_worker_buffer_size`): no read thread inside it.
        threads = 1 if prefetch and not num_workers else 0
        it_ds = dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(prefetch, 1))
        )
        self._workers = num_workers
        if num_workers:
            _mark_flags_parsed()
            it_ds = it_ds.map(_arrays_apart).mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=num_workers, per_worker_buffer_size=max(prefetch, 1)
                )
            )
        self._it = iter(it_ds)
        self._totals = self._fresh_totals()

    @staticmethod
    def _fresh_totals() -> dict:
        return {"batches": 0, "skipped": {}, **dict.fromkeys(Loader._SUMS + Loader._PACKED, 0.0)}

    @property
    def iterator(self) -> grain.DatasetIterator:
        """The grain iterator (for `grain.checkpoint.CheckpointSave`); `get_state` adds the loader's totals."""
        return self._it

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> GlobalBatch:
        start = time.perf_counter()
        batch = next(self._it)
        if self._workers:
            batch = _arrays_back(*batch)
        if self._place is not None:
            batch = self._place(batch)
        batch.stats = dataclasses.replace(batch.stats, data_wait_s=time.perf_counter() - start)
        self._accumulate(batch.stats)
        return batch

    def _accumulate(self, stats: BatchStats) -> None:
        t = self._totals
        t["batches"] += 1
        for k in self._SUMS:
            t[k] += getattr(stats, k)
        for k in self._PACKED:
            t[k] += getattr(stats.packed, k)
        for reason, n in stats.skipped.items():
            t["skipped"][reason] = t["skipped"].get(reason, 0) + n

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
        """Stops prefetch threads and worker processes (call before exit when there are workers)."""
        self._it.close()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class _ArraySlot:
    """Where a microbatch array stood: its index in the list that travels beside the batch."""

    index: int


def _arrays_apart(batch: GlobalBatch) -> tuple[GlobalBatch, list[np.ndarray]]:
    """The batch with its microbatch arrays taken out, and those arrays.

    A grain worker hands each leaf ndarray of what it yields to the main process in shared memory and
    pickles the rest through a pipe. A whole `GlobalBatch` is one leaf (grain does not look inside
    dataclasses), so megabytes would go through the pipe: slower, and a worker whose queue feeder is
    still writing one when the loader closes cannot exit until grain kills it 25 s later.
    """
    arrays: list[np.ndarray] = []

    def slot(a: np.ndarray) -> _ArraySlot:
        arrays.append(a)
        return _ArraySlot(len(arrays) - 1)

    mbs = [
        dataclasses.replace(
            mb, **{k: slot(v) for k, v in vars(mb).items() if isinstance(v, np.ndarray)}
        )
        for mb in batch.microbatches
    ]
    return dataclasses.replace(batch, microbatches=mbs), arrays


def _arrays_back(batch: GlobalBatch, arrays: list[np.ndarray]) -> GlobalBatch:
    """Inverse of `_arrays_apart`, each array copied out of its shared-memory block (which grain
    unlinks once the block's array is dropped): the batch holds plain arrays that own their memory,
    and /dev/shm holds only the batches in flight."""
    mbs = [
        dataclasses.replace(
            mb,
            **{
                k: np.array(arrays[v.index])
                for k, v in vars(mb).items()
                if isinstance(v, _ArraySlot)
            },
        )
        for mb in batch.microbatches
    ]
    return dataclasses.replace(batch, microbatches=mbs)


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


def pack_geometry(data_cfg: Any) -> tuple[tuple[int, int, int], int]:
    """((H, W, 3), tokens_per_tile) of the configured encoder: SigLIP 27x27 patches per 384 px tile for
    LLaVA-OV, InternViT (448/14)^2 patches pixel-shuffled 2x2 -> 256 rows (patch size from the config,
    as the model's patch embedding uses it)."""
    px = data_cfg.tile_px
    patches = (px // data_cfg.patch_size) ** 2
    return (px, px, 3), patches if data_cfg.model_family == "llava_ov" else patches // 4


def pack_taps(data_cfg: Any) -> int:
    """Exact feature taps per LLM position: LLaVA-OV interpolates big images' features (4 bilinear taps,
    always packed so shapes stay static); InternVL's placement is a plain gather (0: no tap arrays)."""
    return FEATURE_TAPS if data_cfg.model_family == "llava_ov" else 0


def make_loader(
    data_cfg: Any,
    records: Sequence[Any] | None,
    problem: ScheduleProblem,
    schedule_fn: ScheduleFn,
    *,
    global_batch_size: int,
    seed: int,
    host: HostShardSpec | None = None,
    num_workers: int = 0,
    decode_workers: int | None = None,
    prefetch: int = 2,
    num_epochs: int | None = None,
    processor: SampleProcessor | None = None,
    precompute_shapes: bool = False,
    num_batches: int | None = None,
    place: Callable[[GlobalBatch], GlobalBatch] | None = None,
    vision: bool = True,
) -> Loader:
    """Builds the loader for one run.

    Args:
      data_cfg: `DataConfig` (processing, strict mode, and the source when `records` is None); its
        `max_tokens` is lowered to the largest length bucket, so `too_long="truncate"` cuts to fit.
      records: the dataset's records (a list or any random-access sequence); None = `load_source(data_cfg)`.
      problem: the plan's scheduling problem (dp degrees and buckets).
      schedule_fn: `(shapes, batch_index) -> Schedule`, e.g. the caller's `Scheduler.schedule`.
      global_batch_size: records drawn per global batch (skipped ones are not replaced).
      seed: shuffle seed (epoch e uses seed + e).
      host: this process's shards (`HostShardSpec.from_meshes` of the stage meshes); None = all
        (single process). Samples no local shard needs are never decoded.
      num_workers: grain worker processes running the whole pipeline (0 = a background thread in
        this process). They hold copies of the schedule function, so the trainer's observations do
        not reach them: prefer `decode_workers`.
      decode_workers: processes decoding the samples of each batch while the schedule stays in this
        process (`DecodePool`); None = `data_cfg.decode_workers`, whose -1 picks
        `auto_decode_workers` (workers for image/video data at real tile sizes, 0 otherwise).
      prefetch: global batches prepared ahead.
      num_epochs: None = repeat forever.
      processor: overrides `Processor(data_cfg)` (tests, custom processing).
      precompute_shapes: compute every record's shape up front through `MetadataCache` (on disk under
        `data_cfg.cache_dir`, so a second run, or a run after the data profiler, reads them for free)
        instead of per record in the pipeline; costs one pass over the dataset on the first run.
      num_batches: global batches in all (None = as many as the epochs give).
      place: applied to each packed batch in the prefetch thread (the trainer puts the stages'
        side inputs on their devices there, `GlobalBatch.placed`).
      vision: the model has a vision encoder (else samples with images are counted skips).
    """
    from dflop_jax.data.dataset import load_source

    if records is None:
        records = load_source(data_cfg, seed)
    data_cfg = capped(data_cfg, problem)
    if precompute_shapes and processor is not None:
        raise ValueError(
            "precompute_shapes uses Processor(data_cfg); it cannot be combined with `processor`"
        )
    processor = processor or LazyProcessor(data_cfg)
    shapes = None
    if precompute_shapes:
        from dflop_jax.data.metadata import MetadataCache
        from dflop_jax.data.process import Processor

        shapes = MetadataCache(data_cfg.cache_dir, Processor(data_cfg)).shapes(records)
    spec = pack_spec(data_cfg, problem, vision)
    workers = resolve_decode_workers(data_cfg, records, decode_workers, num_workers)
    pool = DecodePool(processor, workers) if workers else None
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
        pool=pool,
        num_batches=num_batches,
    )
    return Loader(ds, num_workers=num_workers, prefetch=prefetch, pool=pool, place=place)


def capped(data_cfg: Any, problem: ScheduleProblem) -> Any:
    """`data_cfg` whose `max_tokens` is at most the largest length bucket: the processor truncates to
    it ("truncate") or skips longer samples as too_long ("skip"), before any scheduler sees them."""
    cap = problem.buckets.lengths[-1]
    if data_cfg.max_tokens > cap:
        return dataclasses.replace(data_cfg, max_tokens=cap)
    return data_cfg


def pack_spec(data_cfg: Any, problem: ScheduleProblem, vision: bool = True) -> PackSpec:
    """The static shapes the loader packs `problem`'s microbatches into, for `data_cfg`'s encoder
    (`vision` False: a model without one)."""
    tile_shape, tokens_per_tile = pack_geometry(data_cfg)
    return PackSpec.from_problem(problem, tile_shape, tokens_per_tile, pack_taps(data_cfg),
                                 data_cfg.audio_mels, vision)  # fmt: skip


def check_records(
    data_cfg: Any,
    records: Sequence[Any],
    problem: ScheduleProblem,
    global_batch_size: int,
    vision: bool = True,
) -> int:
    """How many of `records` the loader of `make_loader(data_cfg, records, problem, ...)` would
    keep, counted until one global batch's worth (`check_usable`); raises `TooFewRecords` (a
    one-line ConfigError on `global_batch`) when fewer than `global_batch_size` are usable."""
    data_cfg = capped(data_cfg, problem)
    spec = pack_spec(data_cfg, problem, vision)
    stage = ShapeStage(LazyProcessor(data_cfg), spec, False, quiet=True)
    return check_usable(records, stage, global_batch_size)[0]


def resolve_decode_workers(
    data_cfg: Any, records: Sequence[Any], decode_workers: int | None, num_workers: int
) -> int:
    """Decode worker processes for this run: the argument, else the config's, else (-1) automatic.

    Automatic looks at the first records for images or videos; with grain workers (`num_workers`)
    the pool is off (it cannot be pickled into them)."""
    if num_workers:
        if decode_workers:
            raise ValueError(
                f"num_workers={num_workers} and decode_workers={decode_workers}: pick one kind of "
                "worker (decode workers keep the schedule in this process)"
            )
        return 0
    n = data_cfg.decode_workers if decode_workers is None else decode_workers
    if n >= 0:
        return n
    head = (records[i] for i in range(min(len(records), 64)))
    has_media = any(
        isinstance(r, dict) and any(k in r for k in ("image", "video", "audio")) for r in head
    )
    return auto_decode_workers(data_cfg.tile_px, has_media)


__all__ = [
    "LazyProcessor",
    "Loader",
    "PackSpec",
    "SampleProcessor",
    "TooFewRecords",
    "build_dataset",
    "capped",
    "check_records",
    "check_usable",
    "make_loader",
    "pack_geometry",
    "pack_spec",
    "pack_taps",
    "resolve_decode_workers",
    "schedule_digest",
]
