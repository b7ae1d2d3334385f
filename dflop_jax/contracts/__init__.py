"""The contracts between DFLOP's parts (DESIGN section 2: below every other package).

Each module is one shared vocabulary or file format, pure Python (NumPy at most), importing nothing
from dflop_jax outside this package:
  shapes              `SampleShape` (a sample before decoding), `BucketSet` (the compiled shapes)
  schedule            `ScheduleProblem`, `Schedule` of one global batch, `ScheduleFn` (the loader's hook)
  shape_distribution  the dataset's shape-distribution file (data profiler -> planner)
  cost_table          the model profiler's cost-table file (profiler -> measured cost model)
"""

from dflop_jax.contracts.batch_schedule import (
    Schedule,
    ScheduledMicrobatch,
    ScheduleFn,
    ScheduleProblem,
    StageCostFn,
    row_tile_slots,
    schedule_digest,
)
from dflop_jax.contracts.cost_table import CostEntry, ProfiledCostTable, load_table, save_table
from dflop_jax.contracts.shape_distribution import (
    load_shape_distribution,
    save_shape_distribution,
)
from dflop_jax.contracts.shapes import BucketSet, SampleShape, kept_frames

__all__ = [
    "BucketSet",
    "CostEntry",
    "ScheduledMicrobatch",
    "ProfiledCostTable",
    "SampleShape",
    "Schedule",
    "ScheduleFn",
    "ScheduleProblem",
    "StageCostFn",
    "load_shape_distribution",
    "load_table",
    "row_tile_slots",
    "save_shape_distribution",
    "save_table",
    "kept_frames",
    "schedule_digest",
]
