"""What every layer knows of a sample and of the compiled shapes: `SampleShape` and `BucketSet`.

The lowest contract of the project (DESIGN sections 3 and 4): the data layer builds `SampleShape`s from
metadata, the scheduler and planner reason about them, the runtime compiles one program per bucket.
Pure Python; imports nothing from dflop_jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SampleShape:
    """What the scheduler knows of a sample before any pixel is decoded.

    Attributes:
      id: the sample's id in its dataset (opaque to the scheduler).
      tiles: encoder tiles (images tiles + video frames); 0 for text-only.
      tokens: all LLM tokens of the sample (text + image + newline tokens), exactly as the model sees them.
      modality: "text", "image", "multi_image" or "video" (reporting only).
    """

    id: Any
    tiles: int
    tokens: int
    modality: str = "text"


@dataclasses.dataclass(frozen=True)
class BucketSet:
    """The static shapes a stage program is compiled for.

    Attributes:
      tiles: tile buckets T, ascending: tiles per encoder data-parallel shard per microbatch.
      lengths: length buckets S, ascending: tokens of the one packed row per LLM data-parallel shard
        per microbatch.
    """

    tiles: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self):
        for name, values in (("tiles", self.tiles), ("lengths", self.lengths)):
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(
                    f"buckets.{name}={values}: need distinct positive sizes, ascending"
                )
