"""Pipeline layouts: which layers each stage holds and on how many devices (tp x dp).

A layout is encoder stages first, then (a model with an audio encoder on stages of its own) audio
stages, then LLM stages (DESIGN section 5): a chain, or two encoder branches that both feed the first
LLM stage (`Layout.children`). Pure Python: the planner, the scheduler, the simulator and the
runtime all speak it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

from dflop_jax.contracts.batch_schedule import row_tile_slots
from dflop_jax.contracts.pipeline_order import parents

Module = Literal["encoder", "audio", "llm"]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: a contiguous layer range of one module on a (dp x tp) submesh.

    Attributes:
      module: "encoder" (ViT), "audio" (the audio encoder: Whisper-style) or "llm" (decoder).
      first_layer: index of the first transformer layer held.
      num_layers: number of transformer layers held (may be 0 for an embedding-only stage).
      tp: tensor-parallel degree (devices per replica, within a host).
      dp: data-parallel degree (replicas).
      has_embedding: encoder: patch + position embedding; audio: the convolutions + positions;
        llm: token embedding + feature placement.
      has_head: encoder: post-norm + projector; audio: pool, norm + projector; llm: final norm +
        LM head + loss.
    """

    module: Module
    first_layer: int
    num_layers: int
    tp: int = 1
    dp: int = 1
    has_embedding: bool = False
    has_head: bool = False

    def __post_init__(self):
        if self.module not in ("encoder", "audio", "llm"):
            raise ValueError(f"module={self.module!r}: must be 'encoder', 'audio' or 'llm'")
        if self.first_layer < 0 or self.num_layers < 0:
            raise ValueError(
                f"layers [{self.first_layer}, +{self.num_layers}): must be non-negative"
            )
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp={self.tp}, dp={self.dp}: both must be >= 1")

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A whole pipeline: encoder stages, audio stages, then LLM stages, each on its own disjoint
    devices.

    With no encoder stages the encoder runs colocated on LLM stage 0's devices, at that stage's tp or,
    with `colocated_encoder_tp`, at its own (a divisor of stage 0's tp): each tp group of stage 0 then
    holds tp / colocated_encoder_tp encoder replicas, each on its own share of the tiles. Audio
    stages (a model with an audio encoder; none: it runs on LLM stage 0) form a second branch: the
    last encoder stage and the last audio stage both feed LLM stage 0 (`children`). Their dp
    divides the LLM's: each audio replica encodes whole LLM rows' audio.

    An encoder on stages of its own takes a microbatch's tiles either packed by LLM row (each row's
    tiles in its own block: the first LLM stage receives each row only its features, and the
    encoder computes llm_dp blocks of the fullest row's size) or, with `pooled_tiles`, as one pool
    split evenly over its shards (the encoder computes the microbatch's tiles rounded up to its
    bucket; the first LLM stage gathers the whole pool onto every device). The planner prices both.
    """

    encoder_stages: tuple[StageSpec, ...]
    llm_stages: tuple[StageSpec, ...]
    colocated_encoder_tp: int | None = None
    audio_stages: tuple[StageSpec, ...] = ()
    pooled_tiles: bool = False

    def __post_init__(self):
        if not self.llm_stages:
            raise ValueError("a layout needs at least one LLM stage")
        for s in self.audio_stages:
            if s.module != "audio":
                raise ValueError(f"audio_stages holds a {s.module} stage")
        if self.audio_stages and self.llm_dp % self.audio_stages[0].dp:
            raise ValueError(
                f"audio dp {self.audio_stages[0].dp} must divide the LLM's dp {self.llm_dp} (each "
                "audio replica encodes whole LLM rows)"
            )
        if len({s.dp for s in self.audio_stages}) > 1:
            raise ValueError("all stages of one module must share one dp degree")
        cet = self.colocated_encoder_tp
        if cet is not None and (self.encoder_stages or cet < 1 or self.llm_stages[0].tp % cet):
            raise ValueError(
                f"colocated_encoder_tp={cet}: needs a colocated encoder (no encoder stages) and a "
                f"divisor of LLM stage 0's tp {self.llm_stages[0].tp}"
            )
        if self.pooled_tiles and (not self.encoder_stages or self.audio_stages):
            raise ValueError(
                "pooled_tiles: needs an encoder on stages of its own and no audio stages (a "
                "colocated encoder encodes each row's tiles on the row's shard; a stage joining the "
                "audio branch takes its vision features by row)"
            )
        for s in self.encoder_stages:
            if s.module != "encoder":
                raise ValueError(f"encoder_stages holds a {s.module} stage")
        for s in self.llm_stages:
            if s.module != "llm":
                raise ValueError(f"llm_stages holds a {s.module} stage")
        for group in (self.encoder_stages, self.llm_stages):
            if len({s.dp for s in group}) > 1:
                raise ValueError("all stages of one module must share one dp degree")

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return self.encoder_stages + self.audio_stages + self.llm_stages

    @property
    def first_llm(self) -> int:
        """The index of LLM stage 0 in `stages`."""
        return len(self.encoder_stages) + len(self.audio_stages)

    @functools.cached_property  # the planner's cost functions ask per boundary and bucket
    def children(self) -> tuple[int, ...]:
        """Per stage, the stage its output feeds (-1 for the last): the next stage of its module,
        or, for the last encoder and the last audio stage, LLM stage 0
        (`contracts.pipeline_order.depths`)."""
        first, out = self.first_llm, []
        for group_end in (len(self.encoder_stages), first):
            start = len(out)
            out += [i + 1 for i in range(start, group_end - 1)] + [first] * (group_end > start)
        out += list(range(first + 1, self.num_stages)) + [-1]
        return tuple(out)

    def parents(self, stage: int) -> tuple[int, ...]:
        """The stages whose outputs `stage` takes, ascending (none for a branch's first stage)."""
        return parents(self.children, stage)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return sum(s.num_devices for s in self.stages)

    @property
    def encoder_dp(self) -> int:
        """Encoder replicas (a microbatch's tiles are split over them)."""
        if self.encoder_stages:
            return self.encoder_stages[0].dp
        return self.llm_dp * self.llm_stages[0].tp // self.encoder_tp

    @property
    def encoder_tp(self) -> int:
        """The encoder's tp: its first stage's, or colocated, its own or LLM stage 0's."""
        if self.encoder_stages:
            return self.encoder_stages[0].tp
        return self.colocated_encoder_tp or self.llm_stages[0].tp

    @property
    def llm_dp(self) -> int:
        return self.llm_stages[0].dp

    @property
    def tiles_by_row(self) -> bool:
        """Whether microbatches pack each LLM row's tiles in the row's own block of tile slots
        (`ScheduledMicrobatch.tiles_by_row`, tile buckets per row): every layout the runtime runs, an
        encoder on its own stages (the first LLM stage then receives each row only its own
        samples' features) or colocated at LLM stage 0's tp and dp (each shard encodes its own
        row's tiles). Not an encoder with `pooled_tiles`, nor one colocated at its own tp
        (`colocated_encoder_tp`, which the planner alone models): their tiles are split over the
        encoder's replicas as one pool."""
        return self.colocated_encoder_tp is None and not self.pooled_tiles

    @property
    def row_align(self) -> int:
        """A row's block of tile slots is a multiple of this: the first LLM stage's tp, over whose
        devices each row's features arrive split (1 colocated: the features never leave the shard)."""
        return self.llm_stages[0].tp if self.encoder_stages else 1

    def encoder_tiles(self, tile_bucket: int) -> int:
        """Tiles per encoder shard of a microbatch at `tile_bucket`: the bucket itself, or packed by
        row, llm_dp row blocks (`row_tile_slots`) split over the encoder's shards."""
        if not self.tiles_by_row:
            return tile_bucket
        row = row_tile_slots(tile_bucket, self.encoder_dp, self.llm_dp, self.row_align)
        return self.llm_dp * row // self.encoder_dp

    @property
    def audio_rows(self) -> int:
        """LLM rows whose audio one audio encoder shard encodes: an audio stage's replica llm_dp /
        dp whole rows, back to back; on LLM stage 0 each shard its own row."""
        return self.llm_dp // self.audio_stages[0].dp if self.audio_stages else 1

    def audio_frames(self, audio_bucket: int) -> int:
        """Mel frames per audio encoder shard of a microbatch at `audio_bucket` (frames per LLM
        row): `audio_rows` rows of it."""
        return self.audio_rows * audio_bucket
