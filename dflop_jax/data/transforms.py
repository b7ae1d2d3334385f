"""The grain loader's per-element stages: shapes from metadata, the schedule function, load-and-pack.

Each stage is a picklable callable (grain worker processes receive them by pickling); `loader.py`
chains them into the pipeline. See `dflop_jax.data.loader` for the whole picture.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dflop_jax.contracts import (
    SampleShape,
    Schedule,
    ScheduleFn,
    ScheduleProblem,
    schedule_digest,
)
from dflop_jax.data.bad_sample import BadSample
from dflop_jax.data.packing import HostShardSpec, needed_samples, pack_global_batch
from dflop_jax.data.sample_arrays import BatchStats, GlobalBatch, ProcessedSample

if TYPE_CHECKING:
    from dflop_jax.data.decode_pool import DecodePool

log = logging.getLogger(__name__)


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
      max_tiles: most tiles one sample may have (the largest tile bucket, times encoder_dp unless
        tiles are packed by row).
      max_tokens: most LLM tokens one sample may have (largest length bucket).
      feature_taps: K exact feature taps per position (`sample_arrays.FEATURE_TAPS` for LLaVA-OV, whose
        interpolated features are not a gather), 0 for none (InternVL); see `packing`.
      audio_mels: mel bins of the model's audio encoder, 0 when it has none: then a sample with
        audio is a counted skip ("no_audio_encoder"), never trained on as placeholder tokens.
      vision: the model has a vision encoder; without one a sample with images or video is a
        counted skip ("no_vision_encoder"), never trained on as placeholder tokens.
      max_audio_frames: most audio frames one sample may have (the largest audio bucket); more is
        a counted "too_long" skip.
    """

    encoder_dp: int
    llm_dp: int
    tile_shape: tuple[int, int, int]
    tokens_per_tile: int
    max_tiles: int
    max_tokens: int
    feature_taps: int = 0
    audio_mels: int = 0
    max_audio_frames: int = 0
    vision: bool = True

    @classmethod
    def from_problem(
        cls,
        problem: ScheduleProblem,
        tile_shape,
        tokens_per_tile: int,
        feature_taps: int = 0,
        audio_mels: int = 0,
        vision: bool = True,
    ) -> PackSpec:
        """The shapes of `problem`'s microbatches; `audio_mels` is read only when its buckets
        have audio (a plan for a model with an audio encoder), else the spec takes no audio;
        `vision` False: the model encodes no image."""
        audio = problem.buckets.audio
        return cls(
            problem.encoder_dp,
            problem.llm_dp,
            tuple(tile_shape),
            tokens_per_tile,
            problem.buckets.tiles[-1] * (1 if problem.tiles_by_row else problem.encoder_dp),
            problem.buckets.lengths[-1],
            feature_taps,
            audio_mels if audio else 0,
            audio[-1] if audio else 0,
            vision,
        )


def record_location(record: Any) -> str:
    """Where a record came from (its `_location`: file:line, shard:row), else its id, else how it
    starts."""
    if isinstance(record, dict):
        for key in ("_location", "id"):
            if key in record:
                return str(record[key])
    return repr(record)[:80]


class SkipLog:
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


def _quiet(*args) -> None:
    """A `SkipLog` that logs nothing."""


@dataclasses.dataclass
class Meta:
    """A record after the shape stage: its shape, or why it is skipped."""

    record: Any
    shape: SampleShape | None
    reason: str = ""


class ShapeStage:
    """record -> Meta; bad records and samples larger than the largest bucket are marked as skips
    (logged once each unless `quiet`)."""

    def __init__(
        self, processor: SampleProcessor, spec: PackSpec, strict: bool, quiet: bool = False
    ):
        self.processor, self.spec, self.strict = processor, spec, strict
        self._log = _quiet if quiet else SkipLog()

    def __call__(self, item: Any) -> Meta:
        record = item.record if isinstance(item, Known) else item
        try:
            shape = self._shape(item)
            if shape.audio_windows and not self.spec.audio_mels:
                raise BadSample(
                    "no_audio_encoder",
                    record_location(record),
                    f"{shape.audio_seconds:.1f} s of audio, but the model has no audio encoder",
                )
            if shape.tiles and not self.spec.vision:
                raise BadSample(
                    "no_vision_encoder",
                    record_location(record),
                    f"{shape.tiles} image tiles, but the model has no vision encoder",
                )
            if shape.tokens > self.spec.max_tokens or shape.tiles > self.spec.max_tiles:
                raise BadSample(
                    "too_long",
                    record_location(record),
                    f"{shape.tiles} tiles/{shape.tokens} tokens > largest buckets "
                    f"{self.spec.max_tiles}/{self.spec.max_tokens}",
                )
            if shape.audio_frames > self.spec.max_audio_frames and self.spec.audio_mels:
                raise BadSample(
                    "too_long",
                    record_location(record),
                    f"{shape.audio_frames} audio frames > largest audio bucket "
                    f"{self.spec.max_audio_frames}",
                )
        except BadSample as e:
            if self.strict:
                raise
            self._log("metadata", e.reason, e.location, e.detail)
            return Meta(record, None, e.reason)
        return Meta(record, shape)

    def _shape(self, item: Any) -> SampleShape:
        if not isinstance(item, Known):
            return self.processor.shape(item)
        if isinstance(item.shape, BadSample):
            raise item.shape
        return item.shape


@dataclasses.dataclass(frozen=True)
class Known:
    """A record with its precomputed shape (or the BadSample computing it raised)."""

    record: Any
    shape: SampleShape | BadSample


class WithShapes(Sequence):
    """records[i] paired with shapes[i], as a random-access source (nothing copied)."""

    def __init__(self, records: Sequence[Any], shapes: Sequence[SampleShape | BadSample]):
        if len(records) != len(shapes):
            raise ValueError(f"{len(records)} records but {len(shapes)} precomputed shapes")
        self.records, self.shapes = records, shapes

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        return Known(self.records[i], self.shapes[i])


@dataclasses.dataclass
class Scheduled:
    """A global batch after scheduling: the good records, their shapes, the schedule and the skip counts."""

    records: list
    shapes: list[SampleShape]
    schedule: Schedule | None
    skipped: dict[str, int]
    scheduler_latency_s: float


class ScheduleStage:
    """(global batch index, the batch's records) -> one schedule for the whole batch (the `ScheduleFn`).

    It runs right after `.batch()` (as `map_with_index`, not as `batch_fn`, because the solver's seed
    comes from the batch index).
    """

    def __init__(self, schedule_fn: ScheduleFn):
        self.schedule_fn = schedule_fn

    def __call__(self, index: int, metas: Sequence[Meta]) -> Scheduled:
        good = [m for m in metas if m.shape is not None]
        skipped = dict(collections.Counter(m.reason for m in metas if m.shape is None))
        shapes = [m.shape for m in good]
        start = time.perf_counter()
        try:
            schedule = self.schedule_fn(shapes, index) if shapes else None
        except ValueError as e:  # e.g. the batch exceeds every allowed microbatch count's capacity
            raise ValueError(f"global batch {index} ({len(shapes)} samples): {e}") from None
        # A schedule function may first wait for the observations it must see (the runtime's
        # `LaggedSchedule` says how long): that is not the solver's latency.
        waited = schedule.info.get("observation_wait_s", 0.0) if schedule is not None else 0.0
        latency = time.perf_counter() - start - waited
        return Scheduled([m.record for m in good], shapes, schedule, skipped, latency)


class PackStage:
    """Scheduled -> GlobalBatch: process the samples this host needs, then pack."""

    def __init__(
        self,
        processor: SampleProcessor,
        spec: PackSpec,
        host: HostShardSpec,
        strict: bool,
        pool: DecodePool | None = None,
    ):
        self.processor, self.spec, self.host, self.strict = processor, spec, host, strict
        self.pool = pool  # decode worker processes (None = decode in this process)
        self._log = SkipLog()

    def __call__(self, item: Scheduled) -> GlobalBatch:
        skipped = collections.Counter(item.skipped)
        spec = self.spec
        if item.schedule is None:
            return GlobalBatch([], 0, None, self._stats(item, skipped, BatchStats(), 0.0))
        need: set[int] = set()
        for plan in item.schedule.microbatches:
            need |= needed_samples(plan, item.shapes, spec.encoder_dp, self.host)
        start = time.perf_counter()
        samples: list[ProcessedSample | None] = [None] * len(item.records)
        order = sorted(need)
        for i, decode in zip(order, self._decoders([item.records[i] for i in order])):
            samples[i] = self._load(item.records[i], item.shapes[i], skipped, decode)
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
            feature_taps=spec.feature_taps,
            audio_mels=spec.audio_mels,
        )
        batch.stats = self._stats(item, skipped, batch.stats, load_s)
        return batch

    def _decoders(self, records: list) -> list[Callable[[], ProcessedSample]]:
        """Per record, a call returning its sample: in-process, or the pool's result (all submitted
        up front, so the workers decode in parallel while the first results are packed)."""
        if self.pool is None:
            return [functools.partial(self.processor.process, r) for r in records]
        return [future.result for future in self.pool.decode(records)]

    def _load(
        self,
        record: Any,
        shape: SampleShape,
        skipped: collections.Counter,
        decode: Callable[[], ProcessedSample],
    ) -> ProcessedSample | None:
        """Processes one sample; a failure after scheduling leaves its room as padding (counted)."""
        try:
            sample = decode()
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
                raise ValueError(f"{record_location(record)}: {problem}")
            self._log("load", "metadata_mismatch", record_location(record), problem)
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
        taps = sample.feature_taps
        if taps is not None and (taps.ndim != 2 or taps.shape[1] > self.spec.feature_taps):
            return f"feature_taps of shape {taps.shape}, expected [L, <= {self.spec.feature_taps}]"
        return ""

    def _stats(self, item: Scheduled, skipped, packed: BatchStats, load_s: float) -> BatchStats:
        return dataclasses.replace(
            packed,
            num_samples=len(item.shapes),
            sample_ids=tuple(shape.id for shape in item.shapes),
            skipped=dict(skipped),
            scheduler_latency_s=item.scheduler_latency_s,
            load_s=load_s,
            schedule_digest=schedule_digest(item.schedule),
        )
