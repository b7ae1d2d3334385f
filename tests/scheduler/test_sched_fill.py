"""Minimum-slack filling: exact subset sums against brute force, and a batch whose bucket target only
an exact filling reaches (LPT and best-fit stop one bucket step above it)."""

import itertools

import numpy as np

from dflop_jax.scheduler import (
    BucketSet,
    SampleShape,
    ScheduleProblem,
    SchedulerConfig,
    schedule_batch,
)
from dflop_jax.scheduler.fill import _closest_subset, fill_assign
from dflop_jax.scheduler.greedy import lpt_assign, shrink
from dflop_jax.scheduler.objective import CostTable, evaluate


def test_closest_subset_is_the_best_sum_under_the_cap():
    rng = np.random.default_rng(0)
    for _ in range(40):
        sizes = rng.integers(1, 60, size=int(rng.integers(1, 10)))
        cap = int(rng.integers(1, 200))
        picked = _closest_subset(sizes, cap)
        assert len(set(picked.tolist())) == len(picked)
        best = max(
            sum(c)
            for r in range(len(sizes) + 1)
            for c in itertools.combinations(sizes.tolist(), r)
            if sum(c) <= cap
        )
        assert sizes[picked].sum() == best


def costs(t, s):
    return np.array([[1e-3 * t, 2e-3 * t], [1e-5 * s, 2e-5 * s]])


def test_exact_filling_reaches_a_target_lpt_misses():
    # 4 bins of 100 tokens hold 12 samples summing to exactly 400 (only as 10+10+80, 52+11+37,
    # 30+29+41, 40+7+53 or another exact split); any bin over 100 needs the 128 bucket
    sizes = [10, 10, 80, 52, 11, 37, 30, 29, 41, 40, 7, 53]
    shapes = [SampleShape(i, 0, s) for i, s in enumerate(sizes)]
    prob = ScheduleProblem(1, 2, 2, (2, 2), BucketSet((1,), (100, 128)), costs)
    table = CostTable.build(prob)
    tok = np.array(sizes, float)
    til = np.zeros(len(sizes))
    target = [(0, 0), (0, 0)]
    filled = fill_assign(tok, til, target, prob, table)
    loads = np.bincount(filled, weights=tok, minlength=4)
    assert loads.tolist() == [100.0] * 4
    lpt = shrink(lpt_assign(tok, til, 2, prob), 2, tok, til, prob, table)
    assert (
        evaluate(lpt, 2, tok, til, prob, table)[0] > evaluate(filled, 2, tok, til, prob, table)[0]
    )
    s = schedule_batch(shapes, prob, SchedulerConfig(solver="greedy"))
    assert [mb.length_bucket for mb in s.microbatches] == [100, 100] and s.gap < 1e-9
