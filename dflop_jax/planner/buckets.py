"""Bucket ladders for a candidate layout: which static shapes its stage programs are compiled for.

A microbatch's per-shard load depends on the layout: with G samples per global batch, M microbatches
and an LLM data-parallel degree l_dp, a packed row holds on average L = G * mean_tokens / (M * l_dp)
tokens, and an encoder shard T = G * mean_tiles / (M * v_dp) tiles, or with tiles packed by row
(`Layout.tiles_by_row`) a row's block T = G * mean_tiles / (M * l_dp). A ladder of n sizes ends at
max(largest sample, 1.5 L): the fixed "max length" a data-blind setup would use too (a one-size
ladder is just the top), so memory checks of both see the same largest shape. A batch that does not
fit M microbatches of the top size gets extra microbatches (the planner's scheduling range is
M .. M x (1 + microbatch_slack)).

Below the top, lengths and pooled tiles span [0.8 L, top] geometrically: dense near L, where a
microbatch's load lands (rows are filled up to the length bucket; a pool of tiles sums many
samples). Tiles packed by row are different: a microbatch's tile bucket is set by its FULLEST row,
and a row holds few samples (G / (M * l_dp)), so the fullest of l_dp rows sits well above the mean
row and the mean-based ladder's lower sizes are rarely usable (on the demo's data 27 of 34
microbatches padded to the top). Their sizes are the ones that minimize the padding of the fullest
row over microbatches drawn from the data (`fullest_rows`: samples drawn, split over the rows as
the scheduler balances tiles, longest first), an exact dynamic program (`padding_ladder`).

Audio (samples with `audio_windows`): each LLM row packs its samples' audio frames, so the audio ladder
counts frames per row and is placed on the fullest row's frames, in multiples of 4 (packed windows'
alignment): n - 1 sizes up to the fullest row drawn, then one size that holds any row of the top
length bucket (`row_audio_frames`, about 4 frames per token), so every row the scheduler packs has
an audio bucket and only rows past every draw pay for it. Rows are drawn as the scheduler fills
them: balanced on tokens (`fullest_rows(..., by=tokens)`; a clip's tokens follow its frames, 4 to 1, so that balances
audio-only rows, and mixed rows hold their audio as it falls). The scheduler re-packs a
microbatch's rows for audio only where its buckets leave room (`scheduler.objective.balance_audio`),
which rows filled to their length bucket do not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts import BucketSet, SampleShape
from dflop_jax.contracts.shapes import row_audio_frames

LOW_FACTOR = 0.8  # smallest bucket relative to the mean per-shard load
HEADROOM = 1.5  # end of the dense part of the ladder, relative to the mean per-shard load
ROW_DRAWS = 512  # microbatches drawn to place a by-row tile ladder (`fullest_rows`)
ROW_SEED = 0  # their draws are fixed: the same data and layout give the same ladder


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


def padding_ladder(values: np.ndarray, top: int, n: int) -> tuple[int, ...]:
    """Up to `n` ascending positive integer sizes ending at `top` that minimize the summed padding of
    `values`, each rounded up to the smallest size holding it (values above `top` count as `top`,
    those under 1 as 1: a size holds at least one).

    Exact: an optimal ladder's lower sizes are among the distinct values (lowering a size to the
    largest value it holds pads less), so a dynamic program over them finds it: best[k][j] is the
    least padding of the values <= the j-th candidate with k sizes, the largest at that candidate.
    """
    v = np.clip(np.ceil(np.asarray(values, dtype=np.float64)), 1, top)
    cand, counts = np.unique(np.append(v, top), return_counts=True)  # ascending, top last
    counts[-1] -= 1  # the appended top is a candidate, not a value
    cum_n = np.concatenate([[0], counts.cumsum()])
    cum_s = np.concatenate([[0.0], (cand * counts).cumsum()])  # a candidate's values all equal it

    def pad(i, j: int):  # values of candidates i+1..j held by candidate j (i: int or array)
        return cand[j] * (cum_n[j + 1] - cum_n[i + 1]) - (cum_s[j + 1] - cum_s[i + 1])

    c, k_max = len(cand), min(n, len(cand))
    best = np.full((k_max + 1, c), np.inf)
    prev = np.zeros((k_max + 1, c), dtype=np.int64)
    best[1] = pad(-1, np.arange(c))
    for k in range(2, k_max + 1):
        for j in range(k - 1, c):  # the previous size i in k-2..j-1, one array op per j
            i = np.arange(k - 2, j)
            options = best[k - 1, i] + pad(i, j)
            at = int(np.argmin(options))
            best[k, j], prev[k, j] = options[at], i[at]
    k = int(np.argmin(best[1:, c - 1])) + 1  # fewer sizes when more would not pad less
    sizes, j = [], c - 1
    for kk in range(k, 0, -1):
        sizes.append(int(cand[j]))
        j = int(prev[kk, j])
    return tuple(sorted(sizes))


def fullest_rows(
    values: np.ndarray,
    samples: int,
    rows: int,
    draws: int = ROW_DRAWS,
    by: np.ndarray | None = None,
) -> np.ndarray:
    """The fullest row's `values` of `draws` microbatches of `samples` samples drawn from `values`
    (one per sample: tiles, audio frames), split over `rows` rows as the scheduler balances them on
    `by` (default: the values themselves): most first, each to the row with the least
    (`scheduler/rows.py`; audio rides on the rows the scheduler balances on tokens)."""
    by = values if by is None else by
    rng = np.random.default_rng(ROW_SEED)
    idx = rng.integers(0, len(values), size=(draws, max(samples, 1)))
    idx = np.take_along_axis(idx, np.argsort(-by[idx], axis=1, kind="stable"), axis=1)
    load, out = np.zeros((draws, rows)), np.zeros((draws, rows))
    at = np.arange(draws)
    for j in range(idx.shape[1]):
        r = load.argmin(axis=1)
        load[at, r] += by[idx[:, j]]
        out[at, r] += values[idx[:, j]]
    return out.max(axis=1)


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: the memos below key on it
class ShapeStats:
    """What the ladders need of a shape distribution (computed once per search)."""

    mean_tokens: float
    mean_tiles: float
    max_tokens: int
    max_tiles: int
    tiles: tuple[int, ...] = ()  # every sample's tiles (the by-row tile ladder draws from them)
    audio: tuple[int, ...] = ()  # every sample's audio frames; () when no sample has audio
    tokens: tuple[int, ...] = ()  # every sample's tokens, with audio (the audio ladder's rows)
    mean_audio: float = 0.0  # mean audio frames per sample

    @classmethod
    def of(cls, shapes: Sequence[SampleShape]) -> ShapeStats:
        tokens = np.array([s.tokens for s in shapes], dtype=np.float64)
        tiles = np.array([s.tiles for s in shapes], dtype=np.float64)
        audio = tuple(s.audio_frames for s in shapes)
        heard = any(audio)
        return cls(float(tokens.mean()), float(tiles.mean()), int(tokens.max()), int(tiles.max()),
                   tuple(int(s.tiles) for s in shapes), audio if heard else (),
                   tuple(int(s.tokens) for s in shapes) if heard else (),
                   float(np.mean(audio)) if heard else 0.0)  # fmt: skip


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
    pooled: bool = False,
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
      pooled: tiles are pooled by an encoder of its own (`Layout.pooled_tiles`): the lower tile
        sizes pad a microbatch's pool least, its tiles split evenly over the encoder's shards.
    """
    token_load = global_batch * stats.mean_tokens / (microbatches * llm_dp)
    tile_load = (
        global_batch * stats.mean_tiles / (microbatches * (llm_dp if by_row else encoder_dp))
    )
    lengths = ladder(token_load, stats.max_tokens, num_buckets, length_align)
    largest = stats.max_tiles if by_row else stats.max_tiles / encoder_dp
    tile_sizes = ladder(tile_load, largest, num_buckets, 1)
    samples = round(global_batch / microbatches)
    if by_row and len(tile_sizes) > 1 and stats.tiles:
        tile_sizes = _row_ladder(stats.tiles, samples, llm_dp, tile_sizes[-1], num_buckets)
    elif pooled and len(tile_sizes) > 1 and stats.tiles:
        tile_sizes = _pool_ladder(stats.tiles, samples, encoder_dp, tile_sizes[-1], num_buckets)
    audio = _audio_ladder(stats, samples, llm_dp, row_audio_frames(lengths[-1]), num_buckets)
    return BucketSet(tiles=tile_sizes, lengths=lengths, audio=audio)


def _audio_ladder(stats: ShapeStats, samples: int, rows: int, top: int, n: int):
    """The audio ladder (frames per row; module docstring) ending at `top`, () without audio. Rows
    without audio count as the smallest size, 4 frames."""
    if not stats.audio:
        return ()
    return _row_audio_ladder(stats.audio, stats.tokens, samples, rows, top, n)


@functools.lru_cache(maxsize=1024)  # the search asks per candidate; few (samples, rows, top) differ
def _row_audio_ladder(
    audio: tuple[int, ...], tokens: tuple[int, ...], samples: int, rows: int, top: int, n: int
):
    tokens, audio = np.asarray(tokens, float), np.asarray(audio, float)
    fullest = np.maximum(fullest_rows(audio, samples, rows, by=tokens), 4)
    drawn = _round_up(float(fullest.max()), 4)
    if n == 1 or drawn >= top:
        return (top,)
    return (*padding_ladder(fullest, drawn, n - 1), top)


@functools.lru_cache(maxsize=1024)
def _pool_ladder(tiles: tuple[int, ...], samples: int, shards: int, top: int, n: int):
    """A pooled ladder ending at `top`: the sizes that pad a microbatch's tiles per encoder shard
    least (the pool of `samples` drawn samples split evenly over `shards`)."""
    pool = np.ceil(fullest_rows(np.asarray(tiles), samples, 1) / shards)
    return padding_ladder(pool, top, n)


@functools.lru_cache(maxsize=1024)
def _row_ladder(tiles: tuple[int, ...], samples: int, rows: int, top: int, n: int):
    """A by-row ladder (tiles, or audio frames) ending at `top`: the sizes that pad the fullest row
    least (module docstring)."""
    return padding_ladder(fullest_rows(np.asarray(tiles), samples, rows), top, n)
