"""Balanced layer splits: give a stage that also runs something else (the colocated encoder, the patch
embedding, the projector, the LM head) or that holds more in-flight activations fewer layers.

An even split (`candidates.split_layers`) ignores that LLM stage 0 of a colocated layout also runs the
whole encoder, that the last LLM stage runs the LM head, and that the encoder's first and last stages
run the patch embedding and the projector. Two splits are derived from a stage model that is affine in
its layer count, value_s(n) = fixed_s + n x slope_s:

- cost (`balanced_layout`): value = the stage's time at the mean-shape buckets, slope = one layer of
  its module, the same on every stage of the module;
- memory (`memory_balanced_layout`): value = the stage's peak bytes at the largest buckets with its
  schedule's in-flight microbatches, slope = one layer's state plus its activations times that
  stage's in-flight count (1F1B keeps P - s microbatches alive on stage s, so early stages pay more
  per layer). A layout over memory with an even or cost-balanced split may fit with this one.

The split minimizing max_s value_s within one module is found by water-filling: start every stage at
one layer and give each next layer to the stage whose value after taking it is lowest (optimal for this
separable min-max with non-negative slopes). Each module is balanced on its own (their layers cannot
move across).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from dflop_jax.contracts.layout import Layout, StageSpec


def balanced_layout(
    provider, layout: Layout, stage_costs: np.ndarray, buckets: tuple[int, ...]
) -> Layout:
    """`layout` with each pipelined module's layers re-split to balance `stage_costs` ([P, 2] at the
    mean-shape `buckets`: the tile bucket, tokens per LLM row, and audio frames per LLM row).

    Returns `layout` itself when no split changes.
    """
    totals = np.asarray(stage_costs, dtype=np.float64).sum(axis=1)  # [P]

    def slopes(stages: tuple[StageSpec, ...], bucket: int) -> list[float]:
        one = _with_layers(stages[0], 1)
        return [float(sum(provider.stage_time(one, bucket)))] * len(stages)

    return _rebalanced_layout(layout, totals, slopes, buckets)


def memory_balanced_layout(
    provider, layout: Layout, stage_bytes: Sequence[float], buckets: tuple[int, ...],
    in_flight: Sequence[int],
) -> Layout:  # fmt: skip
    """`layout` with each pipelined module's layers re-split to balance `stage_bytes` (peak bytes per
    device of each stage at the largest (tile, length, audio) `buckets` with `in_flight[s]`
    microbatches alive).

    Returns `layout` itself when no split changes.
    """

    def slopes(stages: tuple[StageSpec, ...], bucket: int) -> list[float]:
        offset = layout.stages.index(stages[0])
        out = []
        for i, s in enumerate(stages):
            one, two = (provider.stage_memory(_with_layers(s, n), bucket) for n in (1, 2))
            count = in_flight[offset + i]
            out.append(max(0.0, two.total(count) - one.total(count)))
        return out

    return _rebalanced_layout(layout, np.asarray(stage_bytes, dtype=np.float64), slopes, buckets)


def _with_layers(stage: StageSpec, n: int) -> StageSpec:
    """`stage` holding only its module's first `n` layers, nothing else (no embedding or head)."""
    return StageSpec(stage.module, 0, n, tp=stage.tp, dp=stage.dp)


def _rebalanced_layout(layout: Layout, totals: np.ndarray, slopes, buckets: tuple[int, ...]):
    """`buckets`: (tile, length[, audio]); each module's stages balanced at its shard's bucket."""
    e, f = len(layout.encoder_stages), layout.first_llm
    audio = layout.audio_frames(buckets[2] if len(buckets) > 2 else 0)
    enc = _rebalanced(layout.encoder_stages, totals[:e], slopes, layout.encoder_tiles(buckets[0]))
    aud = _rebalanced(layout.audio_stages, totals[e:f], slopes, audio)
    llm = _rebalanced(layout.llm_stages, totals[f:], slopes, buckets[1])
    if (enc, aud, llm) == (layout.encoder_stages, layout.audio_stages, layout.llm_stages):
        return layout
    return dataclasses.replace(layout, encoder_stages=enc, audio_stages=aud, llm_stages=llm)


def _rebalanced(stages: tuple[StageSpec, ...], totals, slopes, bucket: int):
    """The stages of one module with their layer counts water-filled (see the module docstring)."""
    if len(stages) < 2:
        return stages
    per_layer = slopes(stages, bucket)
    fixed = [float(totals[i]) - s.num_layers * per_layer[i] for i, s in enumerate(stages)]
    counts = water_fill(fixed, per_layer, sum(s.num_layers for s in stages))
    if counts == [s.num_layers for s in stages]:
        return stages
    out, start = [], 0
    for s, n in zip(stages, counts):
        out.append(dataclasses.replace(s, first_layer=start, num_layers=n))
        start += n
    return tuple(out)


def water_fill(fixed: Sequence[float], slopes: Sequence[float], total: int) -> list[int]:
    """Layer counts (each >= 1, summing to `total`) minimizing max_s fixed_s + n_s x slopes_s.

    A heap of (value after one more layer, stage): the same choices, ties to the lower stage, as a
    scan of every stage per layer, in O(total log P)."""
    counts = [1] * len(fixed)
    heap = [(fixed[j] + 2 * slopes[j], j) for j in range(len(fixed))]
    heapq.heapify(heap)
    for _ in range(total - len(fixed)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (fixed[i] + (counts[i] + 1) * slopes[i], i))
    return counts
