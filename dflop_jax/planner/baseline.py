"""The data-blind baseline's pieces (DESIGN section 8): its scheduler and the mean-shape batch it plans on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflop_jax.planner.scoring import SchedulePolicy
from dflop_jax.scheduler import SampleShape


def mean_shape_batch(shapes: Sequence[SampleShape], global_batch: int) -> list[SampleShape]:
    """`global_batch` copies of the distribution's mean sample (tiles and tokens rounded to integers)."""
    tiles = round(float(np.mean([s.tiles for s in shapes])))
    tokens = max(1, round(float(np.mean([s.tokens for s in shapes]))))
    return [SampleShape(i, tiles, tokens, "mean") for i in range(global_batch)]


def data_blind_scheduler() -> SchedulePolicy:
    """Loader-order microbatches, in-order first-fit into the largest bucket, fixed microbatch count."""
    from dflop_jax.scheduler import data_blind_schedule

    return lambda batch, problem: data_blind_schedule(batch, problem, problem.microbatches[0])
