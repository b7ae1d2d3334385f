"""Pipeline layouts: which layers each stage holds and on how many devices (tp x dp).

A layout is encoder stages first, then LLM stages (DESIGN section 5). Pure Python: the planner, the
scheduler, the simulator and the runtime all speak it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Module = Literal["encoder", "llm"]


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: a contiguous layer range of one module on a (dp x tp) submesh.

    Attributes:
      module: "encoder" (ViT) or "llm" (decoder).
      first_layer: index of the first transformer layer held.
      num_layers: number of transformer layers held (may be 0 for an embedding-only stage).
      tp: tensor-parallel degree (devices per replica, within a host).
      dp: data-parallel degree (replicas).
      has_embedding: encoder: patch + position embedding; llm: token embedding + image-feature placement.
      has_head: encoder: post-norm + projector; llm: final norm + LM head + loss.
    """

    module: Module
    first_layer: int
    num_layers: int
    tp: int = 1
    dp: int = 1
    has_embedding: bool = False
    has_head: bool = False

    def __post_init__(self):
        if self.module not in ("encoder", "llm"):
            raise ValueError(f"module={self.module!r}: must be 'encoder' or 'llm'")
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
    """A whole pipeline: encoder stages then LLM stages, each on its own disjoint devices."""

    encoder_stages: tuple[StageSpec, ...]
    llm_stages: tuple[StageSpec, ...]

    def __post_init__(self):
        if not self.llm_stages:
            raise ValueError("a layout needs at least one LLM stage")
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
        return self.encoder_stages + self.llm_stages

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_devices(self) -> int:
        return sum(s.num_devices for s in self.stages)

    @property
    def encoder_dp(self) -> int:
        return self.encoder_stages[0].dp if self.encoder_stages else self.llm_dp

    @property
    def llm_dp(self) -> int:
        return self.llm_stages[0].dp
