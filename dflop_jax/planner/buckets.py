"""Bucket ladders for a candidate layout: which static shapes its stage programs are compiled for.

A microbatch's per-shard load depends on the layout: with G samples per global batch, M microbatches
and an LLM data-parallel degree l_dp, a packed row holds on average L = G * mean_tokens / (M * l_dp)
tokens, and an encoder shard T = G * mean_tiles / (M * v_dp) tiles, or with tiles packed by row
(`Layout.tiles_by_row`) a row's block T = G * mean_tiles / (M * l_dp). A ladder of n sizes spans
[0.8 L, max(largest sample, 1.5 L)] geometrically: dense near L, where most microbatches land, so
padding stays small. The top is the fixed "max length" a data-blind setup would use too (a one-size
ladder is just the top), so memory checks of both see the same largest shape. A batch that does not
fit M microbatches of the top size gets extra microbatches (the planner's scheduling range is
M .. M x (1 + microbatch_slack)).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts import BucketSet, SampleShape

LOW_FACTOR = 0.8  # smallest bucket relative to the mean per-shard load
HEADROOM = 1.5  # end of the dense part of the ladder, relative to the mean per-shard load


def ladder(mean_load: float, largest_item: float, n: int, align: int) -> tuple[int, ...]:
    """Up to `n` ascending sizes (multiples of `align`); see the module docstring.

    Args:
      mean_load: expected load per shard (tokens or tiles).
      largest_item: the largest single item (a sample's tokens; its tiles per shard).
      n: number of sizes wanted (fewer come back when rounding merges neighbours).
      align: every size is a multiple of this.
    """
    low = _round_up(max(LOW_FACTOR * mean_load, 1), align)
    high = max(low, _round_up(max(largest_item, HEADROOM * mean_load), align))
    if n == 1 or low == high:
        return (high,)
    return tuple(
        sorted({min(_round_up(x, align), high) for x in np.geomspace(low, high, n)} | {high})
    )


def _round_up(x: float, align: int) -> int:
    return int(math.ceil(x / align - 1e-9)) * align


@dataclasses.dataclass(frozen=True)
class ShapeStats:
    """What the ladders need of a shape distribution (computed once per search)."""

    mean_tokens: float
    mean_tiles: float
    max_tokens: int
    max_tiles: int

    @classmethod
    def of(cls, shapes: Sequence[SampleShape]) -> ShapeStats:
        tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
        tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
        return cls(float(tokens.mean()), float(tiles.mean()), int(tokens.max()), int(tiles.max()))


@functools.lru_cache(maxsize=4096)  # the planner's candidates share few (M, dp) combinations
def bucket_set(
    stats: ShapeStats,
    global_batch: int,
    microbatches: int,
    encoder_dp: int,
    llm_dp: int,
    num_buckets: int,
    length_align: int,
    by_row: bool = False,
) -> BucketSet:
    """The tile and length ladders for one (global batch, M, dp) combination; see the module docstring.

    Args:
      stats: the shape distribution's summary (`ShapeStats.of(shapes)`).
      global_batch: samples per global batch G.
      microbatches: M.
      encoder_dp, llm_dp: data-parallel degrees of the two modules.
      num_buckets: sizes per ladder.
      length_align: length buckets are multiples of this.
      by_row: tiles are packed by LLM row (`Layout.tiles_by_row`): tile buckets count a row's tiles
        (its share of the llm_dp rows), and the largest holds the largest sample, not its share of
        encoder_dp shards.
    """
    token_load = global_batch * stats.mean_tokens / (microbatches * llm_dp)
    tile_load = (
        global_batch * stats.mean_tiles / (microbatches * (llm_dp if by_row else encoder_dp))
    )
    lengths = ladder(token_load, stats.max_tokens, num_buckets, length_align)
    largest = stats.max_tiles if by_row else stats.max_tiles / encoder_dp
    tile_sizes = ladder(tile_load, largest, num_buckets, 1)
    return BucketSet(tiles=tile_sizes, lengths=lengths)
