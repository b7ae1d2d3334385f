"""The scheduler's vocabulary, re-exported from `dflop_jax.contracts` (where the shared contracts live,
below every package that reads them): sample shapes in, a static-shape schedule out."""

from dflop_jax.contracts.schedule import (
    Schedule,
    ScheduledMicrobatch,
    ScheduleFn,
    ScheduleProblem,
    StageCostFn,
)
from dflop_jax.contracts.shapes import BucketSet, SampleShape

__all__ = [
    "BucketSet",
    "ScheduledMicrobatch",
    "SampleShape",
    "Schedule",
    "ScheduleFn",
    "ScheduleProblem",
    "StageCostFn",
]
