"""Packing processed samples into the static-shape arrays of a schedule (DESIGN section 3).

`pack_global_batch(schedule, samples, shapes, ...)` turns the scheduler's answer for one global batch into
`PackedMicrobatch`es: encoder tiles placed in the slots `ScheduledMicrobatch.tile_placement()` gives (packed
by row, row r's samples' tiles in row r's own block of slots), and one packed LLM row per LLM shard (segment ids, positions
restarting per sample, next-token targets of the same sample, assistant-only loss mask, and the indices
that place image features into the row).

Multi-host: with a `HostShardSpec`, only the host's own shards are filled in. The arrays keep their GLOBAL
shapes (encoder `ScheduledMicrobatch.tile_slots` rows, LLM `llm_dp` rows), so a process places them on a stage mesh that
spans hosts exactly as a single process would (each process writes only the shards its devices hold);
other hosts' rows stay zero and cost no memory (untouched pages of `np.zeros`). `feature_index` holds
global tile-slot rows (slot * tokens_per_tile + j); packed by row, row r's lie in its own block, which
the first LLM stage takes modulo the block (`models.mllm.LLMStage.embed`).
Samples a host does not need may be `None` in `samples`; their slots are computed from `shapes`, so every
host agrees on the placement. `HostShardSpec.from_meshes` gives a process its shards from the stage
meshes.

Exact feature taps: with `feature_taps=K` (4 for LLaVA-OV, `sample_arrays.FEATURE_TAPS`) the microbatch also
holds `feature_taps` [rows, S, K] (every tap mapped to global tile-slot rows exactly like `feature_index`)
and `feature_weight` [rows, S, K]; samples without taps count as plain gathers. `feature_index` stays the
nearest tap. Memory: `feature_taps` quadruples `feature_index`'s 4 bytes per position and `feature_weight`
adds as much again: 32 bytes per position on top of the 24 of the six [S] arrays (S = 32k: 1 MiB per LLM
row), negligible next to the tiles (one 384 px uint8 tile is 432 KiB; a 37-tile image 16 MiB). Tiles stay
uint8 up to the device: the first encoder stage normalizes them (`models.vit.normalize_pixels`), so
they cross host -> device at a quarter of float32's bytes.

Audio (`audio_mels=M` and a microbatch's `audio_bucket` A > 0): each LLM row's samples' audio windows
go to that row's own audio row of A frames, back to back in sample order (each window its kept frames,
`SampleShape.audio_frames`), numbered within the row (`audio_windows`) with their valid frames marked
(`audio_valid`): the audio encoder runs the row as `models.whisper`'s packed windows, whose outputs
sit at frame / 4. `audio_index` maps each `<|AUDIO|>` position to its global output row r*A/4 + j.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts import SampleShape, Schedule, ScheduledMicrobatch
from dflop_jax.data.audio import encoder_outputs
from dflop_jax.data.sample_arrays import (
    TEXT,
    BatchStats,
    GlobalBatch,
    PackCounts,
    PackedMicrobatch,
    ProcessedSample,
    plain_taps,
)


@dataclasses.dataclass(frozen=True)
class HostShardSpec:
    """Which data-parallel shards this process feeds.

    Attributes:
      encoder_shards: encoder data-parallel shard ids owned by this process, ascending.
      llm_shards: LLM data-parallel shard ids owned by this process, ascending.
    """

    encoder_shards: tuple[int, ...]
    llm_shards: tuple[int, ...]

    def __post_init__(self):
        for name, ids in (("encoder_shards", self.encoder_shards), ("llm_shards", self.llm_shards)):
            if list(ids) != sorted(set(ids)) or (ids and ids[0] < 0):
                raise ValueError(
                    f"HostShardSpec.{name}={ids}: need distinct shard ids >= 0, ascending"
                )

    @classmethod
    def contiguous(
        cls, process_index: int, process_count: int, encoder_dp: int, llm_dp: int
    ) -> HostShardSpec:
        """Process p owns a contiguous 1/process_count share of each side's shards.

        A side with fewer shards than processes (dp < process_count) gives shard s to process
        s * process_count // dp (the process holding the shard's first device in a contiguous layout).
        """
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index}: need 0 <= index < {process_count}")

        def share(dp: int) -> tuple[int, ...]:
            return tuple(s for s in range(dp) if s * process_count // dp == process_index)

        return cls(share(encoder_dp), share(llm_dp))

    @classmethod
    def from_meshes(
        cls,
        encoder_grids: Sequence[np.ndarray],
        llm_grids: Sequence[np.ndarray],
        process_index: int,
    ) -> HostShardSpec:
        """The shards whose rows some stage of this process holds: shard r of a module is local when a
        device of row r of one of its stage meshes (grids [dp, tp] of devices, `Mesh.devices`) belongs
        to `process_index`."""

        def local(grids) -> tuple[int, ...]:
            rows = {r for g in grids for r, row in enumerate(g) if
                    any(d.process_index == process_index for d in row)}  # fmt: skip
            return tuple(sorted(rows))

        return cls(local(encoder_grids), local(llm_grids))

    def check(self, encoder_dp: int, llm_dp: int) -> None:
        if self.encoder_shards and self.encoder_shards[-1] >= encoder_dp:
            raise ValueError(
                f"HostShardSpec.encoder_shards={self.encoder_shards}: encoder_dp={encoder_dp}"
            )
        if self.llm_shards and self.llm_shards[-1] >= llm_dp:
            raise ValueError(f"HostShardSpec.llm_shards={self.llm_shards}: llm_dp={llm_dp}")


def all_shards(encoder_dp: int, llm_dp: int) -> HostShardSpec:
    """The single-process spec: every shard is local."""
    return HostShardSpec(tuple(range(encoder_dp)), tuple(range(llm_dp)))


def needed_samples(
    plan: ScheduledMicrobatch, shapes: Sequence[SampleShape], encoder_dp: int, host: HostShardSpec
) -> set[int]:
    """Indices of the samples whose tiles or tokens land on this host's shards in microbatch `plan`."""
    out = {i for r in host.llm_shards for i in plan.shards[r]}
    per_shard = plan.tile_slots(encoder_dp) // encoder_dp
    mine = set(host.encoder_shards)
    out.update(i for (i, _), slot in plan.tile_placement(shapes, encoder_dp).items()
               if slot // per_shard in mine)  # fmt: skip
    return out


def pack_microbatch(
    plan: ScheduledMicrobatch,
    samples: Sequence[ProcessedSample | None],
    shapes: Sequence[SampleShape] | None = None,
    *,
    encoder_dp: int,
    llm_dp: int,
    tile_shape: tuple[int, int, int],
    tokens_per_tile: int,
    host: HostShardSpec | None = None,
    feature_taps: int = 0,
    audio_mels: int = 0,
) -> tuple[PackedMicrobatch, dict]:
    """Packs one microbatch of the global batch.

    Args:
      plan: the microbatch's buckets and per-LLM-shard sample indices.
      samples: the global batch's processed samples (indexed like `shapes`); None for samples this host
        does not need or that failed to load (their tiles and tokens stay padding).
      shapes: the metadata the schedule was built from; defaults to the samples' own sizes.
      encoder_dp, llm_dp: data-parallel degrees of the encoder and the LLM.
      tile_shape: (H, W, 3) of one encoder tile.
      tokens_per_tile: feature rows per tile slot in the flattened feature array.
      host: the shards this process materialises (default: all).
      feature_taps: K > 0 fills `feature_taps` / `feature_weight` [rows, S, K] (exact interpolated
        features); 0 leaves them None (then no sample may need more than a gather).
      audio_mels: mel bins of the audio features; with the microbatch's `audio_bucket` > 0 the
        audio arrays are filled (module docstring).

    Returns:
      (PackedMicrobatch, PackCounts) counted over the materialised (local) shards.
    """
    if shapes is None:
        shapes = [_shape_of(s) for s in samples]
    host = host or all_shards(encoder_dp, llm_dp)
    host.check(encoder_dp, llm_dp)
    if feature_taps < 0:
        raise ValueError(f"feature_taps={feature_taps}: need 0 (plain gather) or K >= 1 taps")
    if len(plan.shards) != llm_dp:
        raise ValueError(f"microbatch has {len(plan.shards)} LLM shards, llm_dp={llm_dp}")
    S = plan.length_bucket
    slot_of = plan.tile_placement(shapes, encoder_dp)
    slots = plan.tile_slots(encoder_dp)
    per_shard, mine = slots // encoder_dp, set(host.encoder_shards)

    tiles = np.zeros((slots, *tile_shape), np.uint8)
    tile_valid = np.zeros((slots,), bool)
    tile_pool = np.zeros((slots,), bool)
    for (i, t), row in slot_of.items():
        sample = samples[i]
        if sample is None or row // per_shard not in mine:
            continue
        tiles[row] = _uint8_tiles(sample)[t]
        tile_valid[row] = True
        tile_pool[row] = sample.tile_pool[t]

    fields = ("tokens", "segment_ids", "positions", "targets", "loss_mask", "feature_index")
    if feature_taps:
        fields += ("feature_taps", "feature_weight")
    arrays = {f: _empty_rows(f, llm_dp, S, feature_taps) for f in fields}
    A = plan.audio_bucket
    if A:
        arrays.update(_empty_audio(llm_dp, A, S, audio_mels))
    for r in host.llm_shards:
        row = _pack_row(plan.shards[r], samples, shapes, S, slot_of, tokens_per_tile, feature_taps)
        if A:
            audio = _pack_audio_row(plan.shards[r], samples, shapes, row, A, audio_mels, r * A // 4)
            row.update(audio)
        for f in arrays:
            arrays[f][r] = row[f]
    mb = PackedMicrobatch(tiles=tiles, tile_valid=tile_valid, tile_pool=tile_pool, **arrays)
    # Throughput and padding describe the global batch on every host: other hosts' shards are counted
    # as scheduled (their samples' sizes), this host's as packed (a failed sample is padding).
    remote_tokens = sum(shapes[i].tokens for r, shard in enumerate(plan.shards)
                        if r not in host.llm_shards for i in shard)  # fmt: skip
    remote_tiles = sum(1 for row in slot_of.values() if row // per_shard not in mine)
    counts = PackCounts(
        tokens_real=int((mb.segment_ids > 0).sum()) + remote_tokens,
        tokens_computed=llm_dp * S,
        tiles_real=int(tile_valid.sum()) + remote_tiles,
        tiles_computed=slots,
        loss_tokens=int(mb.loss_mask.sum()),
        audio_frames_real=sum(shapes[i].audio_frames for i in plan.samples()) if A else 0,
        audio_frames_computed=llm_dp * A,
    )
    return mb, counts


def _shape_of(sample: ProcessedSample | None) -> SampleShape:
    if sample is None:
        raise ValueError("pack_microbatch: pass `shapes` when some samples are None")
    windows = tuple(w.valid_frames for w in sample.audio)
    return SampleShape(sample.id, sample.num_tiles, sample.num_tokens, sample.modality, windows)


def _uint8_tiles(sample: ProcessedSample) -> np.ndarray:
    """The sample's tiles, refused unless uint8 (a float tile would be cast silently and wrongly)."""
    if sample.tiles.dtype != np.uint8:
        raise TypeError(
            f"sample {sample.id!r}: tiles are {sample.tiles.dtype}, the packer takes uint8 pixels "
            "(the encoder normalizes them on device)"
        )
    return sample.tiles


def _empty_rows(field: str, rows: int, S: int, k: int) -> np.ndarray:
    """Zero rows of one LLM field (other hosts' rows stay so: never read, never touched)."""
    shape = (rows, S, k) if field in ("feature_taps", "feature_weight") else (rows, S)
    return np.zeros(shape, np.float32 if field in ("loss_mask", "feature_weight") else np.int32)


def _pack_row(
    indices: Sequence[int],
    samples: Sequence[ProcessedSample | None],
    shapes: Sequence[SampleShape],
    S: int,
    slot_of: dict[tuple[int, int], int],
    tokens_per_tile: int,
    k: int,
) -> dict[str, np.ndarray]:
    """One LLM shard's packed row [S] (taps [S, k] when k > 0): samples back to back, then padding."""
    row = {
        "tokens": np.zeros(S, np.int32),
        "segment_ids": np.zeros(S, np.int32),
        "positions": np.zeros(S, np.int32),
        "targets": np.zeros(S, np.int32),
        "loss_mask": np.zeros(S, np.float32),
        "feature_index": np.full(S, TEXT, np.int32),
    }
    if k:
        row["feature_taps"], row["feature_weight"] = plain_taps(row["feature_index"], k)
    need = sum(shapes[i].tokens for i in indices)
    if need > S:
        raise ValueError(
            f"LLM shard holds {need} tokens > length bucket {S} (samples {list(indices)})"
        )
    offset = 0
    for segment, i in enumerate(indices, start=1):
        sample = samples[i]
        if sample is None:
            # A sample that failed to load keeps its scheduled room as padding.
            offset += shapes[i].tokens
            continue
        _check_sample(sample, shapes[i], i, k)
        L = sample.num_tokens
        span = slice(offset, offset + L)
        row["tokens"][span] = sample.token_ids
        row["segment_ids"][span] = segment
        row["positions"][span] = np.arange(L)
        # Next token of the same sample; the sample's last token has no target.
        row["targets"][offset : offset + L - 1] = sample.token_ids[1:]
        row["loss_mask"][offset : offset + L - 1] = sample.assistant_mask[1:]
        slots = np.array([slot_of[(i, t)] for t in range(sample.num_tiles)], np.int64)
        row["feature_index"][span] = _global_features(sample.feature_source, slots, tokens_per_tile)
        if k:
            taps, weights = _sample_taps(sample, k)
            row["feature_taps"][span] = _global_features(taps, slots, tokens_per_tile)
            row["feature_weight"][span] = weights
        offset += L
    return row


def _empty_audio(rows: int, A: int, S: int, mels: int) -> dict[str, np.ndarray]:
    """Zero audio rows (other hosts' rows stay so)."""
    if mels < 1:
        raise ValueError(f"a microbatch with audio_bucket={A} needs audio_mels >= 1 (PackSpec)")
    return {
        "audio": np.zeros((rows, A, mels), np.float32),
        "audio_windows": np.zeros((rows, A), np.int32),
        "audio_valid": np.zeros((rows, A), bool),
        "audio_index": np.full((rows, S), TEXT, np.int32),
    }


def _pack_audio_row(indices, samples, shapes, tokens_row, A: int, mels: int, first_output: int):
    """One LLM row's audio row: its samples' windows back to back (a sample that failed to load
    keeps its room as padding), and `audio_index` over the row's tokens (`tokens_row`, just packed:
    its segments give each sample's token span)."""
    need = sum(shapes[i].audio_frames for i in indices)
    if need > A:
        raise ValueError(
            f"LLM row holds {need} audio frames > audio bucket {A} (samples {list(indices)})"
        )
    row = _empty_audio(1, A, len(tokens_row["tokens"]), mels)
    row = {k: v[0] for k, v in row.items()}
    frame, window = 0, 1
    for segment, i in enumerate(indices, start=1):
        sample = samples[i]
        if sample is None:
            frame += shapes[i].audio_frames
            continue
        if tuple(w.valid_frames for w in sample.audio) != shapes[i].audio_windows:
            raise ValueError(
                f"sample {i} ({sample.id!r}): processed audio windows of "
                f"{[w.valid_frames for w in sample.audio]} valid frames, metadata said "
                f"{list(shapes[i].audio_windows)}"
            )
        outputs = []  # the global encoder output row of each of the sample's valid outputs
        for w in sample.audio:
            kept = w.features.shape[0]
            row["audio"][frame : frame + kept] = w.features
            row["audio_windows"][frame : frame + kept] = window
            row["audio_valid"][frame : frame + w.valid_frames] = True
            outputs.append(first_output + frame // 4 + np.arange(encoder_outputs(w.valid_frames)))
            frame, window = frame + kept, window + 1
        if sample.audio_source is not None:
            span = np.flatnonzero(tokens_row["segment_ids"] == segment)
            heard = sample.audio_source >= 0
            row["audio_index"][span[heard]] = np.concatenate(outputs)[sample.audio_source[heard]]
    return row


def _check_sample(sample: ProcessedSample, shape: SampleShape, i: int, k: int) -> None:
    if sample.num_tokens != shape.tokens or sample.num_tiles != shape.tiles:
        raise ValueError(
            f"sample {i} ({sample.id!r}): processed {sample.num_tiles} tiles/{sample.num_tokens} tokens, "
            f"metadata said {shape.tiles}/{shape.tokens}"
        )
    if sample.feature_taps is None:
        return
    want = (sample.num_tokens, sample.feature_taps.shape[-1])
    if sample.feature_taps.shape != want or sample.feature_weight.shape != want:
        raise ValueError(
            f"sample {i} ({sample.id!r}): feature_taps {sample.feature_taps.shape} / feature_weight "
            f"{sample.feature_weight.shape}, expected {want}"
        )
    if k == 0 and not (sample.feature_weight[:, 0] == 1.0).all():
        # Packing only the nearest tap would silently train on features the reference never sees.
        raise ValueError(
            f"sample {i} ({sample.id!r}) has interpolated features: pack with feature_taps="
            f"{want[1]} (PackSpec.feature_taps) to keep them exact"
        )
    if k and want[1] > k:
        raise ValueError(f"sample {i} ({sample.id!r}): {want[1]} feature taps > feature_taps={k}")


def _sample_taps(sample: ProcessedSample, k: int) -> tuple[np.ndarray, np.ndarray]:
    """([L, k] tile-local taps, [L, k] weights); a sample without taps (or fewer) is padded with zero-weight
    repeats of its first tap."""
    if sample.feature_taps is None:
        return plain_taps(sample.feature_source, k)
    taps, weights = sample.feature_taps, sample.feature_weight
    extra = k - taps.shape[1]
    if extra:
        taps = np.concatenate([taps, np.repeat(taps[:, :1], extra, axis=1)], axis=1)
        weights = np.concatenate([weights, np.zeros((len(weights), extra), np.float32)], axis=1)
    return taps, weights


def _global_features(source: np.ndarray, slots: np.ndarray, tokens_per_tile: int) -> np.ndarray:
    """Maps a sample's tile-local feature ids t*tpt+j to global rows slots[t]*tpt+j; TEXT/NEWLINE stay.

    Args:
      source: [L] the sample's `feature_source`, or [L, K] its `feature_taps`.
      slots: [n_tiles] the microbatch tile slot each of the sample's tiles landed in.
    """
    source = np.asarray(source, np.int64)
    image = source >= 0
    if not image.any():
        return source.astype(np.int32)
    t, j = np.divmod(source[image], tokens_per_tile)
    if t.max() >= len(slots):
        raise ValueError(f"feature_source names tile {t.max()} of a sample with {len(slots)} tiles")
    out = source.copy()
    out[image] = slots[t] * tokens_per_tile + j
    return out.astype(np.int32)


def pack_global_batch(
    schedule: Schedule,
    samples: Sequence[ProcessedSample | None],
    shapes: Sequence[SampleShape] | None = None,
    *,
    encoder_dp: int,
    llm_dp: int,
    tile_shape: tuple[int, int, int],
    tokens_per_tile: int,
    host: HostShardSpec | None = None,
    feature_taps: int = 0,
    audio_mels: int = 0,
) -> GlobalBatch:
    """Packs every microbatch of `schedule`; see `pack_microbatch` for the arguments.

    `num_loss_tokens` counts the materialised shards (the whole global batch in a single-process run,
    this host's shards with a `HostShardSpec`); the token and tile stats count the global batch.
    """
    microbatches, totals = [], PackCounts()
    for plan in schedule.microbatches:
        mb, counts = pack_microbatch(
            plan,
            samples,
            shapes,
            encoder_dp=encoder_dp,
            llm_dp=llm_dp,
            tile_shape=tile_shape,
            tokens_per_tile=tokens_per_tile,
            host=host,
            feature_taps=feature_taps,
            audio_mels=audio_mels,
        )
        microbatches.append(mb)
        totals += counts
    stats = BatchStats(packed=totals, num_microbatches=len(microbatches))
    shapes = list(shapes) if shapes is not None else [_shape_of(s) for s in samples]
    return GlobalBatch(microbatches, totals.loss_tokens, schedule, stats, shapes)
