"""Adaptive cost correction: factors converge to a synthetic bias, the auto rule, checkpoint state."""

import json

import numpy as np
import pytest

from dflop_jax.scheduler import (
    BucketSet,
    CostCorrection,
    SampleShape,
    ScheduleProblem,
    Scheduler,
    SchedulerConfig,
)

BIAS = np.array([[1.5, 1.3], [0.8, 0.9]])  # true / predicted per (stage, fwd|bwd)


def raw_costs(t, s):
    return np.array([[1e-3 * t, 2e-3 * t], [1e-6 * s, 2e-6 * s]])


def make(correction, bias=BIAS, threshold=0.1):
    prob = ScheduleProblem(2, 2, 2, (2, 2), BucketSet((2, 4, 8), (500, 1000, 2000)), raw_costs)
    cfg = SchedulerConfig(solver="greedy", correction=correction, correction_threshold=threshold,
                          correction_min_observations=4, correction_rate=0.5)  # fmt: skip
    return Scheduler(prob, cfg), lambda sched: np.array(
        [raw_costs(mb.tile_bucket, mb.length_bucket) * bias for mb in sched.microbatches]
    )


def batches(k, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(k):
        n = int(rng.integers(4, 12))
        yield [
            SampleShape(i, int(rng.integers(0, 5)), int(rng.integers(50, 600))) for i in range(n)
        ]


def run(sched, truth, k=20, seed=0):
    for shapes in batches(k, seed):
        s = sched.schedule(shapes)
        sched.observe(s, truth(s))


def test_factors_converge_to_bias():
    sched, truth = make("on")
    run(sched, truth)
    observed = np.argwhere(sched.correction.counts > 0)
    assert len(observed) > 0
    for ti, si in observed:
        np.testing.assert_allclose(sched.correction.factors[ti, si], BIAS, rtol=1e-9)
    err = sched.prediction_error()
    # raw error per entry = |1/b - 1|, averaged over the four (stage, direction) entries
    assert err["raw_mape"] == pytest.approx(np.mean(np.abs(1 / BIAS - 1)), rel=1e-9)
    assert err["corrected_mape"] < 0.05 * err["raw_mape"]
    # corrected predictions now equal the truth
    fn = sched.current_problem().stage_costs
    np.testing.assert_allclose(fn(4, 1000), raw_costs(4, 1000) * BIAS, rtol=1e-9)


def test_ema_converges_under_noise_and_unobserved_pairs_fall_back():
    prob = ScheduleProblem(2, 1, 2, (1, 1), BucketSet((2, 4), (500, 1000)), raw_costs)
    corr = CostCorrection(prob, rate=0.1)
    rng = np.random.default_rng(0)
    raw = raw_costs(2, 500)
    for _ in range(300):
        corr.update(0, 0, raw * BIAS * rng.uniform(0.95, 1.05, size=(2, 2)), raw)
    np.testing.assert_allclose(corr.factors[0, 0], BIAS, rtol=0.03)
    # never observed: the count-weighted mean of observed pairs
    np.testing.assert_allclose(corr.factor(1, 1), corr.factors[0, 0])
    corr.update(1, 0, raw * 2.0, raw)
    np.testing.assert_allclose(corr.factor(1, 1), (300 * corr.factors[0, 0] + 2.0) / 301)


def test_auto_switches_on_only_for_large_errors():
    small, truth_small = make("auto", bias=np.full((2, 2), 1.03))
    run(small, truth_small, k=6)
    assert small.prediction_error()["observations"] >= 4 and not small.active
    large, truth_large = make("auto")
    first = large.schedule(next(batches(1, seed=5)))
    assert not first.info["correction_active"]
    run(large, truth_large, k=6)
    assert large.active
    assert large.schedule(next(batches(1, seed=6))).info["correction_active"]


def test_off_reports_but_never_corrects():
    sched, truth = make("off")
    run(sched, truth, k=5)
    assert not sched.active
    assert np.all(sched.correction.factors == 1.0)
    assert sched.prediction_error()["raw_mape"] > 0.2


def test_state_dict_round_trip():
    sched, truth = make("auto")
    run(sched, truth, k=8)
    state = json.loads(json.dumps(sched.state_dict()))
    restored, _ = make("auto")
    restored.load_state_dict(state)
    assert restored.prediction_error() == sched.prediction_error()
    np.testing.assert_array_equal(restored.correction.factors, sched.correction.factors)
    shapes = next(batches(1, seed=9))
    assert restored.schedule(shapes).microbatches == sched.schedule(shapes).microbatches


def test_bad_measurement_shape_and_state():
    sched, _ = make("on")
    s = sched.schedule(next(batches(1)))
    with pytest.raises(ValueError, match="expected"):
        sched.observe(s, np.zeros((len(s.microbatches) + 1, 2, 2)))
    state = sched.state_dict()
    state["lengths"] = [1, 2, 3]
    with pytest.raises(ValueError, match="buckets"):
        sched.load_state_dict(state)


def test_data_blind_solver_runs_the_baseline_through_the_scheduler():
    """`solver: data_blind` (the trainer's A/B switch) gives the baseline's schedule, largest buckets."""
    from dflop_jax.scheduler import data_blind_schedule

    prob = ScheduleProblem(2, 2, 2, (2, 3), BucketSet((2, 4, 8), (500, 1000, 2000)), raw_costs)
    blind = Scheduler(prob, SchedulerConfig(solver="data_blind"))
    dflop = Scheduler(prob, SchedulerConfig(solver="greedy"))
    worse = 0
    for shapes in batches(10):
        got = blind.schedule(shapes)
        ref = data_blind_schedule(shapes, prob, 2)
        assert [mb.shards for mb in got.microbatches] == [mb.shards for mb in ref.microbatches]
        assert {(mb.tile_bucket, mb.length_bucket) for mb in got.microbatches} == {(8, 2000)}
        worse += got.objective > dflop.schedule(shapes).objective
    assert worse >= 8  # the baseline pays for padding on (nearly) every batch
