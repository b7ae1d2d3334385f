"""What the data layer hands on: processed samples, and packed static-shape microbatches (DESIGN section 3).

The packed arrays are the contract between the loader (which fills them), the models' feature placement
(which reads `feature_index`) and the runtime (which shards them over stage meshes).

Index conventions:
  feature_index == TEXT (-1): embed `tokens` at this position.
  feature_index == NEWLINE (-2): the learned image-newline embedding (LLaVA-OV).
  feature_index >= 0: row of the microbatch's flattened projected image features
    [num_tile_slots * tokens_per_tile, D], tile slot s covering rows s*tokens_per_tile ... +tokens_per_tile.

Exact bilinear taps (LLaVA-OV anyres_max_N downscales big images' grid features with torch bilinear
interpolation, which is a weighted sum of 4 feature rows, not a gather; `models/layouts.py` `taps`):
  feature_taps [..., K] int32 follow the same convention per tap; feature_weight [..., K] float32.
  A plain gather is one tap of weight 1 (other taps repeat the index with weight 0); TEXT / NEWLINE
  positions carry TEXT / NEWLINE in every tap, weight 1 on tap 0. `feature_index` stays the heaviest
  tap (nearest neighbour) for consumers that only gather. K = FEATURE_TAPS for the llava_ov family
  (always, so shapes stay static), None for internvl (its features are never interpolated).
Place features with `models.placement.place_features(embeds, features, feature_taps, newline,
feature_weight)` when `feature_taps is not None`, else with `feature_index`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dflop_jax.contracts import SampleShape

TEXT = -1
NEWLINE = -2
FEATURE_TAPS = 4  # bilinear taps per position (2 x 2 source rows)


def plain_taps(source: np.ndarray, k: int = FEATURE_TAPS) -> tuple[np.ndarray, np.ndarray]:
    """A plain gather as K taps: ([n, k] int32 `source` repeated, [n, k] float32 weights (1, 0, ...))."""
    source = np.asarray(source, np.int32)
    weights = np.zeros((source.shape[0], k), np.float32)
    weights[:, 0] = 1.0
    return np.repeat(source[:, None], k, axis=1), weights


@dataclasses.dataclass
class ProcessedSample:
    """One sample after decoding, tiling and tokenization, before packing.

    Attributes:
      id: the sample's id.
      token_ids: [L] int32, the whole LLM sequence; image positions hold the image placeholder id.
      assistant_mask: [L] bool, True on tokens the model must learn to produce (assistant turns).
      feature_source: [L] int32, TEXT / NEWLINE / index into this sample's own image features
        (tile t, feature j -> t * tokens_per_tile + j).
      tiles: [n_tiles, H, W, 3] uint8 pixels (n_tiles may be 0); the encoder normalizes them.
      tile_pool: [n_tiles] bool, True for video frames pooled 2x2 after the projector.
      modality: "text", "image", "multi_image" or "video".
      feature_taps: [L, K] int32 or None; exact sources of each position (module docstring), same
        tile-local indexing as `feature_source`; None when every position is a plain gather (internvl).
      feature_weight: [L, K] float32 or None; weights of `feature_taps` (each row sums to 1).
      audio: the sample's audio windows (`data.audio.AudioWindow`: log-mel features [frames, n_mels]
        and valid frames), clip after clip; () without audio.
      audio_source: [L] int32 or None (no audio): TEXT, or the index of the audio encoder output this
        `<|AUDIO|>` position takes, counting the valid outputs of `audio`'s windows in order.
    """

    id: Any
    token_ids: np.ndarray
    assistant_mask: np.ndarray
    feature_source: np.ndarray
    tiles: np.ndarray
    tile_pool: np.ndarray
    modality: str = "text"
    feature_taps: np.ndarray | None = None
    feature_weight: np.ndarray | None = None
    audio: tuple = ()
    audio_source: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])


@dataclasses.dataclass
class PackedMicrobatch:
    """One microbatch in static shapes, global over data-parallel shards.

    Encoder side (v_dp shards of T tiles; shard e owns rows e*T ... e*T+T-1):
      tiles: [v_dp*T, H, W, 3] uint8 (normalized on device); tile_valid: [v_dp*T] bool; tile_pool: [v_dp*T] bool.
    LLM side (l_dp shards, one packed row of S tokens each):
      tokens: [l_dp, S] int32 input ids (0 on padding).
      segment_ids: [l_dp, S] int32, 1.. per sample within the row, 0 on padding; attention never
        crosses segments.
      positions: [l_dp, S] int32, restarting at 0 for every sample.
      targets: [l_dp, S] int32, the next token of the same sample (labels shifted by one).
      loss_mask: [l_dp, S] float32, 1 where targets[...] is an assistant token of the same sample.
      feature_index: [l_dp, S] int32, see the module docstring (the nearest tap).
      feature_taps: [l_dp, S, K] int32 or None; exact taps with GLOBAL rows like `feature_index`.
      feature_weight: [l_dp, S, K] float32 or None; their weights (named as `place_features` names it).
    Audio side (None without audio; each LLM row's windows packed into that row's own audio row of A
    frames, `ScheduledMicrobatch.audio_bucket`):
      audio: [l_dp, A, M] float32 log-mel frames, the row's samples' windows back to back.
      audio_windows: [l_dp, A] int32, each frame's window (1, 2, ... within the row; 0 on padding).
      audio_valid: [l_dp, A] bool, the windows' valid frames (`models.whisper` packed windows).
      audio_index: [l_dp, S] int32, TEXT or the GLOBAL row of the flattened audio encoder outputs
        [l_dp * A / 4, D] each `<|AUDIO|>` position takes (row r's lie in [r*A/4, (r+1)*A/4)).
    """

    tiles: np.ndarray
    tile_valid: np.ndarray
    tile_pool: np.ndarray
    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    feature_index: np.ndarray
    feature_taps: np.ndarray | None = None
    feature_weight: np.ndarray | None = None
    audio: np.ndarray | None = None
    audio_windows: np.ndarray | None = None
    audio_valid: np.ndarray | None = None
    audio_index: np.ndarray | None = None

    @property
    def tile_bucket_total(self) -> int:
        return int(self.tiles.shape[0])

    @property
    def length_bucket(self) -> int:
        return int(self.tokens.shape[1])


@dataclasses.dataclass(frozen=True)
class PackCounts:
    """What packing computed versus what was real, over the whole global batch (every host reports
    the same throughput and padding; other hosts' shards count as scheduled).

    Attributes:
      tokens_real, tokens_computed: sample tokens, and row slots S per LLM shard row.
      tiles_real, tiles_computed: valid tiles, and the microbatch's tile slots
        (`ScheduledMicrobatch.tile_slots`).
      loss_tokens: positions of this host's shards whose target is an assistant token (this host's
        share of the loss normalizer).
      audio_frames_real, audio_frames_computed: the audio windows' kept frames, and the audio
        frames of the LLM rows (A per row).
    """

    tokens_real: int = 0
    tokens_computed: int = 0
    tiles_real: int = 0
    tiles_computed: int = 0
    loss_tokens: int = 0
    audio_frames_real: int = 0
    audio_frames_computed: int = 0

    def __add__(self, other: PackCounts) -> PackCounts:
        return PackCounts(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )

    @property
    def llm_padding_ratio(self) -> float:
        """DESIGN section 9: 1 - real / computed (0 when nothing is computed)."""
        return _padding(self.tokens_real, self.tokens_computed)

    @property
    def encoder_padding_ratio(self) -> float:
        return _padding(self.tiles_real, self.tiles_computed)

    @property
    def audio_padding_ratio(self) -> float:
        return _padding(self.audio_frames_real, self.audio_frames_computed)


def _padding(real: int, computed: int) -> float:
    return 1.0 - real / computed if computed else 0.0


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """The data layer's report on one global batch (the runtime logs it, tests check it).

    Attributes:
      packed: real / computed counts of the packed microbatches (this host's shards).
      num_microbatches: microbatches in the batch.
      num_samples: samples scheduled (records drawn minus those skipped at metadata time).
      sample_ids: the `SampleShape.id`s the schedule's sample indices refer to.
      skipped: skipped samples by reason (at metadata time and at load time).
      scheduler_latency_s: time in the schedule function.
      load_s: time decoding and tokenizing this host's samples.
      data_wait_s: time the consumer waited in `Loader.__next__` (0 until the loader sets it).
      schedule_digest: fingerprint of the schedule, equal on every process of a run.
    """

    packed: PackCounts = PackCounts()
    num_microbatches: int = 0
    num_samples: int = 0
    sample_ids: tuple[Any, ...] = ()
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    scheduler_latency_s: float = 0.0
    load_s: float = 0.0
    data_wait_s: float = 0.0
    schedule_digest: str = ""

    @property
    def llm_padding_ratio(self) -> float:
        return self.packed.llm_padding_ratio

    @property
    def encoder_padding_ratio(self) -> float:
        return self.packed.encoder_padding_ratio

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


@dataclasses.dataclass
class GlobalBatch:
    """A global batch as the trainer consumes it.

    Attributes:
      microbatches: packed microbatches in execution order.
      num_loss_tokens: loss tokens of the whole global batch (the loss normalizer).
      schedule: the scheduler's `Schedule` (report and buckets); None when every record was skipped.
      stats: the data layer's report (`BatchStats`).
      shapes: the scheduled samples' shapes, indexed like the schedule's sample indices (the same on
        every host: what the global batch holds, whichever rows this host packed).
      placed: per microbatch, per pipeline stage, the stage's side inputs already on its devices
        (set by the `place` hook, `driver.placed_batch`, in the loader's prefetch thread); None: not placed.
    """

    microbatches: list[PackedMicrobatch]
    num_loss_tokens: int
    schedule: Any
    stats: BatchStats = BatchStats()
    shapes: list[SampleShape] = dataclasses.field(default_factory=list)
    placed: list[list[dict]] | None = None
