"""The planner's speed-ups change no answer: water-filling by heap, memoized memory and buckets."""

import numpy as np
import pytest

from dflop_jax.planner.balance import water_fill


def _scan_water_fill(fixed, slopes, total):
    """The original rule: per layer, scan every stage for the lowest value after taking it."""
    counts = [1] * len(fixed)
    for _ in range(total - len(fixed)):
        i = min(range(len(fixed)), key=lambda j: (fixed[j] + (counts[j] + 1) * slopes[j], j))
        counts[i] += 1
    return counts


@pytest.mark.parametrize("seed", range(20))
def test_heap_water_fill_equals_the_scan(seed):
    rng = np.random.default_rng(seed)
    p = int(rng.integers(1, 9))
    total = p + int(rng.integers(0, 60))
    # integers on a coarse grid make ties (equal values after a layer) frequent
    fixed = [float(x) for x in rng.integers(0, 6, p)]
    slopes = [float(x) for x in rng.integers(0, 4, p)]
    assert water_fill(fixed, slopes, total) == _scan_water_fill(fixed, slopes, total)
