"""Pooled tiles (`Layout.pooled_tiles`): an encoder on stages of its own taking a microbatch's tiles
as one pool, beside tiles packed by LLM row. What the layout means, how the planner enumerates,
prices and saves it, and what the scheduler pads under each."""

import dataclasses

import numpy as np
import pytest
from plan_fixtures import tiny_analytic_plan

from dflop_jax.contracts import BucketSet, ScheduleProblem
from dflop_jax.contracts.layout import Layout, StageSpec
from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device, layout_memory
from dflop_jax.costs.provider import boundary_shards, pooled_features_bytes
from dflop_jax.planner.candidates import describe_layout, enumerate_candidates
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.plan_file import load_plan, save_plan

ENC = (StageSpec("encoder", 0, 2, tp=1, dp=1, has_embedding=True, has_head=True),)
LLM = (StageSpec("llm", 0, 4, tp=2, dp=3, has_embedding=True, has_head=True),)
BY_ROW, POOLED = Layout(ENC, LLM), Layout(ENC, LLM, pooled_tiles=True)


def test_a_pooled_layout_buckets_tiles_per_encoder_shard():
    assert BY_ROW.tiles_by_row and not POOLED.tiles_by_row
    # by row: 3 row blocks of the bucket (each a multiple of the LLM's tp) on the one encoder shard
    assert BY_ROW.encoder_tiles(5) == 3 * 6
    assert POOLED.encoder_tiles(5) == 5  # pooled: the bucket is the encoder shard's tiles
    assert describe_layout(POOLED) == "enc tp1 pp1 dp1 pooled | llm tp2 pp1 dp3"


@pytest.mark.parametrize(
    "kwargs",
    [dict(encoder_stages=()), dict(audio_stages=(StageSpec("audio", 0, 2, dp=1),))],
    ids=["colocated", "audio stages"],
)
def test_pooled_tiles_need_an_encoder_of_their_own_and_no_audio_stages(kwargs):
    with pytest.raises(ValueError, match="pooled_tiles: needs an encoder on stages of its own"):
        dataclasses.replace(POOLED, **kwargs)


def test_the_pool_is_gathered_over_every_device_of_the_first_llm_stage():
    """The boundary moves the same across (one copy, all of it sent by the one encoder device);
    inside the stage, of pieces of 3 tiles, a row's block is gathered over its tp devices (1 other
    piece), a pool over all 6 (5 other pieces)."""
    row_across, row_within = boundary_shards(BY_ROW, 0, 18)
    pool_across, pool_within = boundary_shards(POOLED, 0, 18)
    assert row_across == pool_across == 1.0
    assert (row_within, pool_within) == (1 * 3 / 18, 5 * 3 / 18)


def test_the_first_llm_stage_of_a_pooled_layout_holds_the_pool():
    provider = AnalyticCostProvider(get_arch("tiny"), get_device("cpu"))
    buckets = BucketSet((4, 8), (128,))
    row = layout_memory(provider, BY_ROW, buckets)
    pool = layout_memory(provider, POOLED, buckets)
    extra = pooled_features_bytes(provider, POOLED, 8)
    tpt, d = provider.arch.vision.tokens_per_tile, provider.arch.llm.hidden_size
    assert extra == 2 * 8 * tpt * d * 2  # the pool and its gradient, bf16
    assert pool[1].temp == pytest.approx(row[1].temp + extra)
    # the encoder: 8 tiles at bucket 8 pooled, 3 row blocks of 8 by row
    assert pool[0].total(1) == provider.stage_memory(ENC[0], 8).total(1)
    assert row[0].total(1) == provider.stage_memory(ENC[0], 24).total(1)


def test_the_planner_tries_both_packings_for_a_separate_encoder_only():
    arch = get_arch("tiny")
    config = PlannerConfig(global_batch=8, microbatches=(2,), num_buckets=(2,), tp=(1,),
                           llm_pp=(1,), encoder_pp=(1,))  # fmt: skip
    layouts = {c.layout for c in enumerate_candidates(arch, 3, 8, config)}
    separate = {
        dataclasses.replace(lay, pooled_tiles=False) for lay in layouts if lay.encoder_stages
    }
    assert separate and {dataclasses.replace(lay, pooled_tiles=True) for lay in separate} <= layouts
    assert not any(lay.pooled_tiles for lay in layouts if not lay.encoder_stages)
    off = dataclasses.replace(config, pooled_tiles=False)
    assert not any(c.layout.pooled_tiles for c in enumerate_candidates(arch, 3, 8, off))


def test_a_pooled_plan_survives_its_file(tmp_path):
    pooled = Layout(
        (StageSpec("encoder", 0, 2, tp=1, dp=2, has_embedding=True, has_head=True),),
        (StageSpec("llm", 0, 4, tp=2, dp=1, has_embedding=True, has_head=True),),
        pooled_tiles=True,
    )
    back = load_plan(save_plan(tiny_analytic_plan(pooled), tmp_path / "plan.yaml"))
    assert back.layout == pooled
    by_row = load_plan(save_plan(tiny_analytic_plan(), tmp_path / "row.yaml"))
    assert not by_row.layout.pooled_tiles
    assert "pooled_tiles" not in (tmp_path / "row.yaml").read_text()


def test_pooling_pads_fewer_encoder_tiles_than_rows():
    """Three rows of 1, 2 and 6 tiles: by row the encoder computes 3 blocks of the fullest row's
    bucket (8, padded to tp 2), pooled the 9 tiles rounded up to the pool's bucket (12)."""
    from dflop_jax.contracts import ScheduledMicrobatch

    by_row = ScheduledMicrobatch(8, 64, ((0,), (1,), (2,)), tiles_by_row=True, row_align=2)
    pooled = ScheduledMicrobatch(12, 64, ((0,), (1,), (2,)))
    assert by_row.tile_slots(1) == 24 and pooled.tile_slots(1) == 12
    problem = ScheduleProblem(1, 3, 2, (1, 1), BucketSet((12,), (64,)), lambda *a: np.zeros((2, 2)))
    assert problem.tile_shards == 1  # a pool: the encoder's one shard holds them all


def _anyres_shapes(n=400, seed=0):
    """LLaVA-OV-like: a fifth text, images of 1-37 tiles (heavy-tailed), 196 tokens a tile."""
    from dflop_jax.contracts import SampleShape

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = 0 if rng.random() < 0.2 else int(min(37, 1 + rng.pareto(1.2) * 3))
        out.append(
            SampleShape(i, t, int(t * 196 + rng.integers(50, 600)), "image" if t else "text")
        )
    return out


def test_the_planner_pools_tiles_where_the_encoder_dominates():
    """SigLIP-6B before Qwen2.5-7B on 16 H100s (encoders on stages of their own): packed by row the
    encoder computes llm_dp blocks of the fullest row's tiles; the planner prices the pool and
    picks it, for a lower predicted step than the best layout packed by row (1.40 s against
    1.44 s)."""
    from dflop_jax.planner import make_plan

    config = PlannerConfig(global_batch=64, microbatches=(4, 8), samples=2, screen_top=4,
                           top_n=3, tp=(1, 2, 4, 8), llm_pp=(1, 2), encoder_pp=(1,),
                           colocate=False)  # fmt: skip
    shapes = _anyres_shapes()
    pooled = make_plan("siglip-6b+qwen2.5-7b", "h100", 16, shapes, config)
    by_row = make_plan("siglip-6b+qwen2.5-7b", "h100", 16, shapes,
                       dataclasses.replace(config, pooled_tiles=False))  # fmt: skip
    assert pooled.layout.pooled_tiles and not by_row.layout.pooled_tiles
    assert pooled.step_time_mean_s < 0.985 * by_row.step_time_mean_s
