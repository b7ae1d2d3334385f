"""The planner's screen: one typical batch, sorted and cut into
M microbatches, each at the buckets of its FULLEST shard. A packed row holds whole samples, so at one
sample per shard (tp2 dp32 M=8 on 64 GPUs, feasible once the LLM is frozen) a microbatch's length
bucket is its longest sample, which the former mean-load screen (every shard at the mean sample)
missed, ranking such layouts first and dropping the better tp4 dp16 from the shortlist."""

import numpy as np

from dflop_jax.contracts import BucketSet
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
from dflop_jax.planner import PlannerConfig
from dflop_jax.planner.buckets import ShapeStats
from dflop_jax.planner.candidates import Candidate
from dflop_jax.planner.scoring import (
    LayoutCosts,
    ScreenBatch,
    candidate_buckets,
    mean_shape_buckets,
    screen_buckets,
    screen_step_time,
)
from dflop_jax.scheduler import SampleShape, llava_ov_mix


def _colocated(tp, dp, layers=28):
    llm = StageSpec("llm", 0, layers, tp=tp, dp=dp, has_embedding=True, has_head=True)
    return Layout((), (llm,))


def test_screen_buckets_by_hand():
    tokens = [100, 900, 300, 500, 200, 800, 400, 700]
    shapes = [SampleShape(i, 2 * (i % 3), t, "image") for i, t in enumerate(tokens)]
    batch = ScreenBatch.of(shapes, 8)  # 8 quantiles of 8 samples: each sample once, sorted
    assert list(batch.tokens) == sorted(tokens)
    buckets = BucketSet((1, 2, 4, 8), (256, 512, 768, 1024))
    cand = Candidate(_colocated(1, 2), microbatches=2, num_buckets=4)
    # microbatch 0: 100, 200, 300, 400 on 2 rows: 500 tokens per row on average, the longest 400
    # -> 512; microbatch 1: 500..900: (500+600+...)/2 = 1450 > the top bucket -> 1024 (clamped)
    lengths = [s for _, s, _ in screen_buckets(cand, buckets, batch)]
    assert lengths == [512, 1024]
    one_per_row = Candidate(_colocated(1, 4), microbatches=2, num_buckets=4)
    # 4 samples on 4 rows: the row of the longest sample sets the bucket (400 -> 512, 900 -> 1024)
    assert [s for _, s, _ in screen_buckets(one_per_row, buckets, batch)] == [512, 1024]
    # tiles stay on their rows (a colocated encoder at the stage's tp): the fullest row's tiles
    tiles = [t for t, _, _ in screen_buckets(one_per_row, buckets, batch)]
    by_tokens = sorted(shapes, key=lambda s: (s.tokens, s.tiles))
    assert tiles == [min(b for b in buckets.tiles if b >= max(s.tiles for s in half))
                     for half in (by_tokens[:4], by_tokens[4:])]  # fmt: skip


def test_one_sample_per_shard_is_screened_at_its_longest_samples():
    arch, h100 = get_arch("siglip-so400m+qwen2.5-7b"), get_device("h100")
    shapes = llava_ov_mix(4000, seed=0)
    config = PlannerConfig(trainable=("projector",))
    stats, batch = ShapeStats.of(shapes), ScreenBatch.of(shapes, config.global_batch)
    cand = Candidate(_colocated(2, 32), microbatches=8, num_buckets=6)  # 256 / (8 x 32) = 1
    buckets = candidate_buckets(cand, stats, config)
    pairs = screen_buckets(cand, buckets, batch)
    slices = np.array_split(batch.tokens, 8)
    for (_, length, _), part in zip(pairs, slices):
        assert length >= min(part.max(), buckets.lengths[-1])
    # the mean-load bucket the former screen used for all 8 is far below the longer slices'
    mean_length = mean_shape_buckets(cand, buckets, stats, config)[1]
    assert mean_length < sorted(s for _, s, _ in pairs)[-2]
    provider = AnalyticCostProvider(arch, h100, remat=True, trainable=("projector",))
    costs = LayoutCosts.build(provider, cand.layout)
    mean_step = 8 * costs.stage(*mean_shape_buckets(cand, buckets, stats, config)).sum()
    assert screen_step_time(costs, cand, buckets, batch, "1f1b") > 1.2 * mean_step
