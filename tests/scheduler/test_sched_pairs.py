"""Sparse (tile, length) pair sets: what `BucketSet.pairs` accepts, and the scheduler's cost table
pricing a pair outside the set as the cheapest allowed pair that holds it (checked by brute force)."""

import itertools

import numpy as np
import pytest

from dflop_jax.scheduler import BucketSet, ScheduleProblem
from dflop_jax.scheduler.objective import CostTable


def test_pairs_must_be_grid_pairs_holding_the_largest():
    with pytest.raises(ValueError, match="must hold the largest pair"):
        BucketSet((4, 8), (64, 128), ((4, 64),))
    with pytest.raises(ValueError, match="are not .tile bucket, length bucket. pairs"):
        BucketSet((4, 8), (64, 128), ((4, 96), (8, 128)))
    with pytest.raises(ValueError, match="distinct pairs, ascending"):
        BucketSet((4, 8), (64, 128), ((8, 128), (4, 64)))
    whole = BucketSet((4, 8), (64, 128), tuple(itertools.product((4, 8), (64, 128))))
    assert whole == BucketSet((4, 8), (64, 128)) and whole.grid  # one spelling of the grid
    sparse = BucketSet((4, 8), (64, 128), ((4, 64), (8, 128)))
    assert sparse.allowed() == ((4, 64), (8, 128)) and not sparse.allows(8, 64)
    assert sparse.covering(5, 10) == [(8, 128)] and sparse.smallest_covering(2, 10) == (4, 64)
    assert BucketSet.from_dict(sparse.to_dict()) == sparse


@pytest.mark.parametrize("seed", range(5))
def test_cost_table_prices_a_pair_as_its_cheapest_allowed_cover(seed):
    rng = np.random.default_rng(seed)
    tiles, lengths = (2, 4, 8, 16), (64, 128, 256)
    grid = list(itertools.product(tiles, lengths))
    keep = {g for g in grid if rng.random() < 0.4} | {(16, 256)}
    cost = {g: rng.uniform(0.1, 1.0, (2, 2)) for g in grid}  # not monotone: a cover may be cheaper
    problem = ScheduleProblem(1, 1, 2, (1, 4), BucketSet(tiles, lengths, tuple(sorted(keep))),
                              lambda t, s: cost[t, s])  # fmt: skip
    table = CostTable.build(problem)
    for (ti, t), (si, s) in itertools.product(enumerate(tiles), enumerate(lengths)):
        covers = [g for g in keep if g[0] >= t and g[1] >= s]
        cheapest = min(cost[g].sum(axis=1).max() for g in covers)
        assert table.w[ti, si] == pytest.approx(cheapest)
        bt, bs = table.best[ti, si]
        assert (tiles[bt], lengths[bs]) in keep
        assert cost[tiles[bt], lengths[bs]].sum(axis=1).max() == pytest.approx(cheapest)
        np.testing.assert_allclose(table.stage[ti, si], cost[tiles[bt], lengths[bs]])
