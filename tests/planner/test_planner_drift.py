"""Drift, measured (`planner/drift.py`): the running plan against the planner's best for the recent
batches, both scored on those batches; and the monitor that runs it off the caller's thread."""

import math
import threading

import numpy as np
import pytest

from dflop_jax.costs import AnalyticCostProvider, get_arch, get_device
from dflop_jax.planner import PlannerConfig, make_plan
from dflop_jax.planner.drift import Drift, DriftMonitor, measure_drift, score_on
from dflop_jax.planner.resolve import ResolvedPlan
from dflop_jax.planner.scoring import sample_batches
from dflop_jax.scheduler import SampleShape

ARCH, DEVICE = get_arch("tiny"), get_device("cpu")
CONFIG = PlannerConfig(
    global_batch=16, microbatches=(2, 4), samples=2, screen_top=3, top_n=3, llm_pp=(1, 2)
)


def _mix(n: int, seed: int, video_share: float) -> list[SampleShape]:
    """Single images, and a `video_share` of 24-32-frame videos."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if rng.random() < video_share:
            t = int(rng.integers(24, 33))
            out.append(SampleShape(i, t, 64 + 16 * t + int(rng.integers(10, 100)), "video"))
        else:
            out.append(SampleShape(i, 1, 80 + int(rng.integers(10, 200)), "image"))
    return out


@pytest.fixture(scope="module")
def running():
    provider = AnalyticCostProvider(ARCH, DEVICE)
    plan = make_plan(ARCH, DEVICE, 8, _mix(300, 7, 0.3), CONFIG, provider)
    return ResolvedPlan.of(plan, provider)


def test_regret_grows_when_the_data_drifts_from_the_plan(running):
    planned_for = sample_batches(_mix(200, 11, 0.3), 16, 3, 3)
    drifted = sample_batches(_mix(200, 11, 0.0), 16, 3, 3)  # the videos are gone
    same, moved = (
        measure_drift(9, b, running, ARCH, DEVICE, CONFIG) for b in (planned_for, drifted)
    )
    assert same.regret < 0.05
    # Without videos the plan's tile and length buckets are far too large: the planner's pick for
    # these batches (smaller buckets) is much faster on them.
    assert moved.regret > 0.2 and moved.planned_s < moved.running_s
    assert moved.regret == pytest.approx(moved.running_s / moved.planned_s - 1)
    assert moved.best.buckets.lengths[-1] < running.buckets.lengths[-1]
    # Both are the planner's expected step time on exactly these batches.
    assert moved.running_s == score_on(drifted, running, CONFIG, "1f1b")
    assert moved.step == 9 and moved.batches == 3
    assert (
        f"plan_regret after step 9: {moved.regret:.1%} over the last 3 batches" in moved.describe()
    )


def test_regret_is_never_negative_and_infinite_when_the_plan_cannot_hold_the_batches():
    assert Drift(1, 2, 1.0, 2.0, None).regret == 0.0  # the planner's pick is slower: keep running
    assert Drift(1, 2, 3.0, 2.0, None).regret == pytest.approx(0.5)
    assert math.isinf(Drift(1, 2, math.inf, 2.0, None).regret)


def test_monitor_measures_the_last_window_off_thread_and_skips_while_busy():
    release, seen = threading.Event(), []

    def measure(step, batches):
        seen.append((step, [b[0].id for b in batches], threading.current_thread().name))
        release.wait(10)
        return Drift(step, len(batches), 2.0, 1.0, None)

    monitor = DriftMonitor(measure, window=2)
    for k in range(1, 4):
        monitor.add([SampleShape(k, 0, 10)])
    assert monitor.measure(3)
    monitor.add([SampleShape(4, 0, 10)])
    assert not monitor.measure(4)  # the one after step 3 still runs
    assert monitor.poll() == []
    release.set()
    monitor.join()
    (drift,) = monitor.poll()
    assert drift.step == 3 and drift.regret == pytest.approx(1.0)
    assert seen == [(3, [2, 3], "dflop-drift3")]  # the last 2 batches, on the monitor's thread
    assert monitor.poll() == []


def test_replan_takes_the_pick_over_the_threshold_with_buckets_covering_the_old(running):
    from dflop_jax.contracts import BucketSet
    from dflop_jax.runtime.replan import covering, describe, next_plan, wants_replan

    drifted = sample_batches(_mix(200, 11, 0.0), 16, 3, 3)
    drift = measure_drift(6, drifted, running, ARCH, DEVICE, CONFIG)
    assert wants_replan(drift, 0.1) and not wants_replan(drift, drift.regret)
    assert not wants_replan(None, 0.1) and not wants_replan(Drift(1, 2, 3.0, 1.0, None), 0.1)
    old = running
    new = next_plan(drift, old)
    assert new.layout == drift.best.layout and new.provider is running.provider
    # The pick's ladders (made for image-only batches) topped with the old largest buckets: a
    # video the run accepted before still fits.
    assert new.buckets.lengths[:-1] == drift.best.buckets.lengths
    assert new.buckets.lengths[-1] == running.buckets.lengths[-1]
    assert new.buckets.tiles[-1] == max(running.buckets.tiles[-1], drift.best.buckets.tiles[-1])
    assert covering(BucketSet((2, 4), (64, 128)), BucketSet((1, 3), (32, 96))) == BucketSet(
        (2, 4), (64, 128)
    )
    line = describe(drift, old, new, 9)
    assert line.startswith(f"re-plan after step 9: plan_regret {drift.regret:.1%}")
    assert f"{drift.running_s * 1e3:.1f} ms/step on the recent data -> new" in line
