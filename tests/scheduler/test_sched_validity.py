"""Scheduler validity under random inputs: every sample exactly once, bucket capacities respected,
microbatch counts in range (shrunk to N when N is below it), no empty microbatch, lower bound <=
objective, objective = surrogate of the chosen buckets; the baselines too."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dflop_jax.scheduler import (
    BucketSet,
    SampleShape,
    ScheduleProblem,
    SchedulerConfig,
    data_blind_schedule,
    maxtext_packer_schedule,
    reference_exact_schedule,
    reference_like_schedule,
    schedule_batch,
    surrogate_step_time,
)

# no shrinking: a failure prints its (small) example as drawn, and the run stays fast
FAST = (Phase.explicit, Phase.reuse, Phase.generate)


def linear_costs(num_stages, a, b):
    """Encoder-ish stage 0 grows with tiles, the others with tokens (plus attention-like S^2)."""

    def fn(t, s):
        rows = [[a * t + 1e-3, 2 * (a * t + 1e-3)]]
        rows += [[b * s + 1e-9 * s * s, 2 * (b * s + 1e-9 * s * s)]] * (num_stages - 1)
        return np.array(rows)

    return fn


@st.composite
def instances(draw, sparse: bool = False):
    """(shapes, problem); `sparse`: the problem's buckets allow a random subset of the (tile,
    length) grid that holds the largest pair (`BucketSet.pairs`)."""
    n = draw(st.integers(1, 40))
    shapes = [
        SampleShape(f"s{i}", draw(st.integers(0, 12)), draw(st.integers(1, 3000)), "image")
        for i in range(n)
    ]
    edp, ldp = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    lo = draw(st.integers(1, 4))
    hi = lo + draw(st.integers(0, 3))
    tok = [s.tokens for s in shapes]
    til = [s.tiles for s in shapes]
    # largest buckets hold an LPT packing at the smallest count: mean load + largest item
    smax = max(tok) + sum(tok) // (lo * ldp) + 1
    tmax = max(1, -(-max(til) // edp) + -(-sum(til) // (lo * edp)) + 1)
    ns = draw(st.integers(1, 5))
    nt = draw(st.integers(1, 4))
    lengths = tuple(sorted({max(1, smax >> j) for j in range(ns)}))
    tiles = tuple(sorted({max(1, tmax >> j) for j in range(nt)}))
    p = draw(st.integers(1, 4))
    fn = linear_costs(p, draw(st.floats(1e-4, 1e-2)), draw(st.floats(1e-7, 1e-5)))
    pairs = ()
    if sparse:
        grid = [(t, s) for t in tiles for s in lengths]
        keep = draw(st.lists(st.booleans(), min_size=len(grid), max_size=len(grid)))
        pairs = tuple(sorted({g for g, k in zip(grid, keep) if k} | {(tiles[-1], lengths[-1])}))
    buckets = BucketSet(tiles, lengths, pairs)
    return shapes, ScheduleProblem(edp, ldp, p, (lo, hi), buckets, fn)


def check_valid(schedule, shapes, problem, dflop=True):
    seen = sorted(i for mb in schedule.microbatches for i in mb.samples())
    assert seen == list(range(len(shapes))), "every sample exactly once"
    if dflop:  # the baselines may leave the range (and, bucket-blind, leave microbatches empty)
        lo, hi = problem.microbatches
        assert min(lo, len(shapes)) <= len(schedule.microbatches) <= hi
        assert all(mb.samples() for mb in schedule.microbatches), "no empty microbatch"
    costs = []
    for mb in schedule.microbatches:
        assert len(mb.shards) == problem.llm_dp
        assert mb.tile_bucket in problem.buckets.tiles
        assert mb.length_bucket in problem.buckets.lengths
        assert problem.buckets.allows(mb.tile_bucket, mb.length_bucket), "an allowed pair"
        for shard in mb.shards:
            assert sum(shapes[i].tokens for i in shard) <= mb.length_bucket
        tiles = sum(shapes[i].tiles for i in mb.samples())
        assert tiles <= problem.encoder_dp * mb.tile_bucket
        per_shard = mb.encoder_tiles(shapes, problem.encoder_dp)
        assert all(len(x) <= mb.tile_bucket for x in per_shard)
        costs.append(problem.stage_costs(mb.tile_bucket, mb.length_bucket))
    assert schedule.objective == pytest.approx(surrogate_step_time(np.array(costs)), rel=1e-12)
    assert schedule.lower_bound <= schedule.objective * (1 + 1e-9)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    phases=FAST,
)
@given(instances())
def test_greedy_valid(inst):
    shapes, problem = inst
    s = schedule_batch(shapes, problem, SchedulerConfig(solver="greedy"))
    check_valid(s, shapes, problem)
    assert s.solver == "greedy"
    assert 0.0 <= s.info["padding_tokens"] < 1.0


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    phases=FAST,
)
@given(instances(sparse=True))
def test_greedy_valid_on_sparse_pairs(inst):
    """With a sparse pair set every microbatch takes an allowed pair and the reported objective is
    the surrogate of the pairs it runs at (`check_valid`)."""
    shapes, problem = inst
    check_valid(schedule_batch(shapes, problem, SchedulerConfig(solver="greedy")), shapes, problem)


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    phases=FAST,
)
@given(st.booleans().flatmap(lambda sparse: instances(sparse)))
def test_cpsat_valid_and_never_worse(inst):
    """Valid under both selection rules; the makespan rule's 1F1B makespan is never worse than the
    surrogate rule's, and under the surrogate rule the refinement never worsens the surrogate (the
    makespan rule may trade surrogate for makespan: `test_sched_select.py`)."""
    shapes, problem = inst
    mk = {}
    for select in ("makespan", "surrogate"):
        cfg = SchedulerConfig(solver="cpsat", time_limit_s=0.3, select=select)
        s = schedule_batch(shapes, problem, cfg)
        check_valid(s, shapes, problem)
        mk[select] = s.info["simulated_makespan_s"]
    # the makespan rule runs the surrogate rule's order search on its pick among its finalists
    assert mk["makespan"] <= mk["surrogate"] * (1 + 1e-12)
    assert s.objective <= s.info["greedy_objective"] * (1 + 1e-12)


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    phases=FAST,
)
@given(instances())
def test_baselines_valid(inst):
    shapes, problem = inst
    m = problem.microbatches[0]
    blind = data_blind_schedule(shapes, problem, m)
    check_valid(blind, shapes, problem, dflop=False)
    assert len(blind.microbatches) >= m
    assert all(mb.length_bucket == problem.buckets.lengths[-1] for mb in blind.microbatches)
    for ref in (
        reference_like_schedule(shapes, problem, m),
        reference_exact_schedule(shapes, problem, m, deterministic_time=0.05),
    ):
        check_valid(ref, shapes, problem, dflop=False)
        assert len(ref.microbatches) == m + ref.info["extra_microbatches"]
    packed = maxtext_packer_schedule(shapes, problem, m)
    check_valid(packed, shapes, problem, dflop=False)
    assert all(mb.samples() for mb in packed.microbatches)  # rows open only for a sample
    assert all(mb.length_bucket == problem.buckets.lengths[-1] for mb in packed.microbatches)


@pytest.mark.parametrize("solver", ["greedy", "auto"])
def test_fewer_samples_than_microbatches_shrinks_the_count(solver):
    # 3 samples, at least 4 microbatches of 2 shards allowed: 3 microbatches, one sample each
    problem = ScheduleProblem(
        1, 2, 3, (4, 6), BucketSet((2, 4), (512, 1024)), linear_costs(3, 1e-3, 1e-6)
    )
    shapes = [SampleShape(i, 1, 300 + 100 * i) for i in range(3)]
    s = schedule_batch(shapes, problem, SchedulerConfig(solver=solver))
    check_valid(s, shapes, problem)
    assert sorted(len(mb.samples()) for mb in s.microbatches) == [1, 1, 1]
    assert "3 samples < 4 microbatches" in s.info["microbatches_below_range"]


def test_samples_that_fit_fewer_microbatches_use_fewer():
    # 5 small text samples fit one microbatch; the allowed range 1..4 must not spread them over 4
    problem = ScheduleProblem(
        1, 1, 2, (1, 4), BucketSet((1,), (256, 1024)), linear_costs(2, 1e-3, 1e-6)
    )
    shapes = [SampleShape(i, 0, 100) for i in range(5)]
    s = schedule_batch(shapes, problem, SchedulerConfig(solver="greedy"))
    check_valid(s, shapes, problem)
    # one microbatch at S=1024 costs less than two at S=256 plus the fill/drain term: W grows < 2x
    assert len(s.microbatches) == 1


def test_surrogate_hand_computed():
    # 2 microbatches, 3 stages: per-mb max stage (fwd+bwd) = 3 and 5 -> 3 + 5 + 2 * 5 = 18
    costs = np.array([[[1, 2], [0.5, 0.5], [1, 1]], [[1, 1], [2, 3], [0, 1]]], dtype=float)
    assert surrogate_step_time(costs) == pytest.approx(18.0)


def test_oversized_sample_named():
    problem = ScheduleProblem(1, 1, 1, (1, 1), BucketSet((2,), (100,)), linear_costs(1, 1e-3, 1e-6))
    with pytest.raises(ValueError, match="'big'"):
        schedule_batch([SampleShape("big", 0, 101)], problem, SchedulerConfig(solver="greedy"))
    with pytest.raises(ValueError, match="'wide'"):
        schedule_batch([SampleShape("wide", 3, 10)], problem, SchedulerConfig(solver="greedy"))


def test_baseline_api_runs_all_and_picks_the_strongest():
    from dflop_jax.scheduler import BASELINES, run_baselines, strongest

    problem = ScheduleProblem(
        2, 2, 3, (2, 2), BucketSet((2, 4, 8), (512, 1024, 2048)), linear_costs(3, 1e-3, 1e-6)
    )
    shapes = [SampleShape(i, i % 4, 100 + 97 * i) for i in range(12)]
    results = run_baselines(shapes, problem, 2)
    assert list(results) == list(BASELINES)
    name, best = strongest(results)
    assert best.objective == min(s.objective for s in results.values()) and results[name] is best
    by_makespan = strongest(results, key=lambda s: s.info["simulated_makespan_s"])[1]
    assert by_makespan.info["simulated_makespan_s"] == min(
        s.info["simulated_makespan_s"] for s in results.values()
    )
    dflop = schedule_batch(shapes, problem, SchedulerConfig(solver="auto"))
    assert dflop.objective <= best.objective  # same evaluator, same objective
    with pytest.raises(ValueError, match="unknown baseline"):
        run_baselines(shapes, problem, 2, ["megatron"])


def test_tiles_packed_by_row_with_a_separate_encoder():
    """A separate encoder (dp 1) before an LLM at dp 3 x tp 2, tiles packed by row: each
    microbatch's tile bucket covers its fullest row (not the encoder's share of the total), and its
    plans say how its rows' blocks align, which the packer's slots follow (3 rows of the bucket
    rounded up to a multiple of 2)."""
    rng = np.random.default_rng(5)
    shapes = [
        SampleShape(i, int(rng.integers(0, 6)), int(rng.integers(20, 200))) for i in range(18)
    ]
    costs = lambda t, s: np.array([[1e-3 * t, 2e-3 * t], [1e-5 * s, 2e-5 * s]])  # noqa: E731
    problem = ScheduleProblem(1, 3, 2, (2, 3), BucketSet((3, 5, 8), (256, 512)), costs,
                              tiles_by_row=True, row_align=2)  # fmt: skip
    schedule = schedule_batch(shapes, problem, SchedulerConfig(solver="greedy"))
    assert sorted(i for mb in schedule.microbatches for i in mb.samples()) == list(range(18))
    for mb in schedule.microbatches:
        rows = [sum(shapes[i].tiles for i in shard) for shard in mb.shards]
        smaller = [t for t in problem.buckets.tiles if t < mb.tile_bucket]
        assert max(rows) <= mb.tile_bucket and all(t < max(rows) for t in smaller)
        assert mb.tiles_by_row and mb.row_align == 2
        assert mb.tile_slots(1) == 3 * (-(-mb.tile_bucket // 2) * 2)


@pytest.mark.parametrize("select", ["surrogate", "makespan"])
def test_a_batch_whose_greedy_pick_breaks_a_row_tile_cap_gets_a_fitting_schedule(select):
    """The heavy-tailed mix (805 tiles in this batch, at most 40 per row by the ladder) with the
    microbatch count free in 4..16: every greedy candidate breaks some row's cap until `finish`
    re-packs the rows, so the surrogate's pick alone failed ("no schedule keeps every row's tiles
    within the largest tile bucket"); any choice rule now returns a schedule whose rows fit."""
    import dataclasses

    from dflop_jax.bench.scheduler import DP, MODELS, TP, heavy_tailed_mix
    from dflop_jax.scheduler.model_problem import model_problem
    from dflop_jax.scheduler.workloads import default_buckets, sample_global_batch

    dist = heavy_tailed_mix(20000, 1)
    buckets = default_buckets(dist, 8, DP, DP, batch_size=256, num_lengths=10, num_tiles=8,
                              growth=2**0.25, by_row=True)  # fmt: skip
    problem = model_problem(MODELS["heavy"], "h100", buckets, (4, 16), DP, DP, (1, 1), TP)
    rng = np.random.default_rng(0)
    sample_global_batch(dist, 256, rng)
    batch = sample_global_batch(dist, 256, rng)
    assert problem.tiles_by_row and sum(s.tiles for s in batch) == 805
    cfg = SchedulerConfig(solver="auto", time_limit_s=1.0, select=select)
    schedule = schedule_batch(batch, dataclasses.replace(problem, microbatches=(4, 16)), cfg)
    assert np.isfinite(schedule.objective)
    for mb in schedule.microbatches:
        rows = [sum(batch[i].tiles for i in shard) for shard in mb.shards]
        assert max(rows) <= mb.tile_bucket <= problem.buckets.tiles[-1]
